"""vLLM's KV cache events (``--kv-events-config``), decoded, encoded, and folded into what each replica holds.

A vLLM engine with KV events enabled publishes, on a ZMQ PUB socket, multipart messages
``(topic, seq: 8-byte big-endian, payload)`` where the payload is one msgpack ``KVEventBatch``: an array
``[ts, events, data_parallel_rank?]``. Each event is ``BlockStored`` (block hashes, parent hash, token ids, block
size, LoRA, medium, and since vLLM 0.2x group, session id ...), ``BlockRemoved`` (block hashes, medium) or
``AllBlocksCleared``, in one of two encodings:

* tagged map (vLLM ≥ 0.11, ``msgspec`` ``tag=True`` structs): ``{"type": "BlockStored", "block_hashes": ...}``;
* positional array (older vLLM, ``array_like=True`` structs): ``["BlockStored", block_hashes, parent, token_ids,
  block_size, lora_id, medium]``.

Both decode to the same :class:`BlockStored` / :class:`BlockRemoved` / :class:`AllBlocksCleared`. A block hash is
an int or bytes (vLLM's ``ExternalBlockHash``). :class:`Residency` folds a replica's event stream into the set of
resident blocks and, through the session id vLLM attaches to stores (its ``X-Session-ID`` header), the resident
tokens of each session: what a prefix-affinity router and a residency-corrected budget need.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

BlockHash = int | bytes

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


class KVEventError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    group_idx: int | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def _hashes(v: Any) -> tuple[BlockHash, ...]:
    if not isinstance(v, list | tuple) or not all(isinstance(h, int | bytes) for h in v):
        raise KVEventError("block_hashes must be a list of ints or bytes")
    return tuple(v)


def _event(raw: Any) -> KVEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
        get = raw.get
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == BLOCK_STORED else _REMOVED_FIELDS if kind == BLOCK_REMOVED else ()
        values = dict(zip(names, raw[1:], strict=False))
        get = values.get
    else:
        raise KVEventError(f"not a KV event: {type(raw).__name__}")
    if kind == BLOCK_STORED:
        size = get("block_size")
        if not isinstance(size, int) or size <= 0:
            raise KVEventError("BlockStored without a positive block_size")
        parent = get("parent_block_hash")
        session = get("session_id")
        return BlockStored(
            _hashes(get("block_hashes")), parent if isinstance(parent, int | bytes) else None,
            tuple(get("token_ids") or ()), size, get("lora_id"), get("medium"), get("group_idx"),
            session if isinstance(session, str) else None,
        )
    if kind == BLOCK_REMOVED:
        return BlockRemoved(_hashes(get("block_hashes")), get("medium"), get("group_idx"))
    if kind == ALL_BLOCKS_CLEARED:
        return AllBlocksCleared()
    raise KVEventError(f"unknown KV event type {kind!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """One msgpack ``KVEventBatch`` payload (either event encoding); raises :class:`KVEventError`."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise KVEventError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):  # a batch encoded as a map (not vLLM's, but cheap to accept)
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list | tuple):
        raise KVEventError("a KV event batch is [ts, events, data_parallel_rank?]")
    ts = raw[0]
    if not isinstance(ts, int | float):
        raise KVEventError("a KV event batch's ts must be a number")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return EventBatch(float(ts), tuple(_event(e) for e in raw[1]), rank)


