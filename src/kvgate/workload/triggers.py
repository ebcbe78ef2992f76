"""Triggers: what changes a run at a minute, each a type in one home. No I/O and no clock.

A trigger knows how it is written (its command-line option, which concern's option set offers it, the config field
that holds it, and how that text or number is parsed), how the simulator schedules it (:meth:`Trigger.schedule`,
on a :class:`kvgate.sim.fleet.FleetSim`), how it is played over HTTP (:meth:`Trigger.play`, by ``kvgate drive``
through a :class:`Player`), what it does to one engine (:meth:`Trigger.on_engine`: the simulated replicas', and
``kvgate engine``'s through ``POST /kvgate/trigger``), whether the paired twin runs without it
(``experiment``), and how it is labelled in figures and summaries.

The kinds: ``burst`` and ``rate`` change the arrivals (drawn with them, by the simulator and the driver alike);
``flush`` empties the prefix cache; ``shrink`` takes part of every engine's KV pool for a while; ``control``
switches the gateway's control on; ``fail`` and ``join`` take a replica out of a fleet or add one; ``migrate``
moves long-parked sessions. Each has a config field of its own,
kept flat in ``run.json``; a kind without one keeps its specs in the workload's ``triggers`` field as
``KIND:SPEC`` (a new trigger is a class here, nothing more: :func:`config_values` and :func:`trigger_options`
read the registry).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, ClassVar, Protocol, Self

from kvgate.engine.blocks import SeqKey
from kvgate.errors import UsageError
from kvgate.workload.arrivals import parse_burst, parse_rate_at

TRIGGER_PATH = "/kvgate/trigger"
"""``kvgate engine``'s route that applies a trigger to its engine (body ``{"trigger": "KIND:SPEC"}``)."""
GENERIC_FIELD = "triggers"
"""The workload's field of the kinds without a field of their own (``KIND:SPEC`` each)."""


class Player(Protocol):
    """What a trigger played over HTTP may do (the driver's side: :class:`kvgate.drive.driver.Driver`)."""

    async def flush(self) -> None:
        """Empty the server's prefix cache (vLLM's reset, else SGLang's flush, retried while refused)."""

    async def post_trigger(self, trigger: Trigger) -> None:
        """Ask a ``kvgate engine`` to apply ``trigger`` to its engine (``POST /kvgate/trigger``)."""


@dataclass(frozen=True)
class Trigger:
    """One trigger at minute ``at_min``. Subclasses declare the class attributes and override what they do."""

    kind: ClassVar[str]
    field: ClassVar[str] = GENERIC_FIELD
    concern: ClassVar[str]
    """The option set that offers it: workload, engine, control or fleet."""
    option: ClassVar[str]
    metavar: ClassVar[str]
    help: ClassVar[str]
    many: ClassVar[bool] = True
    """The option is repeatable (the field a tuple)."""
    number: ClassVar[bool] = False
    """The option takes a number (the field a float), not text."""
    experiment: ClassVar[bool] = False
    """The run's trigger under test: the paired twin runs without it; its end aligns the judged windows."""
    over_http: ClassVar[bool] = False
    """``kvgate drive`` plays it (or, drawn with the arrivals, draws it)."""
    engine_trigger: ClassVar[bool] = False
    """It acts on an engine (:meth:`on_engine`): ``kvgate engine`` applies it (``POST /kvgate/trigger``)."""

    at_min: float

    @classmethod
    def parse(cls, value: Any) -> Self:
        return cls(float(value))

    def spec(self) -> Any:
        """Its value in its config field (for the generic field, without the ``KIND:``)."""
        return self.at_min

    @property
    def at_s(self) -> float:
        return self.at_min * 60.0

    def end_min(self) -> float:
        return self.at_min

    def label(self) -> str:
        return f"{self.kind} at {self.at_min:g} min"

    def engine_acts(self) -> tuple[float, ...]:
        """The minutes at which it acts on an engine (:meth:`on_engine`): its start, and its end if it ends."""
        return (self.at_min,)

    def schedule(self, sim: Any) -> None:
        """Its events in the simulator (default: its acts on every live replica's engine, ``sim.on_engines``)."""
        for minute in self.engine_acts():
            sim.push(minute * 60.0, sim.on_engines, (self, minute))

    def check_engine(self, engine: Any) -> None:
        """Raise :class:`UsageError` if it cannot act on ``engine`` (asked before it is played on a served one)."""
        if not self.engine_trigger:
            raise UsageError(f"the {self.kind} trigger does nothing to an engine")

    def on_engine(self, engine: Any, minute: float) -> bool:
        """Its act of ``minute`` on one engine; True when done (False: again a second later, e.g. until blocks it
        takes are free). Called again, an act does only what is left of it."""
        raise UsageError(f"the {self.kind} trigger does nothing to an engine")

    async def play(self, player: Player) -> None:
        """Play it over HTTP at its minute (the driver's clock)."""
        await player.post_trigger(self)


