"""Moved to :mod:`kvgate.drive.runs`."""

from kvgate.drive.runs import command  # noqa: F401  # moved: re-export until merge
