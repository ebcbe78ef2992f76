"""SGLang's own radix cache beside kvgate's, call for call (a test oracle).

:class:`SglangTree` starts ``sglang_tree_bridge.py`` in SGLang's venv (one process, reset per run) and speaks
JSON lines to it. :class:`TeeRadix` is kvgate's :class:`RadixCache` that repeats every call the SGLang engine
makes (``match``, ``lock``, ``unlock_req``, ``alloc``, ``make_room``, ``insert``, ``finish``, ``release``,
``clear``) on SGLang's tree and, after each, asserts the same result (the hit; whether the tokens fit), the same
free, evictable and protected tokens and the same evicted content in the same order. Put it behind
:class:`kvgate.engine.sglang.SglangEngine` (``engine.cache = TeeRadix(...)``) to hold the whole engine's calls to
SGLang, or call it directly with random operations.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
from pathlib import Path
from typing import Any

from kvgate.engine.base import Request
from kvgate.engine.radix import RadixCache
from kvgate.realsglang.env import sglang_python

BRIDGE = Path(__file__).with_name("sglang_tree_bridge.py")
ANSWER_S = 300.0
"""How long one call may take (the first imports SGLang: seconds; the others: milliseconds)."""


class Divergence(AssertionError):
    """kvgate's tree and SGLang's answered differently."""


class SglangTree:
    """The bridge process. :meth:`call` sends one command and returns the answer (a dict)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [str(sglang_python()), str(BRIDGE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            bufsize=1,
        )
        self.calls = 0

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        # the answer is one whole line; a bridge that never answers (a deadlock in SGLang's core) fails the call
        if not select.select([self.proc.stdout], [], [], ANSWER_S)[0]:
            self.proc.kill()
            raise RuntimeError(f"SGLang's tree bridge did not answer {op} within {ANSWER_S:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"SGLang's tree bridge exited (status {self.proc.poll()}) on {op} {args}")
        self.calls += 1
        return dict(json.loads(line))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def _merge(runs: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    out: list[tuple[int, int, int, int]] = []
    for r in runs:
        if out and out[-1][:2] == r[:2] and out[-1][3] == r[2]:
            out[-1] = (*out[-1][:3], r[3])
        else:
            out.append(r)
    return out


class TeeRadix(RadixCache):
    """kvgate's radix cache, each public call repeated on SGLang's and compared (see the module docstring)."""

    def __init__(self, kv_pool: int, sglang: SglangTree, backend: str = "rust") -> None:
        super().__init__(kv_pool)
        self.sglang = sglang
        self.eviction_log = []
        self._gids: dict[object, int] = {}
        self._sids: dict[int, int] = {}
        self.ops = 0
        answer = sglang.call("reset", kv_pool=kv_pool, backend=backend)
        if not answer["ok"]:
            raise RuntimeError(f"SGLang's tree did not start: {answer['error']}")
        self.core = answer["result"]["core"]
        self._compare("reset", answer, None, None)

    # -- comparison -----------------------------------------------------------------------------------------
    def _gid(self, gkey: object) -> int:
        return self._gids.setdefault(gkey, len(self._gids))

    def _sid(self, session: int) -> int:
        return self._sids.setdefault(session, len(self._sids))

    def _evicted(self) -> list[tuple[int, int, int, int]]:
        log = self.eviction_log
        assert log is not None
        runs = [(k, self._gid(i) if k == 0 else self._sid(int(i)), s, e) for k, i, s, e in log]  # type: ignore[arg-type]
        log.clear()
        return _merge(runs)

    def _compare(self, what: str, answer: dict[str, Any], mine: object, theirs: object) -> None:
        self.ops += 1
        if not answer["ok"] and what != "alloc":
            raise Divergence(f"op {self.ops} ({what}) failed in SGLang: {answer['error']}")
        ours = {
            "result": mine,
            "free": self.free,
            "evictable": self.evictable,
            "protected": self.tree - self.evictable,
            "evicted": self._evicted(),
        }
        sgl = {
            "result": theirs,
            "free": answer["free"],
            "evictable": answer["evictable"],
            "protected": answer["protected"],
            "evicted": [tuple(r) for r in answer["evicted"]],
        }
        if ours != sgl:
            diff = {k: (ours[k], sgl[k]) for k in ours if ours[k] != sgl[k]}
            raise Divergence(f"op {self.ops} ({what}) on the {self.core}: kvgate vs SGLang {diff}")

    def _req(self, req: Request) -> dict[str, Any]:
        return {
            "rid": req.rid,
            "computed": req.computed,
            "num_tokens": req.num_tokens,
            "prompt": req.prompt,
        }

    # -- the calls ------------------------------------------------------------------------------------------
    def match(self, req: Request) -> int:
        hit = super().match(req)
        seq = req.seq
        answer = self.sglang.call(
            "match", rid=req.rid, gid=self._gid((seq.group, seq.group_blocks)), gtok=seq.group_blocks,
            sid=self._sid(seq.session), prompt=req.prompt, num_tokens=req.num_tokens, max_new=req.max_tokens,
        )
        self._compare("match", answer, hit, answer.get("result"))
        return hit

    def lock(self, req: Request, hit: int) -> None:
        super().lock(req, hit)
        self._compare("lock", self.sglang.call("lock", rid=req.rid), None, None)

    def unlock_req(self, req: Request) -> None:
        super().unlock_req(req)
        self._compare("unlock", self.sglang.call("unlock", rid=req.rid), None, None)

    def alloc(self, n: int) -> None:
        try:
            super().alloc(n)
            mine = "ok"
        except RuntimeError:
            mine = "out of memory"
        answer = self.sglang.call("alloc", n=n)
        self._compare("alloc", answer, mine, "ok" if answer["ok"] else "out of memory")
        if mine != "ok":
            raise RuntimeError(f"out of KV memory: {n} tokens wanted, {self.free} free")

    def make_room(self, n: int) -> bool:
        fits = super().make_room(n)
        answer = self.sglang.call("room", n=n)
        self._compare("room", answer, fits, answer.get("result"))
        return fits

    def _request_call(self, op: str, req: Request) -> None:
        self._compare(op, self.sglang.call(op, **self._req(req)), None, None)

    def insert(self, req: Request) -> None:
        super().insert(req)
        self._request_call("insert", req)

    def finish(self, req: Request) -> None:
        super().finish(req)
        self._request_call("finish", req)

    def release(self, req: Request) -> None:
        super().release(req)
        self._request_call("release", req)

    def clear(self) -> None:
        super().clear()
        self._compare("flush", self.sglang.call("flush"), None, None)