@dataclass(frozen=True)
class ArrivalTrigger(Trigger):
    """A change of the arrivals: drawn with them (:func:`kvgate.workload.arrivals.generate`) by the simulator and by
    the driver alike, so nothing is scheduled or played at its minute."""

    concern = "workload"
    over_http = True

    def schedule(self, sim: Any) -> None:
        """Drawn with the arrivals."""

    async def play(self, player: Player) -> None:
        """Drawn with the arrivals."""


@dataclass(frozen=True)
class Burst(ArrivalTrigger):
    kind = "burst"
    field = "bursts"
    option, metavar = "--burst", "X@S+D"
    help = "Extra Poisson stream at X*lam from minute S for D minutes (+N@S+D: N extra sessions). Repeatable."
    experiment = True
    text: str = ""
    end: float = 0.0

    @classmethod
    def parse(cls, value: Any) -> Self:
        b = parse_burst(str(value))
        return cls(b.start_s / 60.0, b.spec(), b.end_s / 60.0)

    def spec(self) -> Any:
        return self.text

    def end_min(self) -> float:
        return self.end

    def label(self) -> str:
        return f"burst {self.text}"


@dataclass(frozen=True)
class RateChange(ArrivalTrigger):
    kind = "rate"
    field = "rate_at"
    option, metavar = "--rate-at", "MIN:LAM"
    help = "Change the base arrival rate at a minute. Repeatable."
    lam: float = 0.0

    @classmethod
    def parse(cls, value: Any) -> Self:
        rc = parse_rate_at(str(value))
        return cls(rc.at_s / 60.0, rc.lam)

    def spec(self) -> Any:
        return f"{self.at_min:g}:{self.lam:g}"

    def label(self) -> str:
        return f"rate-at {self.spec()}"


@dataclass(frozen=True)
class Flush(Trigger):
    kind = "flush"
    field = "flush_at"
    concern = "workload"
    option, metavar = "--flush-at", "MIN"
    help = ("Flush the prefix cache at this minute, preempting running requests (over HTTP: vLLM's "
            "/reset_prefix_cache, else SGLang's /flush_cache, retried while it refuses).")
    many, number, experiment, over_http = False, True, True, True

    def label(self) -> str:
        return f"flush at {self.at_min:g}"

    def schedule(self, sim: Any) -> None:
        sim.push(self.at_s, sim.on_flush)

    async def play(self, player: Player) -> None:
        await player.flush()


@dataclass(frozen=True)
class ControlSwitch(Trigger):
    kind = "control"
    field = "control_at"
    concern = "control"
    option, metavar = "--control-at", "MIN"
    help = "Minute the control starts (before it: none) [default: from the start]."
    many, number = False, True

    def schedule(self, sim: Any) -> None:
        sim.push(self.at_s, sim.on_control)


@dataclass(frozen=True)
class ReplicaFailure(Trigger):
    kind = "fail"
    field = "fail_at"
    concern = "fleet"
    option, metavar = "--fail-at", "R@MIN"
    help = "Replica R fails at a minute (its turns fail, its cache is gone, its sessions move). Repeatable."
    replica: int = 0

    @classmethod
    def parse(cls, value: Any) -> Self:
        r, sep, m = str(value).partition("@")
        try:
            if not sep:
                raise ValueError
            return cls(float(m), int(r))
        except ValueError:
            raise UsageError(f"--fail-at {value!r}: expected R@M (replica R fails at minute M), e.g. 2@20") from None

    def spec(self) -> Any:
        return f"{self.replica}@{self.at_min:g}"

    def label(self) -> str:
        return f"replica {self.replica} fails at {self.at_min:g} min"

    def schedule(self, sim: Any) -> None:
        sim.push(self.at_s, sim.on_fail, self.replica)


