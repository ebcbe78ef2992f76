"""Moved to :mod:`kvgate.drive.client`."""

from kvgate.drive.client import normalize_endpoint  # noqa: F401  # moved: re-export until merge
