"""kvgate: keep prefix-cached LLM engines serving agent sessions out of the metastable degraded regime."""

__version__ = "0.1.0"
