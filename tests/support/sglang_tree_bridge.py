"""SGLang's own radix cache, driven over a pipe: the SGLang side of ``tests/support/sglang_tree_oracle.py``.

Runs in SGLang's venv (``.ci/install-sglang.sh``), not in kvgate's Python: ``python sglang_tree_bridge.py``
reads one JSON command a line on stdin and answers one JSON line on stdout. It holds SGLang 0.5.23's
``UnifiedRadixCache`` (tree core ``rust`` or ``python``) over SGLang's real ``ReqToTokenPool``,
``MHATokenToKVPool`` and ``TokenToKVPoolAllocator`` (page size 1, on the CPU), and drives it with SGLang's own
request-level calls, the ones its scheduler makes:

* ``match``: a ``Req`` of the request's tokens (prompt, plus the output so far after a retraction), then
  ``Req.init_next_round_input`` (``match_kv_cache`` capped at ``len - 1``); the hit is ``req.prefix_len``;
* ``lock`` / ``unlock``: ``tree.lock(req.last_node)`` (``PrefillAdder``) / ``tree.unlock``;
* ``alloc``: ``alloc_token_slots`` (evicts the shortfall, then allocates); the slots are handed to requests as
  their tokens are computed, written into their ``req_to_token`` rows with the prefix the match found;
* ``room``: ``TokenToKVPoolAllocator.check_decode_capacity`` (``check_decode_mem``, also the retraction's evict);
* ``insert``: ``checkpoint_kv_cache`` (after a prefill chunk; ``checkpoint_into_tree``);
* ``finish``: the request finished by length, then ``release_kv_cache(checkpoint=True)``;
* ``release``: ``release_kv_cache(checkpoint=False)`` (retraction, abort);
* ``flush``: ``flush_cache``'s reset of the tree and the pools (only when idle).

Every answer carries the allocator's free slots, the tree's evictable and protected sizes and the nodes evicted
since the last answer, as content runs ``[kind, id, start, end]`` (kind 0: group ``id``, 1: session ``id``), read
by wrapping the allocator's ``free`` while the tree evicts. Token ids: position ``p`` of group ``g`` is
``g * 2**20 + p + 1``, of session ``s`` ``2**30 + s * 2**20 + p``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from array import array
from typing import Any

SPAN = 1 << 20
SESSION_BASE = 1 << 30


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything SGLang prints goes to stderr, not into the protocol
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    bridge = Bridge()
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            result = bridge.handle(cmd)
            answer: dict[str, Any] = {"ok": True, "result": result, **bridge.state()}
        except Exception as e:  # noqa: BLE001 (reported to the other side, which decides)
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}", **bridge.state()}
        out.write(json.dumps(answer) + "\n")


def _publish_server_args() -> None:
    """SGLang's request-level calls read its process-wide configuration (``get_serving()``, ``get_spec()``):
    publish the defaults, for a placeholder model config (no weights, no tokenizer; nothing is loaded)."""
    import tempfile

    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    model = tempfile.mkdtemp(prefix="kvgate-sglang-oracle-")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 1, "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 128,
        "max_position_embeddings": 1 << 16,
    }
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    runtime_context.publish(ServerArgs(model_path=model, device="cpu", skip_tokenizer_init=True), role="test")


class Bridge:
    def __init__(self) -> None:
        import sglang

        self.version = sglang.__version__
        self.tree: Any = None
        self.r2t: Any = None  # the request-to-token table, kept across resets (see reset)
        _publish_server_args()

    # -- set-up ---------------------------------------------------------------------------------------------
    def reset(self, kv_pool: int, backend: str, max_reqs: int = 256, max_len: int = 1 << 16) -> dict[str, Any]:
        import torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        kv = MHATokenToKVPool(
            kv_pool, page_size=1, dtype=torch.bfloat16, head_num=1, head_dim=1, layer_num=1, device="cpu",
            enable_memory_saver=False,
        )
        self.alloc = TokenToKVPoolAllocator(kv_pool, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
        # the request-to-token rows (a (max_reqs + 1) x max_len table, 64 MB at the defaults) are kept from one run
        # to the next and cleared, as SGLang's flush_cache clears them; zeroing a new table cost most of a reset
        r2t = self.r2t
        if r2t is None or (r2t.size, r2t.max_context_len) != (max_reqs, max_len):
            r2t = ReqToTokenPool(size=max_reqs, max_context_len=max_len, device="cpu", enable_memory_saver=False)
        r2t.clear()
        self.r2t = r2t
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc, page_size=1,
            tree_components=(ComponentType.FULL,), tree_core_backend=backend,
        )
        self.tree = UnifiedRadixCache(params)
        self.reqs: dict[int, Any] = {}
        self.streams: dict[int, tuple[int, int, int]] = {}  # rid -> (group id, group tokens, session id)
        self.spare: list[int] = []  # slots allocated and not yet handed to a request, in order
        self.owner: dict[int, tuple[int, int, int]] = {}  # slot -> (kind, id, position)
        self.evicted: list[list[int]] = []
        self._evicting = False
        free = self.alloc.free

        def logged_free(indices: Any) -> Any:
            if self._evicting:
                self._log(indices.tolist())
            return free(indices)

        self.alloc.free = logged_free
        for name in ("evict_for_alloc", "evict"):
            self._wrap_evict(name)
        return {"core": type(self.tree.tree_core).__name__, "sglang": self.version}

    def _wrap_evict(self, name: str) -> None:
        method = getattr(self.tree, name)

        def evicting(*args: Any, **kwargs: Any) -> Any:
            outer = self._evicting
            self._evicting = True
            try:
                return method(*args, **kwargs)
            finally:
                self._evicting = outer

        setattr(self.tree, name, evicting)

    def _log(self, slots: list[int]) -> None:
        runs = self.evicted
        for s in slots:
            kind, ident, pos = self.owner.pop(s)
            if runs and runs[-1][0] == kind and runs[-1][1] == ident and runs[-1][3] == pos:
                runs[-1][3] = pos + 1
            else:
                runs.append([kind, ident, pos, pos + 1])

    def state(self) -> dict[str, Any]:
        if self.tree is None:
            return {}
        evicted, self.evicted = self.evicted, []
        return {
            "free": int(self.alloc.available_size()),
            "evictable": int(self.tree.evictable_size()),
            "protected": int(self.tree.protected_size()),
            "evicted": evicted,
        }

    # -- requests -------------------------------------------------------------------------------------------
    def _content(self, rid: int, pos: int) -> tuple[int, int, int]:
        gid, gtok, sid = self.streams[rid]
        return (0, gid, pos) if pos < gtok else (1, sid, pos)

    def _tokens(self, rid: int, start: int, stop: int) -> array:
        out = array("q")
        for p in range(start, stop):
            kind, ident, pos = self._content(rid, p)
            out.append(ident * SPAN + pos + 1 if kind == 0 else SESSION_BASE + ident * SPAN + pos)
        return out

    def _sync(self, req: Any, rid: int, computed: int, num_tokens: int, prompt: int) -> None:
        """Bring a request up to kvgate's view: ``computed`` tokens of KV in its row (new ones from the spare
        slots), its output tokens ``[prompt, num_tokens)``."""
        import torch

        have = req.kv.kv_allocated_len
        if computed > have:
            if not req.kv.holds_kv:
                self.r2t.alloc([req])
                if req.prefix_len:
                    prefix = self.tree.prefix_device_indices(req)
                    self.r2t.req_to_token[req.kv.req_pool_idx, : req.prefix_len] = prefix.to(torch.int32)
                have = req.prefix_len
            n = computed - have
            if n > len(self.spare):
                raise RuntimeError(f"request {rid} computed {n} tokens more than were allocated")
            slots, self.spare = self.spare[:n], self.spare[n:]
            for i, s in enumerate(slots):
                self.owner[s] = self._content(rid, have + i)
            row = self.r2t.req_to_token[req.kv.req_pool_idx]
            row[have:computed] = torch.tensor(slots, dtype=torch.int32)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = computed
        want = num_tokens - prompt
        if len(req.output_ids) < want:
            req.output_ids.extend(self._tokens(rid, prompt + len(req.output_ids), num_tokens))
        req.extend_end = computed

    def handle(self, cmd: dict[str, Any]) -> Any:
        op = cmd["op"]
        if op == "reset":
            return self.reset(cmd["kv_pool"], cmd["backend"])
        if op == "alloc":
            from sglang.srt.mem_cache.allocation import alloc_token_slots

            self.spare.extend(alloc_token_slots(self.tree, cmd["n"]).tolist())
            return None
        if op == "room":
            return bool(self.alloc.check_decode_capacity(num_tokens=cmd["n"], tree_cache=self.tree))
        if op == "flush":
            assert not self.spare and not any(r.kv.holds_kv or r.lock for r in self.reqs.values()), "not idle"
            self.tree.reset()
            self.alloc.clear()
            self.r2t.clear()
            self.owner.clear()
            return None
        return self._request_op(op, cmd)

    def _request_op(self, op: str, cmd: dict[str, Any]) -> Any:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
        from sglang.srt.sampling.sampling_params import SamplingParams

        rid = cmd["rid"]
        if op == "match":
            self.streams[rid] = (cmd["gid"], cmd["gtok"], cmd["sid"])
            req = self.reqs.get(rid)
            if req is None or not req.kv.holds_kv:  # a waiting request (a retracted one starts afresh)
                prompt = cmd["prompt"]
                req = Req(str(rid), "", self._tokens(rid, 0, prompt), SamplingParams(max_new_tokens=cmd["max_new"]))
                req.output_ids.extend(self._tokens(rid, prompt, cmd["num_tokens"]))
                self.reqs[rid] = req
            req.init_next_round_input(self.tree)
            return int(req.prefix_len)
        req = self.reqs[rid]
        if op == "lock":
            req.lock = self.tree.lock(req.last_node)
            return None
        if op == "unlock":
            self.tree.unlock(req.lock)
            req.lock = None
            del self.reqs[rid]
            return None
        self._sync(req, rid, cmd["computed"], cmd["num_tokens"], cmd["prompt"])
        if op == "insert":
            checkpoint_kv_cache(req, self.tree)
            return None
        if op == "finish":
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            req.finished_len = len(req.output_ids)
            release_kv_cache(req, self.tree, checkpoint=True)
        elif op == "release":
            release_kv_cache(req, self.tree, checkpoint=False)
        else:
            raise ValueError(f"unknown op {op!r}")
        del self.reqs[rid]
        return None


if __name__ == "__main__":
    main()
