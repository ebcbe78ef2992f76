"""Moved to :mod:`kvgate.drive`: the driver in :mod:`kvgate.drive.driver`, the command in ``kvgate.drive.command``."""

from kvgate.drive.command import command  # noqa: F401  # moved: re-export until merge
from kvgate.drive.driver import DriveConfig, Driver, DriveResult, drive, validate  # noqa: F401  # moved: re-export until merge
from kvgate.drive.prompts import WORDS as _WORDS  # noqa: F401  # moved: re-export until merge
