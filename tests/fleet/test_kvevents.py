"""KV cache events: both of vLLM's encodings decode alike; the residency view follows stores, removals and clears."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.fleet.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventError,
    Residency,
    decode_batch,
    decode_message,
    encode_batch,
    encode_message,
)
from support.old_kv_events import OldBatch, OldCleared, OldRemoved, OldStored


def test_vllm_tagged_map_encoding_decodes() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    batch = kv.KVEventBatch(
        ts=12.5,
        events=[
            kv.BlockStored(
                block_hashes=[11, 12],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                session_id="s-7",
            ),
            kv.BlockStored(
                block_hashes=[b"\x01" * 32],
                parent_block_hash=12,
                token_ids=list(range(16)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            kv.BlockRemoved(block_hashes=[11], medium="GPU"),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    got = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert got.ts == 12.5 and got.data_parallel_rank == 0
    s1, s2, r, c = got.events
    assert s1 == BlockStored((11, 12), None, tuple(range(32)), 16, None, "GPU", None, "s-7")
    assert s2.block_hashes == (b"\x01" * 32,) and s2.parent_block_hash == 12 and s2.session_id is None
    assert r == BlockRemoved((11,), "GPU") and c == AllBlocksCleared()


def test_older_positional_encoding_decodes() -> None:
    old = OldBatch(3.0, [OldStored([5, 6], 4, list(range(8)), 4, None, None), OldRemoved([5], None), OldCleared()])
    got = decode_batch(msgspec.msgpack.Encoder().encode(old))
    assert got.events == (BlockStored((5, 6), 4, tuple(range(8)), 4), BlockRemoved((5,)), AllBlocksCleared())
    assert got.data_parallel_rank is None


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_own_encodings_read_back_by_vllm_schemas(encoding: str) -> None:
    """What kvgate engine publishes is what vLLM's consumers (and older ones) would read."""
    ev = (BlockStored((1, 2), None, tuple(range(8)), 4), BlockRemoved((2,)), AllBlocksCleared())
    payload = encode_batch(EventBatch(1.0, ev, 0), encoding)
    if encoding == "array":
        back = msgspec.msgpack.Decoder(OldBatch).decode(payload)
        assert [type(e).__name__ for e in back.events] == ["OldStored", "OldRemoved", "OldCleared"]
        assert back.events[0].block_hashes == [1, 2]
    else:
        kv = pytest.importorskip("vllm.distributed.kv_events")
        back = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(payload)
        assert [type(e).__name__ for e in back.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
        assert back.events[0].token_ids == list(range(8))
    assert decode_batch(payload).events == ev


def test_message_framing_and_bad_payloads() -> None:
    frames = encode_message(41, EventBatch(0.0, (AllBlocksCleared(),)), topic="kv")
    seq, batch = decode_message(frames)
    assert seq == 41 and batch.events == (AllBlocksCleared(),)
    for bad in (b"\xc1", msgspec.msgpack.encode([1.0, [["Nope"]]]), msgspec.msgpack.encode({"x": 1}),
                msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])):
        with pytest.raises(KVEventError):
            decode_batch(bad)
    with pytest.raises(KVEventError):
        decode_message([b"", b"\x00", b""])


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("store"), st.lists(st.integers(0, 30), min_size=1, max_size=4), st.sampled_from(["a", "b", None])
        ),
        st.tuples(st.just("remove"), st.lists(st.integers(0, 30), min_size=1, max_size=4), st.none()),
        st.tuples(st.just("clear"), st.just([]), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from(["map", "array"]))
def test_residency_matches_a_direct_model(seq: list, encoding: str) -> None:
    """The folded view equals a direct model (a hash resident while it has copies: one per store, less one per
    removal) of the same operations, through either encoding (the older
    positional one carries no session id, so there stores count for the replica only)."""
    res = Residency()
    model: dict[int, set[str]] = {}
    copies: dict[int, int] = {}
    for i, (op, hashes, sid) in enumerate(seq):
        if op == "store":
            ev: BlockStored | BlockRemoved | AllBlocksCleared = BlockStored(tuple(hashes), None, (), 16, session_id=sid)
            for h in hashes:
                model.setdefault(h, set()).update({sid} if sid and encoding == "map" else set())
                copies[h] = copies.get(h, 0) + 1
        elif op == "remove":
            ev = BlockRemoved(tuple(hashes))
            for h in hashes:
                if h in copies:
                    copies[h] -= 1
                    if copies[h] == 0:
                        del copies[h], model[h]
        else:
            ev = AllBlocksCleared()
            model.clear()
            copies.clear()
        res.apply_message(*decode_message(encode_message(i, EventBatch(float(i), (ev,)), encoding=encoding)))
    assert set(res.blocks) == set(model)
    assert res.resident_tokens == 16 * len(model)
    for s in ("a", "b"):
        assert res.tokens_of(s) == 16 * sum(1 for owners in model.values() if s in owners)
    assert res.gaps == 0


def test_sequence_gaps_are_counted() -> None:
    res = Residency()
    for seq in (0, 1, 3, 4, 9):
        res.apply_message(seq, EventBatch(0.0, ()))
    assert res.gaps == 2