@dataclass(frozen=True)
class Join(Trigger):
    kind = "join"
    field = "join_at"
    concern = "fleet"
    option, metavar = "--join-at", "MIN"
    help = "A replica joins at a minute (scale-out). Repeatable."
    number = True
    replica: int = -1
    """Its index: the fleet's initial replicas, then one per join in order (set by :func:`triggers_of`)."""

    def schedule(self, sim: Any) -> None:
        sim.push(self.at_s, sim.on_join, self.replica)


@dataclass(frozen=True)
class Migration(Trigger):
    """Not at a minute: with it, the kvgate router moves a session held ``at_min * 60`` seconds (its option takes
    seconds)."""

    kind = "migrate"
    field = "migrate_after_s"
    concern = "fleet"
    option, metavar = "--migrate-after", "S"
    help = "kvgate router: move a session parked this long to a replica with headroom."
    many, number = False, True

    @classmethod
    def parse(cls, value: Any) -> Self:
        return cls(float(value) / 60.0)

    def spec(self) -> Any:
        return self.at_min * 60.0

    def label(self) -> str:
        return f"migrate after {self.spec():g} s"

    def schedule(self, sim: Any) -> None:
        """Read by the simulator's fleet (each park schedules its own check)."""


@dataclass(frozen=True)
class PoolShrink(Trigger):
    """Part of every engine's KV pool taken by something loaded beside it (another model, an adapter) from minute
    S, for D minutes (for good without ``+D``). Its blocks are taken as they are free, from the front of the free
    queue as an allocation takes them (cached content there is evicted); blocks held by running requests are taken
    when those are done with them, so the engine is not preempted by the shrink itself, only by the blocks it lacks
    afterwards. When it ends its blocks return to the pool. The gateway is not told: its control still budgets
    the pool it read at start (C), as a gateway in front of a shrunk engine would. A prefix-cache reset is refused
    while it holds blocks (vLLM's refuses while any block is in use). Needs the simulated vLLM's pool."""

    kind = "shrink"
    concern = "engine"
    option, metavar = "--shrink-at", "TOKENS@S[+D]"
    help = ("Take TOKENS of every engine's KV pool from minute S, for D minutes (for good without +D): another "
            "model or adapter loaded beside the engine. Repeatable.")
    experiment = over_http = engine_trigger = True
    tokens: int = 0
    dur_min: float | None = None

    @classmethod
    def parse(cls, value: Any) -> Self:
        text = str(value).strip()
        tok, sep, when = text.partition("@")
        start, plus, dur = when.partition("+")
        try:
            out = cls(float(start), int(tok.replace("_", "")), float(dur) if plus else None)
        except ValueError:
            raise UsageError(f"--shrink-at {text!r}: expected TOKENS@S or TOKENS@S+D (e.g. 100000@20+10)") from None
        if out.tokens <= 0 or not 0 <= out.at_min < math.inf or (
                out.dur_min is not None and not 0 < out.dur_min < math.inf):  # (NaN fails every comparison)
            raise UsageError(f"--shrink-at {text!r}: tokens and duration must be positive, the minute non-negative "
                             "(all finite)")
        return out

    def spec(self) -> Any:
        return f"{self.tokens}@{self.at_min:g}" + ("" if self.dur_min is None else f"+{self.dur_min:g}")

    def end_min(self) -> float:
        return self.at_min + (self.dur_min or 0.0)

    def label(self) -> str:
        return f"pool -{self.tokens} tokens at {self.at_min:g} min" + (
            "" if self.dur_min is None else f" for {self.dur_min:g} min")

    def engine_acts(self) -> tuple[float, ...]:
        return (self.at_min,) if self.dur_min is None else (self.at_min, self.end_min())

    def check_engine(self, engine: Any) -> None:
        pool = getattr(engine, "pool", None)
        if pool is None or not hasattr(pool, "admit"):
            raise UsageError("--shrink-at needs the simulated vLLM's pool (--engine vllm)")

    def on_engine(self, engine: Any, minute: float) -> bool:
        self.check_engine(engine)
        pool = engine.pool
        # this trigger's holders, one block each: base, base - 1, ... (keyed by its whole spec, so two shrinks at the
        # same minute hold blocks of their own)
        base = -(zlib.crc32(str(self.spec()).encode()) + 1) * 10**9
        held = 0
        while pool.holds(base - held):
            held += 1
        if minute != self.at_min:  # its end: the blocks go back
            for k in range(held):
                pool.free(base - k)
            return True
        bs, want = pool.block_size, -(-self.tokens // pool.block_size)
        while held < want and pool.num_free_blocks() > 0:
            rid = base - held
            pool.admit(rid, SeqKey(-1, 0, rid), bs, 0, bs)
            held += 1
        return held >= want


REGISTRY: dict[str, type[Trigger]] = {
    cls.kind: cls for cls in (Burst, RateChange, Flush, ControlSwitch, ReplicaFailure, Join, Migration, PoolShrink)
}
"""Every kind of trigger by name; :func:`register` adds one."""


def register(cls: type[Trigger]) -> type[Trigger]:
    """A class decorator: ``cls`` is a kind of trigger (its option, parsing, scheduling and playing come with it)."""
    REGISTRY[cls.kind] = cls
    return cls


def _get(cfg: Any, name: str) -> Any:
    return cfg.get(name) if isinstance(cfg, Mapping) else getattr(cfg, name, None)


def parse_trigger(text: str) -> Trigger:
    """``KIND:SPEC`` (the generic field's form) to its trigger; UsageError for an unknown kind or a bad spec."""
    kind, sep, spec = str(text).partition(":")
    cls = REGISTRY.get(kind.strip())
    if not sep or cls is None:
        raise UsageError(f"trigger {text!r}: expected KIND:SPEC with KIND one of {', '.join(REGISTRY)}")
    return cls.parse(spec.strip())


def triggers_of(cfg: Any) -> list[Trigger]:
    """Every trigger of a config (a config object, or ``run.json``'s flat dict), by kind in registry order."""
    out: list[Trigger] = []
    replicas = int(_get(cfg, "replicas") or 1)
    for cls in REGISTRY.values():
        if cls.field == GENERIC_FIELD:
            continue
        value = _get(cfg, cls.field)
        values = (value or ()) if cls.many else (() if value is None else (value,))
        for k, v in enumerate(values):
            t = cls.parse(v)
            out.append(replace(t, replica=replicas + k) if isinstance(t, Join) else t)
    out += [parse_trigger(x) for x in _get(cfg, GENERIC_FIELD) or ()]
    return out


def trigger_end_min(cfg: Any) -> float | None:
    """End of the run's triggers under test (the last burst's end, the flush, ...), in minutes."""
    ends = [t.end_min() for t in triggers_of(cfg) if t.experiment]
    return max(ends) if ends else None


def twin_of(cfg: Any) -> Any:
    """``cfg`` without its triggers under test: the paired twin (same base arrivals, same everything else)."""
    names = {f.name: f for f in fields(cfg)} if is_dataclass(cfg) else {}
    over: dict[str, Any] = {}
    for cls in REGISTRY.values():
        if cls.experiment and cls.field != GENERIC_FIELD and cls.field in names:
            over[cls.field] = () if cls.many else None
    if GENERIC_FIELD in names:
        over[GENERIC_FIELD] = tuple(x for x in _get(cfg, GENERIC_FIELD) or () if not parse_trigger(x).experiment)
    return replace(cfg, **over)


def config_values(kw: dict[str, Any], kinds: Iterable[type[Trigger]] | None = None) -> dict[str, Any]:
    """Command-line values of :func:`trigger_options` (named by each option's dest) as config fields: the kinds
    without a field of their own go into the generic field as ``KIND:SPEC``. ``kw`` is changed in place."""
    generic = list(kw.get(GENERIC_FIELD) or ())
    for cls in kinds if kinds is not None else REGISTRY.values():
        if cls.field != GENERIC_FIELD:
            continue
        for v in kw.pop(dest(cls), None) or ():
            generic.append(f"{cls.kind}:{cls.parse(v).spec()}")
    kw[GENERIC_FIELD] = tuple(generic)
    for cls in kinds if kinds is not None else REGISTRY.values():
        if cls.many and cls.field in kw and kw[cls.field] is not None:
            kw[cls.field] = tuple(kw[cls.field])
    return kw


def dest(cls: type[Trigger]) -> str:
    """The name of a kind's command-line value: its field, or (generic field) its option's name."""
    return cls.field if cls.field != GENERIC_FIELD else cls.option.lstrip("-").replace("-", "_")


def kinds(concern: str | None = None, over_http: bool | None = None) -> list[type[Trigger]]:
    """The kinds of one concern's option set (None: all), or those ``kvgate drive`` plays."""
    return [c for c in REGISTRY.values()
            if (concern is None or c.concern == concern) and (over_http is None or c.over_http == over_http)]
