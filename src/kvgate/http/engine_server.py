"""``kvgate engine`` lives in :mod:`kvgate.serve`."""

from kvgate.serve.app import EngineServer  # noqa: F401  # moved: re-export until merge
from kvgate.serve.command import command  # noqa: F401  # moved: re-export until merge
from kvgate.serve.config import ServerConfig  # noqa: F401  # moved: re-export until merge
