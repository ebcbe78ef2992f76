"""Session shapes: how big each turn of an agent session is, and how long it waits between turns.

A session is a closed loop of turns. Turn k sends the whole conversation so far::

    | shared prefix | unique task | out_0 | app_0 | out_1 | app_1 | ... | out_{k-1} | app_{k-1} |
    '------------------ prompt of turn k (L_k tokens) ------------------------------------------'

so ``L_0 = initial_tokens`` and ``L_{k+1} = L_k + outputs[k] + appends[k]``: every turn's prompt extends the
previous prompt plus the model's output by the tokens the tool appended. The shared prefix (a system prompt)
is identical across all sessions; everything after it is unique to the session, so the only reuse is exact
prefix reuse within a session and of the shared prefix.

Shapes carry no clock and no randomness of their own: think times are drawn by the arrival streams from the
session's own random stream (see ``arrivals``), or taken from a trace's recorded gaps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.errors import UsageError


@dataclass(frozen=True, slots=True)
class SessionShape:
    """The token geometry of one session (no timing)."""

    shared_tokens: int
    """Tokens of the shared prefix (system prompt), the same for every session of the workload."""
    initial_tokens: int
    """Prompt length of the first turn: shared prefix plus the session's unique task."""
    outputs: tuple[int, ...]
    """Output tokens of each turn (fixed length: the driver asks the engine to ignore EOS)."""
    appends: tuple[int, ...]
    """Tokens appended after turn k before turn k+1 (tool output); ``len(outputs) - 1`` entries."""
    gaps: tuple[float, ...] | None = None
    """Recorded inter-turn gaps in seconds (trace replay); None draws think times from the workload."""
    source: str = ""
    """Where the shape came from (a preset name or a trace session id)."""

    def __post_init__(self) -> None:
        if not self.outputs:
            raise ValueError("a session needs at least one turn")
        if len(self.appends) != len(self.outputs) - 1:
            raise ValueError("appends must have one entry fewer than outputs")
        if self.gaps is not None and len(self.gaps) != len(self.outputs) - 1:
            raise ValueError("gaps must have one entry fewer than outputs")
        if not 0 <= self.shared_tokens <= self.initial_tokens:
            raise ValueError("shared prefix must fit in the first prompt")
        if min(self.outputs) < 1 or min(self.appends, default=0) < 0:
            raise ValueError("outputs must be >= 1 and appends >= 0")

    @property
    def turns(self) -> int:
        return len(self.outputs)

    def prompt_tokens(self) -> list[int]:
        """Prompt length of every turn."""
        out = [self.initial_tokens]
        for k in range(self.turns - 1):
            out.append(out[-1] + self.outputs[k] + self.appends[k])
        return out

    def max_context(self) -> int:
        """Largest context the session reaches (last prompt plus its output)."""
        return self.prompt_tokens()[-1] + self.outputs[-1]

    def truncated(self, max_context: int) -> SessionShape | None:
        """The shape with every turn whose prompt plus output exceeds ``max_context`` dropped.

        Returns None when not even the first turn fits.
        """
        prompts = self.prompt_tokens()
        keep = 0
        for k, p in enumerate(prompts):
            if p + self.outputs[k] > max_context:
                break
            keep = k + 1
        if keep == 0:
            return None
        if keep == self.turns:
            return self
        return SessionShape(
            shared_tokens=self.shared_tokens,
            initial_tokens=self.initial_tokens,
            outputs=self.outputs[:keep],
            appends=self.appends[: keep - 1],
            gaps=None if self.gaps is None else self.gaps[: keep - 1],
            source=self.source,
        )


def synthetic(
    *, shared: int, unique: int, turns: int, output: int, append: int, source: str = ""
) -> SessionShape:
    """A homogeneous synthetic session as in the paper (§3)."""
    return SessionShape(
        shared_tokens=shared,
        initial_tokens=shared + unique,
        outputs=(output,) * turns,
        appends=(append,) * (turns - 1),
        source=source,
    )


@dataclass(frozen=True, slots=True)
class Phase:
    """Sessions arriving from ``start_s`` on get this shape and mean think time (until the next phase)."""

    start_s: float
    shape: SessionShape
    think_mean_s: float


@dataclass(frozen=True, slots=True)
class Workload:
    """What a session looks like, by arrival time. Trace workloads sample shapes from ``pool`` instead."""

    name: str
    phases: tuple[Phase, ...] = ()
    pool: tuple[SessionShape, ...] = ()
    think_mean_s: float = 5.0
    """Mean exponential think time for pool shapes without recorded gaps."""

    def __post_init__(self) -> None:
        if not self.phases and not self.pool:
            raise ValueError("a workload needs phases or a trace pool")

    def phase_at(self, t: float) -> Phase:
        current = self.phases[0]
        for ph in self.phases:
            if ph.start_s <= t:
                current = ph
        return current

    def shapes(self) -> Sequence[SessionShape]:
        return self.pool if self.pool else tuple(p.shape for p in self.phases)

    def max_context(self) -> int:
        return max(s.max_context() for s in self.shapes())

    def mean_turn_context(self) -> float:
        """Mean prompt length over all turns of all shapes (L-bar)."""
        tot = 0
        n = 0
        for s in self.shapes():
            p = s.prompt_tokens()
            tot += sum(p)
            n += len(p)
        return tot / n


PAPER_8B = synthetic(shared=2000, unique=4000, turns=25, output=300, append=1000, source="paper-8b")
SHIFT_SHORT = synthetic(shared=2000, unique=1000, turns=12, output=300, append=1000, source="paper-shift/short")
SHIFT_LONG = synthetic(shared=2000, unique=20000, turns=12, output=300, append=1000, source="paper-shift/long")

PRESETS: dict[str, Workload] = {
    "paper-8b": Workload("paper-8b", phases=(Phase(0.0, PAPER_8B, 5.0),)),
    "paper-shift": Workload(
        "paper-shift",
        phases=(Phase(0.0, SHIFT_SHORT, 15.0), Phase(30 * 60.0, SHIFT_LONG, 5.0)),
    ),
}


def preset(name: str) -> Workload:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown preset {name!r}; choose from {', '.join(sorted(PRESETS))}") from None
