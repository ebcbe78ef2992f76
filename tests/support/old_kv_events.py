"""vLLM's KV event structs before the tagged maps (vLLM <= 0.10, ``vllm/distributed/kv_events.py`` then):
positional arrays tagged by class name, rebuilt from its published schema, to check the older encoding with."""

from __future__ import annotations

import msgspec


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[OldStored | OldRemoved | OldCleared]
    data_parallel_rank: int | None = None
