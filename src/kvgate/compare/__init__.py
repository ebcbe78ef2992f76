"""kvgate beside its competitors (vllm-router, Dynamo) on the same engines: ``kvgate compare``."""
