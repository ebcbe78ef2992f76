"""``kvgate gateway``: the policy core in front of an OpenAI-compatible engine (see :mod:`kvgate.gateway.app`)."""

from kvgate.gateway.app import Gateway
from kvgate.gateway.config import GatewayConfig

__all__ = ["Gateway", "GatewayConfig"]
