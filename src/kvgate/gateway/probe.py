"""A request as lineage reads it (:class:`Probe`): its items digested, its tips and its head, or a completions
prompt's bytes and their CRCs at chunk boundaries; what :mod:`kvgate.gateway.lineage` matches against its
sessions' trails (that module's docstring: the theory of operation).

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Iterator
from hashlib import blake2b
from typing import Any

from kvgate.http.dialect import Api, Parts

WHOLE = 4096
SAMPLE = 1024
TIP_ITEMS = 3
"""Items a tip covers (the last ones): what the previous turn added, so two branches ending alike stay apart."""
CHUNK = 4096
"""Bytes between a completions prompt's boundaries once past the first ones (256, 512, ..., 4096)."""


def digest(parts: Parts) -> int:
    """A 64-bit digest of an item: BLAKE2b of its role, text and tool calls (stable across processes: the books
    keep it through a restart). A text over :data:`WHOLE` characters is digested by its length, its first and its
    last :data:`SAMPLE` characters (what tells two items apart is seldom only in the middle of a long tool
    result; the cost of a turn stays that of its ends)."""
    return int.from_bytes(digest_bytes(parts), "little")


def digest_bytes(parts: Parts) -> bytes:
    """:func:`digest` as its 8 bytes (little-endian), as a tip's CRC reads them."""
    role, text, calls = parts
    n = len(text)
    if n > WHOLE:
        text = text[:SAMPLE] + text[-SAMPLE:]
    data = b"%b\0%d\0%b" % (role.encode(), n, text.encode("utf-8", "surrogatepass"))
    for cid, name, args in calls:
        data += f"\0{cid}\0{name}\0{args}".encode("utf-8", "surrogatepass")
    return blake2b(data, digest_size=8).digest()


FIRST_BOUNDARY = 256


def boundaries(size: int) -> Iterator[int]:
    """The chunk boundaries of a prompt of ``size`` bytes, ascending."""
    b = FIRST_BOUNDARY
    while b <= size:
        yield b
        b = b * 2 if b < CHUNK else b + CHUNK


class Probe:
    """One request as lineage reads it: its conversation (each item read, digested and each tip computed at most
    once, on demand) or prompt bytes."""

    __slots__ = ("api", "ns", "head", "items", "n", "_parts", "_digests", "_tips", "_head", "_root", "data",
                 "_crcs", "_chars")

    def __init__(self, api: Api, ns: Any, head: list[Any], items: list[Any], data: bytes | None = None) -> None:
        self.api = api
        self.ns = ns
        self.head = head
        self.items = items
        self.n = len(items)
        self._parts: dict[int, Parts] = {}
        self._digests: dict[int, bytes] = {}
        self._tips: dict[int, int] = {}
        self._head: int | None = None
        self._root = -1
        self.data = data
        """A completions prompt's bytes (None for a conversation)."""
        self._crcs: dict[int, int] | None = None
        self._chars = -1

    def parts(self, i: int) -> Parts:
        """Item ``i`` (0-based) as its API reads it."""
        got = self._parts.get(i)
        if got is None:
            got = self._parts[i] = self.api.parts(self.items[i])
        return got

    def _bytes(self, i: int) -> bytes:
        """Item ``i``'s digest, as its 8 bytes."""
        d = self._digests.get(i)
        if d is None:
            got = self._parts.get(i)
            if got is None:
                it = self.items[i]
                if type(it) is dict and len(it) == 2 and type(role := it.get("role")) is str \
                        and type(text := it.get("content")) is str:
                    got = (role, text, ())  # (a role and a text alone: read alike by every API)
                else:
                    got = self.api.parts(it)
                self._parts[i] = got
            d = self._digests[i] = digest_bytes(got)
        return d

    def digest(self, i: int) -> int:
        """The digest of item ``i`` (0-based)."""
        return int.from_bytes(self._bytes(i), "little")

    def tip(self, m: int) -> int:
        """The digest of the request's first ``m`` items as a trail keeps it: its last :data:`TIP_ITEMS` items'."""
        c = self._tips.get(m)
        if c is None:
            c = 0
            i = m - TIP_ITEMS if m > TIP_ITEMS else 0
            at = self._bytes
            while i < m:
                c = zlib.crc32(at(i), c)
                i += 1
            c = self._tips[m] = (c << 32) | (m & 0xFFFFFFFF)
        return c

    @property
    def root(self) -> int:
        r = self._root
        if r < 0:
            r = self._root = int.from_bytes(self._bytes(0), "little")
        return r

    @property
    def head_digest(self) -> int:
        if self._head is None:
            c = 0
            for it in self.head:
                c = zlib.crc32(digest_bytes(self.api.parts(it)), c)
            self._head = c
        return self._head

    @property
    def chars(self) -> int:
        """The text characters of its items."""
        if self._chars < 0:
            self._chars = self.new_chars(0)
        return self._chars

    def new_chars(self, start: int) -> int:
        """The text characters of its items from ``start`` on."""
        parts = self.parts
        return sum([len(parts(i)[1]) for i in range(start, self.n)])

    def crcs(self) -> dict[int, int]:
        """CRC-32 of the prompt's bytes up to each boundary."""
        if self._crcs is None:
            data = self.data or b""
            view = memoryview(data)
            out: dict[int, int] = {}
            c, prev = 0, 0
            for b in boundaries(len(data)):
                c = zlib.crc32(view[prev:b], c)
                out[b] = c
                prev = b
            self._crcs = out
        return self._crcs


def prompt_bytes(body: dict[str, Any], raw: bytes) -> bytes | None:
    """A completions prompt's bytes: a text prompt encoded, token ids as the raw body carries them (the same client
    writes them the same way every turn), else packed; None for batches and odd prompts."""
    prompt = body.get("prompt")
    if type(prompt) is list and len(prompt) == 1 and type(prompt[0]) in (str, list):
        prompt = prompt[0]
    if type(prompt) is str:
        return prompt.encode("utf-8", "surrogatepass") if prompt else None
    if type(prompt) is not list or not prompt or type(prompt[0]) is not int:
        return None
    i = raw.find(b'"prompt"')
    j = raw.find(b"[", i) if i >= 0 else -1
    k = raw.find(b"]", j) if j >= 0 else -1
    if k > j >= 0 and raw.count(b",", j, k) + 1 == len(prompt) and b"[" not in raw[j + 1 : k]:
        return raw[j + 1 : k].strip()
    try:
        return array("q", prompt).tobytes()
    except (TypeError, OverflowError):
        return None
