"""What every store of the session books provides, whatever the backend: :class:`BookStore` and its row format.

:func:`kvgate.gateway.store.open_store` chooses the backend from a URL (the embedded SQLite store of
``--state-dir``, or Redis with ``--store``)."""

from __future__ import annotations

from typing import Any, Protocol

VERSION = 1

Rows = list[tuple[str, bytes]]


class BookStore(Protocol):
    """What keeps the books across restarts, whatever the backend (:func:`kvgate.gateway.store.open_store`).

    The contract (``tests/gateway/test_store_contract.py`` holds every backend to it): :meth:`write` is one
    transaction (the meta, the changed rows, the ended sessions out: all of it or none, even when the process is
    killed inside it); once it has returned, a store opened again on the same URL :meth:`load` reads exactly what was
    written (the last row of each session, no ended one, the last value of each meta key); what a crash loses is
    only what was never written."""

    url: str
    """Where the books are, as messages and ``/kvgate/info`` name them."""
    errors: tuple[type[BaseException], ...]
    """What a failed :meth:`write` raises (counted and logged; the next flush writes again)."""

    def load(self) -> tuple[dict[str, Any], list[dict[str, Any]]]: ...

    def write(self, meta: dict[str, Any], rows: Rows, gone: list[str]) -> None: ...

    def close(self) -> None: ...
