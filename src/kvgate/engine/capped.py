"""The fast vLLM pool with per-session hit caps, for a served engine whose prompts are real token ids.

``kvgate engine`` maps each request's tokens to content keys (its content bridge); where a session's new prompt
shares only part of what its key had cached, the hit is capped at the common prefix."""

from __future__ import annotations

from kvgate.engine.blocks import SeqKey
from kvgate.engine.cache import RunKVPool


class CappedKVPool(RunKVPool):
    """The fast vLLM pool with per-session hit caps (see :class:`ContentBridge`).

    A cap bounds ``lookup`` until the session's next successful ``admit``, which makes the pool forget the
    session's cached blocks beyond the cap (``RunKVPool.forget``), so the key's content becomes the new
    request's."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.caps: dict[int, int] = {}

    def lookup(self, seq: SeqKey, num_tokens: int) -> int:
        hit = super().lookup(seq, num_tokens)
        cap = self.caps.get(seq.session)
        return hit if cap is None or hit <= cap else cap

    def admit(
        self, rid: int, seq: SeqKey, num_tokens: int, hit_tokens: int, upto_tokens: int, fit_tokens: int = 0
    ) -> bool:
        ok = super().admit(rid, seq, num_tokens, hit_tokens, upto_tokens, fit_tokens)
        if ok and self.caps:
            cap = self.caps.pop(seq.session, None)
            if cap is not None:
                self.forget(seq, cap)
        return ok
