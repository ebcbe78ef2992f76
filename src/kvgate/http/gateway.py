from kvgate.gateway import Gateway, GatewayConfig  # noqa: F401  # moved: re-export until merge
from kvgate.gateway.command import command  # noqa: F401  # moved: re-export until merge