def decode_message(frames: Sequence[bytes]) -> tuple[int, EventBatch]:
    """A ZMQ multipart message ``(topic, seq, payload)`` to its sequence number and batch."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventError("a KV event message is (topic, 8-byte seq, payload)")
    return int.from_bytes(frames[1], "big", signed=True), decode_batch(frames[2])


def _as_map(e: KVEvent) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        d: dict[str, Any] = {
            "type": BLOCK_STORED, "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_block_hash,
            "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": e.lora_id, "medium": e.medium,
            "lora_name": None,
        }
        if e.group_idx is not None:
            d["group_idx"] = e.group_idx
        if e.session_id is not None:
            d["session_id"] = e.session_id
        return d
    if isinstance(e, BlockRemoved):
        d = {"type": BLOCK_REMOVED, "block_hashes": list(e.block_hashes), "medium": e.medium}
        if e.group_idx is not None:
            d["group_idx"] = e.group_idx
        return d
    return {"type": ALL_BLOCKS_CLEARED}


def _as_array(e: KVEvent) -> list[Any]:
    if isinstance(e, BlockStored):
        return [BLOCK_STORED, list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size,
                e.lora_id, e.medium]
    if isinstance(e, BlockRemoved):
        return [BLOCK_REMOVED, list(e.block_hashes), e.medium]
    return [ALL_BLOCKS_CLEARED]


def encode_batch(batch: EventBatch, encoding: str = "map") -> bytes:
    """A batch as vLLM publishes it: ``encoding`` "map" (tagged, vLLM ≥ 0.11) or "array" (positional, older)."""
    if encoding not in ("map", "array"):
        raise ValueError(f"unknown KV event encoding {encoding!r}; choose map or array")
    conv = _as_map if encoding == "map" else _as_array
    body: list[Any] = [batch.ts, [conv(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)


def encode_message(seq: int, batch: EventBatch, topic: str = "", encoding: str = "map") -> list[bytes]:
    """The multipart ZMQ message for one batch."""
    return [topic.encode(), seq.to_bytes(8, "big", signed=True), encode_batch(batch, encoding)]


MAX_NAMED = 1 << 16
"""Session names a view remembers (:attr:`Residency.named`) before it forgets them all."""


@dataclass
class Residency:
    """What one replica holds, folded from its KV events: resident blocks, and resident tokens per session.

    vLLM (in its default ``incremental`` report mode) publishes one ``BlockStored`` per block copy it caches and one
    ``BlockRemoved`` per copy it evicts; a block whose tokens a request recomputed while an older copy was still
    cached has two copies under one hash. So a hash is resident while it has copies: stores and removals are
    counted per hash. A block stored by several sessions counts for each of them; stores without a session id
    count for the replica, not for a session. Sequence gaps (a lost message: ZMQ PUB drops under its high-water
    mark) are counted in :attr:`gaps`: after one the view is approximate until the next clear.
    """

    blocks: dict[BlockHash, tuple[int, int, frozenset[str]]] = field(default_factory=dict)
    """Resident block hash → (its tokens, its copies, the sessions that stored it)."""
    session_tokens: dict[str, int] = field(default_factory=dict)
    last_seq: int | None = None
    gaps: int = 0
    events: int = 0
    clears: int = 0
    """``AllBlocksCleared`` events applied (the engine's prefix cache was reset)."""
    resident_tokens: int = 0
    """Tokens of the resident blocks (each hash once, whatever its copies)."""
    named: set[str] = field(default_factory=set)
    """Sessions whose stores this view has seen named since it started (kept across ``AllBlocksCleared``: after a
    flush such a session is known to hold nothing). A session not in it may be unnamed by the engine (an older
    vLLM publishes no session id; a client may name its session in a way the engine does not read): its residency
    is unknown, not 0 (:meth:`known_tokens`)."""
    _gaps_at_clear: int = 0

    def apply(self, events: Iterable[KVEvent]) -> None:
        for e in events:
            self.events += 1
            if isinstance(e, BlockStored):
                self._store(e)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    self._remove(h)
            else:
                self.blocks.clear()
                self.session_tokens.clear()
                self.resident_tokens = 0
                self.clears += 1
                self._gaps_at_clear = self.gaps

    def clear(self) -> None:
        """Forget what the replica holds and where its stream stood (it went down, or its publisher restarted): the
        next message starts the view anew. The counters stay."""
        self.blocks.clear()
        self.session_tokens.clear()
        self.resident_tokens = 0
        self.named.clear()
        self.last_seq = None
        self._gaps_at_clear = self.gaps

    @property
    def exact(self) -> bool:
        """No message was lost since the view last started from empty (a clear, or the stream's first message)."""
        return self.gaps == self._gaps_at_clear

    def apply_message(self, seq: int, batch: EventBatch) -> None:
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq
        self.apply(batch.events)

    def _store(self, e: BlockStored) -> None:
        per = e.block_size
        sid = e.session_id
        if sid is not None and sid not in self.named:
            if len(self.named) >= MAX_NAMED:  # (sessions that never end here: forget them all, unknown again)
                self.named.clear()
            self.named.add(sid)
        for h in e.block_hashes:
            held = self.blocks.get(h)
            copies, owners = (held[1], held[2]) if held is not None else (0, frozenset())
            if sid is not None and sid not in owners:
                owners = owners | {sid}
                self.session_tokens[sid] = self.session_tokens.get(sid, 0) + per
            if held is None:
                self.resident_tokens += per
            self.blocks[h] = (per, copies + 1, owners)

    def _remove(self, h: BlockHash) -> None:
        held = self.blocks.get(h)
        if held is None:
            return
        per, copies, owners = held
        if copies > 1:
            self.blocks[h] = (per, copies - 1, owners)
            return
        del self.blocks[h]
        self.resident_tokens -= per
        for s in owners:
            left = self.session_tokens[s] - per
            if left > 0:
                self.session_tokens[s] = left
            else:
                del self.session_tokens[s]

    def tokens_of(self, session: str) -> int:
        """Resident tokens of ``session``'s blocks on this replica (0 when none or unknown)."""
        return self.session_tokens.get(session, 0)

    def known_tokens(self, session: str) -> int | None:
        """Resident tokens of ``session`` if this view has seen it named (else None: unknown)."""
        return self.session_tokens.get(session, 0) if session in self.named else None

    def forget(self, session: str) -> None:
        """``session`` ended: drop its name (its blocks, if any, stay until evicted)."""
        self.named.discard(session)
