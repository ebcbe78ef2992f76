"""``kvgate drive``: the closed-loop agent driver, playing the simulator's workload against a real endpoint.

The driver replaces the simulator's engine with any OpenAI-compatible server (vLLM, SGLang, a gateway in front of
them, or ``kvgate engine``) and keeps everything else: the same workload module draws the same sessions for the
same seed (arrival times, shapes, think times), the records have the simulator's schema, and the run directory
reads with :func:`kvgate.records.load_run` like a simulated one.

Time. All workload times (arrivals, think times, ``--minutes``, ``--flush-at``) are *virtual* seconds; the
driver runs them ``time_scale`` times faster than real time (1 against a real engine; e.g. 30 against
``kvgate engine --time-scale 30``). Records are in virtual seconds from the run's start.

Scheduling. There is one scheduler: the event loop's timer heap, fed with *absolute* deadlines
``t0 + virtual / time_scale`` (:class:`Clock`). A session arrives by a timer at its arrival time; after each turn
it sleeps until ``end of turn + think time``, again an absolute deadline, so timing errors never accumulate
(no ``sleep(delay)`` chains). The schedule lag of every turn (actual send - scheduled send, virtual seconds) is
recorded in ``lag_s``; ``benchmarks/bench_driver.py`` measures it with 1,000 concurrent sessions.

Session life cycle (closed loop, as in ``sim/runner.py``)::

    arrive ─▶ turn 0 ─▶ think ─▶ turn 1 ─▶ ... ─▶ last turn (X-Session-End: true) ─▶ done
                 └─ failed (4xx, or retries exhausted) ─▶ abandoned: the session leaves, its end_s stays null

Prompts. Turn k+1 sends exactly turn k's prompt, then the model's output, then the appended (tool) tokens::

    | shared prefix | unique task | out_0 | app_0 | out_1 | app_1 | ... |
    '- same ids in every session  '- the session's own random stream, keyed by (seed, session, part)

With ``--api completions`` prompts are token-id lists: the output part is the completion's own token ids
(``return_token_ids``, vLLM >= 0.10.2); a server that does not return them gets stand-in ids (one warning), so
its cache then matches up to the end of the previous prompt only. The appended part is sized so that prompt
lengths follow the shape exactly (``prompt_tokens()[k]``) even if an output comes back short. With
``--api chat`` prompts are messages: a shared system message, the task, then the returned assistant text
verbatim and a message with the appended text; lengths are approximate (one word is about one token).

Records. Rows are appended to ``turns.jsonl``, ``sessions.jsonl`` and ``samples.jsonl`` as they happen (one
flushed line each), with a provisional ``run.json`` written first, so a crash loses at most the turns in flight
and the partial directory still loads. At the end (the horizon, or Ctrl-C) they become Parquet plus the final
``run.json`` (kind "drive", config, seed, version, summary); failed attempts stay in ``errors.jsonl``.
Columns the driver cannot observe: ``admit_s``, ``park_wait_s`` NaN, turn ``preemptions`` null, and in samples
the gateway's ``admitted``, ``parked``, ``gateway_waiting``, ``admitted_demand_tokens`` and the engine's
``waiting``, ``preemptions`` are -1, ``kv_usage`` NaN, ``pool_tokens`` -1 unless the server reported its pool
(C as :mod:`kvgate.http.discovery` defines it). ``running`` is the driver's turns in flight.

Through a kvgate gateway (detected by its ``/kvgate/info``) the gateway's side is observable and recorded
(:mod:`kvgate.http.driver_gateway`): each turn's ``park_wait_s`` and ``sent_s`` (= send + park wait), so
``first_sent_s`` is when the first turn left the gateway; the samples' gateway columns; in ``run.json`` the
controller, its switches, the parked and waiting turns, the gateway's counters over the run and its upstream's
kind and pool; and the summary's ``control``, ``parks`` and ``gateway_wait_p90_min`` as the simulator computes
them. A first turn aborted at the end of the run keeps ``first_sent_s`` null (it may still have been held).

The retry policy is in :mod:`kvgate.http.client`. This module imports nothing heavy at import time, so the CLI
stays fast; ``aiohttp``, ``pyarrow`` and the workload are imported when a run starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import gc
import json
import math
import random
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click
import numpy as np

from kvgate.errors import UsageError
from kvgate.http.clock import Clock
from kvgate.http.driver_gateway import GatewayLog

if TYPE_CHECKING:
    from kvgate.http.client import AttemptError, Reply, ServerInfo
    from kvgate.records import Columns
    from kvgate.workload.arrivals import SessionSpec
    from kvgate.workload.shapes import Workload

SESSION_END_HEADER = "X-Session-End"
TOKEN_ID_RANGE = (1000, 30000)
"""Random prompt token ids are drawn from this range: inside every common vocabulary (Llama, Qwen, Mistral) and
clear of the special tokens at both ends."""
STATUS_EVERY_S = 0.5
PLAIN_STATUS_EVERY_S = 30.0
RECORD_FILES = ("turns", "sessions", "samples")


# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriveConfig:
    """Everything that defines a driven run. Stored whole in ``run.json`` (the API key never is)."""

    endpoint: str
    model: str | None = None
    """None: the first model the endpoint lists."""
    api: str = "completions"
    """"completions" (token-id prompts) or "chat" (text messages)."""
    stream: bool = False
    preset: str = "paper-8b"
    trace: str | None = None
    """Trace-shape JSONL to replay instead of a preset; "bundled" for the packaged set."""
    max_context: int | None = None
    lam: float = 0.035
    minutes: float = 90.0
    seed: int = 501
    bursts: tuple[str, ...] = ()
    flush_at: float | None = None
    rate_at: tuple[str, ...] = ()
    time_scale: float = 1.0
    """Virtual seconds per real second."""
    session_header: str = "X-Session-ID"
    max_in_flight: int = 4096
    timeout_s: float = 3600.0
    """Real seconds one request attempt may take."""
    retries: int = 3
    backoff_s: float = 0.5
    """First retry backoff in real seconds (doubles per retry, at most 8 s)."""
    client_timeout_s: float | None = None
    """Agent-side timeout of one attempt of a turn (virtual seconds from sending it); None: wait for ever. As the
    simulator's: without a gateway the timed-out attempt is disconnected (the engine aborts it); through a gateway
    it stays open until its retry, which replaces it there (cancelled upstream, or its held place taken over)."""
    client_retries: int = 0
    """Attempts after the first before the agent gives up its session."""
    retry_backoff_s: float = 2.0
    """Virtual seconds before retry i (doubling per retry, times 1 ± ``retry_jitter`` drawn per attempt)."""
    retry_jitter: float = 0.5
    flush_retry_s: float = 1.0
    """Virtual seconds between /flush_cache attempts while SGLang answers 400 (the paper: every second)."""
    ignore_eos: bool = True
    """Send vLLM/SGLang's ``ignore_eos`` and ``min_tokens`` so every output has the shape's length."""
    append_role: str = "user"
    """Role of the appended (tool output) messages with --api chat: "user" or "tool"."""
    sample_s: float = 10.0
    label: str = ""

    def with_(self, **kw: Any) -> DriveConfig:
        return replace(self, **kw)

    @property
    def horizon_s(self) -> float:
        return self.minutes * 60.0

    def workload(self) -> Workload:
        if self.trace:
            from kvgate.workload.trace import PAPER_MAX_CONTEXT, trace_workload

            path = None if self.trace == "bundled" else self.trace
            return trace_workload(path, max_context=self.max_context or PAPER_MAX_CONTEXT)
        from kvgate.workload.shapes import preset

        return preset(self.preset)


def validate(cfg: DriveConfig) -> Workload:
    """Check a config before running; raises UsageError with a one-line message. Returns the workload."""
    check_fields(cfg)
    return cfg.workload()


def check_fields(cfg: DriveConfig) -> None:
    """Everything :func:`validate` checks except building the workload."""
    from kvgate.http.client import normalize_endpoint
    from kvgate.workload.arrivals import parse_burst, parse_rate_at

    normalize_endpoint(cfg.endpoint)
    if cfg.api not in ("completions", "chat"):
        raise UsageError(f"--api {cfg.api!r}: choose completions or chat")
    if not cfg.lam >= 0:
        raise UsageError(f"negative arrival rate {cfg.lam}")
    if not cfg.minutes > 0:
        raise UsageError("--minutes must be positive")
    if not (cfg.time_scale > 0 and math.isfinite(cfg.time_scale)):
        raise UsageError("--time-scale must be a positive number")
    if cfg.max_in_flight < 1:
        raise UsageError("--max-in-flight must be at least 1")
    if not cfg.timeout_s > 0:
        raise UsageError("--timeout must be positive")
    if cfg.retries < 0:
        raise UsageError("--retries must be non-negative")
    if cfg.client_timeout_s is not None and not cfg.client_timeout_s > 0:
        raise UsageError("--client-timeout must be positive")
    if cfg.client_retries < 0 or cfg.retry_backoff_s < 0 or not 0 <= cfg.retry_jitter < 1:
        raise UsageError("--client-retries and --retry-backoff must be non-negative and --retry-jitter in [0, 1)")
    if cfg.flush_at is not None and cfg.flush_at < 0:
        raise UsageError("--flush-at must be non-negative")
    if not cfg.session_header.strip() or any(c in cfg.session_header for c in ": \r\n"):
        raise UsageError(f"--session-header {cfg.session_header!r} is not a header name")
    if cfg.append_role not in ("user", "tool"):
        raise UsageError(f"--append-role {cfg.append_role!r}: choose user or tool")
    for b in cfg.bursts:
        parse_burst(b)
    for r in cfg.rate_at:
        parse_rate_at(r)


# ---------------------------------------------------------------------------------------------------------------
# The clock: virtual time on the event loop's timer heap
# ---------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------

# Common English words that are one token in the usual BPE vocabularies (with their leading space).
_WORD_TEXT = """the of and to in is it that for on was with as be at by this had not are but from or have an they which
    one you were her all she there would their we him been has when who will more no if out so said what up its
    about into than them can only other new some could time these two may then do first any my now such like our
    over man me even most made after also did many before must through back years where much your way well down
    should because each just those people how too little state good very make world still own see men work long
    get here between both life being under never day same another know while last might us great old year off
    come since against go came right used take three states himself few house use during without again place
    around however home small found thought went say part once general high upon school every does got united left
    number course war until always away something fact though water less public put think almost hand enough far
    took head yet government system better set told nothing night end why called didn find going look asked later
    knew point next program city business give group toward young days let room president side social given
    present several order national second possible rather per face among form important often things looked early
    white case john become large big need four within felt along children saw best church ever least power
    development light thing seemed family interest want members mind country area others done turned although open
    file code test line value error list data function return class type name path check run build change"""
_WORDS = tuple(_WORD_TEXT.split())


def _joined(*parts: str) -> str:
    return ",".join(p for p in parts if p)


class _Vocab:
    """The run's prompt material: the shared prefix (identical in every session) and per-session random streams.

    Every random part comes from its own ``random.Random`` seeded by a string key ``kvgate/<seed>/<session>/<part>``
    (string seeds hash with SHA-512, so streams are the same in every process and independent of the call order).
    """

    SHARED_KEY = "kvgate/shared-prefix"

    def __init__(self, seed: int) -> None:
        self.seed = seed
        lo, hi = TOKEN_ID_RANGE
        self.id_strs = [str(i) for i in range(lo, hi)]
        self._shared_ids: list[str] = []
        self._shared_words: list[str] = []
        self._shared_cache: dict[tuple[str, int], str] = {}

    def key(self, sid: int) -> str:
        return f"kvgate/{self.seed}/{sid}"

    def ids(self, key: str, n: int) -> str:
        """``n`` random token ids from the stream ``key``, comma-joined."""
        if n <= 0:
            return ""
        return ",".join(random.Random(key).choices(self.id_strs, k=n))

    def words(self, key: str, n: int) -> str:
        if n <= 0:
            return ""
        return " ".join(random.Random(key).choices(_WORDS, k=n))

    def shared_ids(self, n: int) -> str:
        """The first ``n`` ids of the run's shared prefix (the same for every session and every seed)."""
        hit = self._shared_cache.get(("ids", n))
        if hit is None:
            if len(self._shared_ids) < n:
                self._shared_ids = random.Random(self.SHARED_KEY).choices(self.id_strs, k=max(n, 4096))
            hit = self._shared_cache[("ids", n)] = ",".join(self._shared_ids[:n])
        return hit

    def shared_words(self, n: int) -> str:
        hit = self._shared_cache.get(("words", n))
        if hit is None:
            if len(self._shared_words) < n:
                self._shared_words = random.Random(self.SHARED_KEY).choices(_WORDS, k=max(n, 4096))
            hit = self._shared_cache[("words", n)] = " ".join(self._shared_words[:n])
        return hit


class TokenPrompt:
    """A growing token-id prompt, kept as the text of its JSON array (one string concat per turn, no re-encoding).

    ::

        | shared (n_shared) | task (initial - n_shared) | out_0 | app_0 | ... | out_{k-1} | app_{k-1} |
    """

    __slots__ = ("ids", "n")

    def __init__(self, vocab: _Vocab, key: str, n_shared: int, n_unique: int) -> None:
        self.ids = _joined(vocab.shared_ids(n_shared), vocab.ids(f"{key}/task", n_unique))
        self.n = n_shared + n_unique

    def body(self, head: str) -> bytes:
        """``head`` is a JSON object without its closing brace."""
        return f'{head},"prompt":[{self.ids}]}}'.encode()

    def extend(self, out: str, n_out: int, app: str, n_app: int) -> None:
        self.ids = _joined(self.ids, out, app)
        self.n += n_out + n_app


class ChatPrompt:
    """A growing message list, kept as the text of its JSON array.

    ``system`` (shared) ▸ ``user`` task ▸ ``assistant`` out_0 (returned text, verbatim) ▸ appended app_0 ▸ ...
    """

    __slots__ = ("msgs", "n", "role")

    def __init__(self, vocab: _Vocab, key: str, n_shared: int, n_unique: int, role: str) -> None:
        parts = []
        if n_shared > 0:
            parts.append(json.dumps({"role": "system", "content": vocab.shared_words(n_shared)}))
        parts.append(json.dumps({"role": "user", "content": vocab.words(f"{key}/task", max(1, n_unique))}))
        self.msgs = ",".join(parts)
        self.n = n_shared + max(1, n_unique)
        self.role = role

    def body(self, head: str) -> bytes:
        return f'{head},"messages":[{self.msgs}]}}'.encode()

    def extend(self, k: int, text: str, n_out: int, app_text: str, n_app: int) -> None:
        app: dict[str, str] = {"role": self.role, "content": app_text}
        if self.role == "tool":
            app["tool_call_id"] = f"call_{k}"
        self.msgs = ",".join((self.msgs, json.dumps({"role": "assistant", "content": text}), json.dumps(app)))
        self.n += n_out + n_app


# ---------------------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------------------


def _jv(v: Any) -> Any:
    """A record value as strict JSON (NaN and infinities become null)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Recorder:
    """Streams rows to ``<table>.jsonl`` (one flushed line per row) and keeps them for the final Parquet."""

    def __init__(self, out: Path, *, force: bool = False) -> None:
        from kvgate.records import SCHEMAS, Columns

        self.out = out
        prepare_out(out, force=force)
        out.mkdir(parents=True, exist_ok=True)
        self.cols: dict[str, Columns] = {name: Columns(SCHEMAS[name]) for name in RECORD_FILES}
        self.names = {name: [f.name for f in SCHEMAS[name]] for name in RECORD_FILES}
        self.files: dict[str, IO[str]] = {
            name: open(out / f"{name}.jsonl", "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
            for name in (*RECORD_FILES, "errors")
        }

    def add(self, table: str, values: tuple[Any, ...], extra: dict[str, Any] | None = None) -> None:
        self.cols[table].add(*values)
        row = {n: _jv(v) for n, v in zip(self.names[table], values, strict=True)}
        if extra:
            row.update(extra)
        self._line(table, row)

    def error(self, row: dict[str, Any]) -> None:
        self._line("errors", row)

    def _line(self, name: str, row: dict[str, Any]) -> None:
        f = self.files[name]
        f.write(json.dumps(row, separators=(",", ":")) + "\n")
        f.flush()

    def write_meta(self, meta: dict[str, Any]) -> None:
        tmp = self.out / ".run.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
        tmp.replace(self.out / "run.json")

    def tables(self) -> dict[str, Any]:
        t = {name: c.table() for name, c in self.cols.items()}
        t["sessions"] = t["sessions"].sort_by("session")
        return t

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def finish(self, meta: dict[str, Any], tables: dict[str, Any]) -> None:
        """Parquet + run.json (written last), then drop the converted jsonl files (``errors.jsonl`` stays)."""
        from kvgate.records import write_run

        self.close()
        write_run(self.out, meta, tables)
        for name in RECORD_FILES:
            (self.out / f"{name}.jsonl").unlink(missing_ok=True)


def prepare_out(out: Path, *, force: bool, check_only: bool = False) -> None:
    """Refuse to mix two runs in one directory; with ``force`` remove the old run's record files."""
    names = ["run.json"] + [f"{n}.{ext}" for n in (*RECORD_FILES, "errors") for ext in ("parquet", "jsonl")]
    old = [out / n for n in names if (out / n).exists()]
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: not a directory")
    if old and not force:
        raise UsageError(f"--out {out} already holds a run; pick another directory or pass --force")
    if not check_only:
        for p in old:
            p.unlink()


# ---------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Session:
    spec: SessionSpec
    prompts: list[int]
    prompt: TokenPrompt | ChatPrompt
    turns_done: int = 0
    demand: int = 0
    first_sent: float = math.nan
    last_end: float = math.nan
    end: float = math.nan
    left: bool = False
    task: asyncio.Task[None] | None = None


@dataclass
class DriveResult:
    out: Path
    meta: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def summary(self) -> dict[str, Any]:
        return self.meta["summary"]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


class Driver:
    """One driven run. ``await Driver(cfg, out).run()``; :meth:`stop` ends it early (records intact)."""

    def __init__(
        self,
        cfg: DriveConfig,
        out: str | Path,
        *,
        workload: Workload | None = None,
        api_key: str | None = None,
        status: bool | None = None,
        log: Callable[[str], None] | None = None,
        force: bool = False,
        handle_signals: bool = True,
    ) -> None:
        self.cfg = cfg
        self.out = Path(out)
        if workload is None:
            workload = validate(cfg)
        else:
            check_fields(cfg)
        self.workload = workload
        self.api_key = api_key
        self.status_mode = status
        self.force = force
        self.handle_signals = handle_signals
        self._console: Any = None
        self._log_fn = log
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        self.interrupted = False
        # run state
        self.horizon = cfg.horizon_s
        self.sessions: dict[int, _Session] = {}
        self.in_system = 0
        self.running = 0
        self.demand_total = 0
        self.turns_ok = 0
        self.turns_error = 0
        self.turns_aborted = 0
        self.client_timeouts = self.client_retries_sent = self.sessions_abandoned = 0
        self.attempts_failed = 0
        self.errors_by_kind: dict[str, int] = {}
        self.first_errors: list[str] = []
        self.flush_info: dict[str, Any] | None = None
        self.token_ids_returned: bool | None = None
        self.cached_reported: bool | None = None
        self._recent: deque[tuple[float, int, int | None]] = deque()
        self._lags_ms: deque[float] = deque(maxlen=2000)
        self._stop: asyncio.Event | None = None
        self._stopping = False
        self._stopped_at: float | None = None
        self._handles: list[asyncio.TimerHandle] = []
        self._sample_handle: asyncio.TimerHandle | None = None
        self._flush_tasks: list[asyncio.Task[None]] = []
        self._crash: BaseException | None = None
        self._prompt_lengths: dict[int, list[int]] = {}
        self.gw: GatewayLog | None = None
        """The gateway's side when the endpoint is a kvgate gateway."""
        self._gw_poll: asyncio.Task[None] | None = None

    # -- logging ----------------------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self._log_fn is not None:
            self._log_fn(msg)
        elif self._console is not None:
            self._console.print(f"kvgate: {msg}", markup=False, highlight=False, soft_wrap=True)
        else:
            click.echo(f"kvgate: {msg}", err=True)

    def warn_once(self, key: str, msg: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        self.warnings.append(msg)
        self.log(f"warning: {msg}")

    # -- public -------------------------------------------------------------------------------------------------
    def stop(self, interrupted: bool = True) -> None:
        """End the run now (as Ctrl-C does): in-flight turns are aborted and recorded, records are finished."""
        if self._stop is not None and not self._stop.is_set():
            self.interrupted = self.interrupted or interrupted
            self._halt()
            self._stop.set()

    def _halt(self) -> list[asyncio.Task[Any]]:
        """Stop the schedule and cancel every session at once (idempotent); returns the tasks to await.

        NOTE: synchronous, so nothing that completes after the stop (a reply already on its way) is recorded as a
        finished turn: the tasks are cancelled before they next run, and their turns in flight become "aborted".
        """
        if not self._stopping:
            self._stopping = True
            self._stopped_at = min(self.clock.now(), self.horizon)
            for h in self._handles:
                h.cancel()
            if self._sample_handle is not None:
                self._sample_handle.cancel()
        tasks = [s.task for s in self.sessions.values() if s.task is not None and not s.task.done()]
        tasks += [t for t in self._flush_tasks if not t.done()]
        for t in tasks:
            t.cancel()
        return tasks

    async def run(self) -> DriveResult:
        from kvgate.http.client import Client
        from kvgate.workload.arrivals import generate, parse_burst, parse_rate_at

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        wall0 = time.perf_counter()
        started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        specs = generate(
            self.workload,
            cfg.lam,
            self.horizon,
            cfg.seed,
            [parse_burst(b) for b in cfg.bursts],
            [parse_rate_at(r) for r in cfg.rate_at],
        )
        self.client = Client(
            cfg.endpoint,
            max_connections=cfg.max_in_flight,
            timeout_s=cfg.timeout_s,
            retries=cfg.retries,
            backoff_s=cfg.backoff_s,
            api_key=self.api_key,
        )
        async with self.client:
            self.info: ServerInfo = await self.client.probe()  # UsageError when the endpoint is down
            self.model = cfg.model or (self.info.models[0] if self.info.models else None)
            if cfg.model is None and self.model is None:
                self.warn_once("model", "the endpoint lists no models and --model is not set; sending no model")
            if self.info.gateway is not None:
                self.gw = GatewayLog(self.info.gateway, cfg.time_scale)
                if self.gw.scale_mismatch:
                    self.warn_once(
                        "gateway-scale",
                        f"the gateway runs at --time-scale {self.info.gateway.get('time_scale')} and the driver at "
                        f"{cfg.time_scale:g}; its park waits are converted to the driver's clock",
                    )
            self.rec = Recorder(self.out, force=self.force)
            base_meta = self._base_meta(started)
            self.rec.write_meta({**base_meta, "partial": True})
            self.vocab = _Vocab(cfg.seed)
            self.head = self._head_template()
            self.slots = asyncio.Semaphore(cfg.max_in_flight)
            self._stop = asyncio.Event()
            # NOTE: a full collection of everything imported and generated so far takes tens of ms, a stall every
            # turn in flight would feel; freeze it out of the collector for the run (undone in the finally below).
            gc.collect()
            gc.freeze()
            self.clock = Clock(loop, cfg.time_scale)
            self._handles = [self.clock.call_at(sp.arrival_s, self._arrive, sp) for sp in specs]
            self._handles.append(self.clock.call_at(self.horizon, self._at_horizon))
            self._next_sample = 0.0
            self._sample_handle = self.clock.call_at(0.0, self._sample_tick)
            if cfg.flush_at is not None and cfg.flush_at * 60.0 < self.horizon:
                self._handles.append(self.clock.call_at(cfg.flush_at * 60.0, self._start_flush))
            signals = self._install_signals(loop)
            status = self._start_status(loop)
            if self.gw is not None:
                self._gw_poll = loop.create_task(self._poll_gateway())
            try:
                await self._stop.wait()
            finally:
                gc.unfreeze()
                tasks = self._halt()
                await asyncio.gather(*tasks, return_exceptions=True)
                if self._gw_poll is not None:
                    self._gw_poll.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._gw_poll
                if self.gw is not None:
                    self.gw.end = await self.client.gateway_info()
                for sig in signals:
                    loop.remove_signal_handler(sig)
                if status is not None:
                    status.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await status
                self._stop_status()
            res = self._finish(base_meta, wall0)
        if self._crash is not None:
            raise self._crash
        return res

    # -- setup helpers --------------------------------------------------------------------------------------------
    def _base_meta(self, started: str) -> dict[str, Any]:
        from kvgate import __version__

        return {
            "kvgate_version": __version__,
            "kind": "drive",
            "config": asdict(self.cfg),
            "seed": self.cfg.seed,
            "workload": self.workload.name,
            "started_at": started,
            "server": {
                "endpoint": self.client.base,
                "kind": self.info.kind,
                "models": list(self.info.models),
                "model": self.model,
                "cache_report": self.info.cache_report,
                "via_gateway": self.info.gateway is not None,
                "pool": self.info.engine.record(),
            },
            "pool_tokens": self.info.pool_tokens,
            "block_size": self.info.block_size,
        }

    def _head_template(self) -> dict[str, Any]:
        head: dict[str, Any] = {}
        if self.model is not None:
            head["model"] = self.model
        head["stream"] = self.cfg.stream
        if self.cfg.stream:
            head["stream_options"] = {"include_usage": True}
        if self.cfg.api == "completions":
            head["return_token_ids"] = True
        return head

    def _head(self, n_out: int) -> str:
        h = dict(self.head, max_tokens=n_out)
        if self.cfg.ignore_eos:
            h["ignore_eos"] = True
            h["min_tokens"] = n_out
        return json.dumps(h, separators=(",", ":"))[:-1]

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> list[int]:
        if not self.handle_signals:
            return []
        installed: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
                continue
            installed.append(sig)
        return installed

    def _on_signal(self, sig: int) -> None:
        self.log("stopping: finishing the records (Ctrl-C again to abort)")
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_signal_handler(sig)
        self.stop(interrupted=True)

    # -- the schedule ---------------------------------------------------------------------------------------------
    def _at_horizon(self) -> None:
        if self._next_sample <= self.horizon + 1e-9:  # the last sample falls on the horizon itself
            if self._sample_handle is not None:
                self._sample_handle.cancel()
            self._take_sample(self._next_sample)
        self.stop(interrupted=False)

    def _sample_tick(self) -> None:
        t = self._next_sample
        self._take_sample(t)
        self._next_sample = t + self.cfg.sample_s
        if self._next_sample <= self.horizon + 1e-9 and not self._stopping:
            self._sample_handle = self.clock.call_at(self._next_sample, self._sample_tick)

    def _take_sample(self, t: float) -> None:
        pool = self.info.pool_tokens if self.info.pool_tokens is not None else -1
        admitted, parked, waiting, gw_demand = self.gw.sample() if self.gw is not None else (-1, -1, -1, -1)
        self.rec.add(
            "samples",
            (t, self.in_system, admitted, parked, waiting, self.running, -1, math.nan, self.demand_total, gw_demand,
             pool, -1),
        )  # fmt: skip
        self._next_sample = t + self.cfg.sample_s

    async def _poll_gateway(self) -> None:
        """Keep the gateway's state fresh for the samples: ``/kvgate/info`` every sample period (real seconds)."""
        assert self.gw is not None
        every = self.cfg.sample_s / self.cfg.time_scale
        while True:
            info = await self.client.gateway_info()
            if info is not None:
                self.gw.latest = info
            await asyncio.sleep(every)

    def _arrive(self, spec: SessionSpec) -> None:
        if self._stopping:
            return
        shape = spec.shape
        key = self.vocab.key(spec.sid)
        n_unique = shape.initial_tokens - shape.shared_tokens
        prompt: TokenPrompt | ChatPrompt
        if self.cfg.api == "completions":
            prompt = TokenPrompt(self.vocab, key, shape.shared_tokens, n_unique)
        else:
            prompt = ChatPrompt(self.vocab, key, shape.shared_tokens, n_unique, self.cfg.append_role)
        prompts = self._prompt_lengths.get(id(shape))
        if prompts is None:  # shapes are shared by many sessions (presets) or a trace pool: compute once each
            prompts = self._prompt_lengths[id(shape)] = shape.prompt_tokens()
        s = _Session(spec, prompts, prompt)
        self.sessions[spec.sid] = s
        self.in_system += 1
        s.task = asyncio.get_running_loop().create_task(self._play(s))
        s.task.add_done_callback(self._session_done)

    def _session_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if self._crash is None:  # a bug: stop the run, finish the records, then re-raise
            self._crash = exc
            self.log(f"internal error, stopping: {exc!r}")
            self.stop(interrupted=True)

    async def _play(self, s: _Session) -> None:
        spec = s.spec
        due = spec.arrival_s
        for k in range(spec.shape.turns):
            body = s.prompt.body(self._head(spec.shape.outputs[k]))  # built before the deadline, not after it
            if k:
                due = s.last_end + spec.think_s[k - 1]
                if due >= self.horizon:
                    return  # still thinking when the run ends: in the system, unfinished
                await self.clock.sleep_until(due)
            if not await self._turn(s, k, due, body):
                self._leave(s, finished=False)
                return
        self._leave(s, finished=True)

    def _leave(self, s: _Session, *, finished: bool) -> None:
        now = self.clock.now()
        s.left = True
        self.in_system -= 1
        self.demand_total -= s.demand
        s.demand = 0
        if finished:
            s.end = now
        self._session_row(s)

    def _session_row(self, s: _Session) -> None:
        sp = s.spec
        self.rec.add(
            "sessions",
            (
                sp.sid, sp.cohort, sp.arrival_s, None if math.isnan(s.end) else s.end, sp.shape.turns,
                s.turns_done, None if math.isnan(s.first_sent) else s.first_sent, sp.shape.source,
            ),
        )  # fmt: skip

    # -- one turn -------------------------------------------------------------------------------------------------
    async def _turn(self, s: _Session, k: int, due: float, body: bytes) -> bool:
        """Play turn ``k`` of ``s`` (scheduled at virtual ``due``); False when it failed and the session ends."""
        shape = s.spec.shape
        n_out = shape.outputs[k]
        demand = s.prompts[k] + n_out  # as the simulator: this turn's prompt plus its output budget
        self.demand_total += demand - s.demand
        s.demand = demand
        last = k == shape.turns - 1
        headers = {self.cfg.session_header: str(s.spec.sid)}
        if last:
            headers[SESSION_END_HEADER] = "true"
        path = "/v1/completions" if self.cfg.api == "completions" else "/v1/chat/completions"
        async with self.slots:
            sent = self.clock.now()
            lag = sent - due
            if math.isnan(s.first_sent) and self.gw is None:
                s.first_sent = sent
            self.running += 1
            try:
                if self.cfg.client_timeout_s is None:
                    reply = await self.client.turn(
                        path, body, headers, stream=self.cfg.stream,
                        on_error=lambda e, attempt, again: self._attempt_failed(s, k, e, attempt, again),
                    )  # fmt: skip
                else:
                    got = await self._agent_attempts(s, k, due, lag, path, body, headers)
                    if got is None:  # out of retries: the agent gives up its session
                        return False
                    reply = got
            except asyncio.CancelledError:
                self.turns_aborted += 1
                end = self._stopped_at if self._stopped_at is not None else self.clock.now()
                self._turn_row(s, k, due, sent, lag, end, s.prompt.n, None, 0, "aborted", None)
                raise
            finally:
                self.running -= 1
        end = self.clock.now()
        self._lags_ms.append(lag / self.cfg.time_scale * 1000.0)
        if end > self.horizon:  # finished after the run's end (the horizon timer is due): as the simulator, not done
            self.turns_aborted += 1
            self._turn_row(s, k, due, sent, lag, self.horizon, s.prompt.n, None, 0, "aborted", None)
            return False
        if not reply.ok:
            self.turns_error += 1
            if math.isnan(s.first_sent):
                s.first_sent = sent
            extra = {"error": reply.error, "http_status": reply.http_status, "attempts": reply.attempts}
            self._turn_row(s, k, due, sent, lag, end, s.prompt.n, None, 0, "error", None, extra)
            return False
        wait = math.nan
        left = sent  # when the turn left the gateway (the driver's send without one)
        if self.gw is not None and reply.park_wait_s is not None:
            wait = self.gw.wait_s(reply.park_wait_s)
            left = min(sent + wait, end)
            self.gw.turn(left, reply.hold, reply.control)
        if math.isnan(s.first_sent):
            s.first_sent = left
        cached = self._cached(reply)
        prompt_tokens = reply.prompt_tokens if reply.prompt_tokens is not None else s.prompt.n
        if self.cfg.api == "completions" and reply.prompt_tokens is not None and reply.prompt_tokens != s.prompt.n:
            self.warn_once(
                "prompt-count",
                f"the server counted {reply.prompt_tokens} prompt tokens where the driver sent {s.prompt.n} "
                "token ids (it may add special tokens); records keep the server's count",
            )
        out_ids = reply.token_ids
        n_got = reply.completion_tokens if reply.completion_tokens is not None else len(out_ids or ()) or n_out
        first = None if reply.first_token_at is None else self.clock.virtual(reply.first_token_at)
        self._turn_row(s, k, due, left, lag, end, prompt_tokens, cached, n_got, "ok", first, wait=wait)
        self.turns_ok += 1
        s.turns_done = k + 1
        s.last_end = end
        self._recent.append((end, prompt_tokens, cached))
        while self._recent[0][0] < end - 60.0:
            self._recent.popleft()
        if not last:
            self._extend(s, k, reply, n_got)
        return True

    async def _agent_attempts(
        self, s: _Session, k: int, due: float, lag: float, path: str, body: bytes, headers: dict[str, str]
    ) -> Reply | None:
        """Turn ``k`` with the agent's timeout and retries (the simulator's semantics); None when it gave up."""
        cfg = self.cfg
        assert cfg.client_timeout_s is not None

        def hook(e: AttemptError, attempt: int, again: bool) -> None:
            if e.http_status != 409:  # 409: an attempt replaced by its retry in the gateway (expected)
                self._attempt_failed(s, k, e, attempt, again)

        def send() -> asyncio.Task[Reply]:
            coro = self.client.turn(path, body, headers, stream=cfg.stream, on_error=hook)
            return asyncio.get_running_loop().create_task(coro)

        attempt = 0
        task = send()
        stale: list[asyncio.Task[Reply]] = []
        try:
            while True:
                t_sent = self.clock.now()
                done, _ = await asyncio.wait({task}, timeout=cfg.client_timeout_s / cfg.time_scale)
                if done:
                    return task.result()
                self.client_timeouts += 1
                now = self.clock.now()
                self._turn_row(s, k, due, t_sent, lag, now, s.prompt.n, None, 0, "aborted", None, {"attempt": attempt})
                if self.gw is None or attempt >= cfg.client_retries:
                    task.cancel()  # the client disconnects: the engine (or the gateway) aborts the attempt
                else:
                    stale.append(task)  # kept open: its retry replaces it in the gateway
                if attempt >= cfg.client_retries:
                    self.sessions_abandoned += 1
                    return None
                attempt += 1
                u = float(np.random.default_rng([cfg.seed, 4, s.spec.sid, k, attempt]).uniform(-1.0, 1.0))
                delay = cfg.retry_backoff_s * 2 ** (attempt - 1) * (1.0 + cfg.retry_jitter * u)
                await self.clock.sleep_until(now + delay)
                self.client_retries_sent += 1
                task = send()
        finally:
            pending = [t for t in (task, *stale) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    def _extend(self, s: _Session, k: int, reply: Reply, n_got: int) -> None:
        """Grow the prompt for turn k+1: + this turn's output + the appended tokens."""
        shape = s.spec.shape
        key = f"{self.vocab.key(s.spec.sid)}/turn{k}"
        if isinstance(s.prompt, ChatPrompt):
            n_app = shape.appends[k]
            s.prompt.extend(k, reply.text, n_got, self.vocab.words(f"{key}/append", max(1, n_app)), max(1, n_app))
            return
        if reply.token_ids is not None:
            self.token_ids_returned = True
            out = ",".join(map(str, reply.token_ids))
            n_out = len(reply.token_ids)
        else:
            self.token_ids_returned = False
            self.warn_once(
                "token-ids",
                "the server returned no completion token ids (vLLM >= 0.10.2 does for return_token_ids); appending "
                "stand-in ids, so each turn reuses the cache only up to the end of the previous prompt",
            )
            n_out = n_got
            out = self.vocab.ids(f"{key}/output", n_out)
        # NOTE: the append is sized so the next prompt has the shape's length even if the output came back short.
        n_app = max(0, s.prompts[k + 1] - s.prompt.n - n_out)
        s.prompt.extend(out, n_out, self.vocab.ids(f"{key}/append", n_app), n_app)

    def _cached(self, reply: Reply) -> int | None:
        if reply.cached_reported:
            self.cached_reported = True
            return reply.cached_tokens
        if self.info.kind == "sglang" and self.info.cache_report:
            return 0  # SGLang with --enable-cache-report omits the field when nothing was cached
        if self.cached_reported is None:
            self.cached_reported = False
        self.warn_once(
            "cached",
            "the endpoint does not report cached prompt tokens (usage.prompt_tokens_details.cached_tokens); "
            "recording them as null (unknown). Start vLLM with --enable-prompt-tokens-details or SGLang with "
            "--enable-cache-report",
        )
        return None

    def _turn_row(
        self,
        s: _Session,
        k: int,
        due: float,
        sent: float,
        lag: float,
        end: float,
        prompt_tokens: int,
        cached: int | None,
        output_tokens: int,
        status: str,
        first: float | None,
        extra: dict[str, Any] | None = None,
        wait: float = math.nan,
    ) -> None:
        nan = math.nan
        self.rec.add(
            "turns",
            (
                s.spec.sid, s.spec.cohort, k, due, sent, nan, nan if first is None else first, end,
                prompt_tokens, cached, output_tokens, wait, None, status, lag,
            ),
            extra,
        )  # fmt: skip

    def _attempt_failed(self, s: _Session, k: int, e: AttemptError, attempt: int, again: bool) -> None:
        self.attempts_failed += 1
        self.errors_by_kind[e.kind] = self.errors_by_kind.get(e.kind, 0) + 1
        now = self.clock.now()
        self.rec.error(
            {
                "t_s": round(now, 6), "session": s.spec.sid, "turn": k, "attempt": attempt, "retry": again,
                "kind": e.kind, "http_status": e.http_status, "error": e.text,
            }
        )  # fmt: skip
        if len(self.first_errors) < 5:
            self.first_errors.append(f"session {s.spec.sid} turn {k}: {e.text}")
        if self.errors_by_kind[e.kind] <= 3 or self.errors_by_kind[e.kind] % 1000 == 0:
            what = "retrying" if again else "turn failed"
            self.log(
                f"session {s.spec.sid} turn {k} attempt {attempt}: {e.text} ({what}; "
                f"{self.errors_by_kind[e.kind]} {e.kind} errors so far)"
            )

    def _start_flush(self) -> None:
        self._flush_tasks.append(asyncio.get_running_loop().create_task(self._flush()))

    async def _flush(self) -> None:
        at = self.clock.now()
        self.log(f"flush at minute {at / 60:.2f}")
        retry_s = self.cfg.flush_retry_s / self.cfg.time_scale
        info = await self.client.flush(kind=self.info.kind, retry_s=retry_s, log=self.log)
        info.update(at_s=at, done_s=self.clock.now())
        self.flush_info = info
        if info["ok"]:
            self.log(f"flush done via {info['endpoint']} after {info['attempts']} attempt(s)")
        else:
            self.warn_once("flush", f"could not flush the prefix cache: {info['endpoint']} answered {info['answer']}")

    # -- status line ----------------------------------------------------------------------------------------------
    def _status_text(self) -> str:
        now = self.clock.now()
        while self._recent and self._recent[0][0] < now - 60.0:
            self._recent.popleft()
        known = [(p, c) for _, p, c in self._recent if c is not None]
        p_sum = sum(p for p, _ in known)
        hit = f"{sum(c for _, c in known) / p_sum:.2f}" if p_sum else "-"
        rate = len(self._recent) / min(60.0, max(now, 1e-9))
        lag = _pct(list(self._lags_ms), 99)
        lag_s = f"{lag:.1f} ms" if not math.isnan(lag) else "-"
        errors = f"errors {self.turns_error}"
        if self.attempts_failed > self.turns_error:
            errors += f" (+{self.attempts_failed - self.turns_error} retried)"
        return (
            f"{min(now, self.horizon) / 60:.1f}/{self.horizon / 60:g} min | sessions {self.in_system} | "
            f"in flight {self.running} | hit 1m {hit} | {rate:.2f} turns/s | {errors} | lag p99 {lag_s}"
        )

    def _start_status(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[None] | None:
        mode = self.status_mode
        if mode is False:
            return None
        live = mode is True or (mode is None and sys.stderr.isatty())
        from rich.console import Console

        self._console = Console(stderr=True)
        self._live: Any = None
        if live:
            from rich.live import Live

            self._live = Live("", console=self._console, auto_refresh=False, transient=False)
            self._live.start()
        return loop.create_task(self._status_loop(STATUS_EVERY_S if live else PLAIN_STATUS_EVERY_S))

    async def _status_loop(self, every: float) -> None:
        if self._live is None:
            await asyncio.sleep(every)  # a plain log line at t=0 would say nothing
        while True:
            text = self._status_text()
            if self._live is not None:
                from rich.text import Text

                self._live.update(Text(text, no_wrap=True, overflow="ellipsis"), refresh=True)
            else:
                self.log(text)
            await asyncio.sleep(every)

    def _stop_status(self) -> None:
        live = getattr(self, "_live", None)
        if live is not None:
            from rich.text import Text

            live.update(Text(self._status_text(), no_wrap=True, overflow="ellipsis"), refresh=True)
            live.stop()
            self._live = None

    # -- the end --------------------------------------------------------------------------------------------------
    def _finish(self, base_meta: dict[str, Any], wall0: float) -> DriveResult:
        from kvgate.analysis.summary import summarize_tables

        for s in self.sessions.values():
            if not s.left:
                self._session_row(s)  # still in the system at the end: end_s null
        tables = self.rec.tables()
        stopped = self._stopped_at if self._stopped_at is not None else self.horizon
        meta = dict(base_meta)
        meta.update(
            partial=False,
            interrupted=self.interrupted,
            stopped_at_s=stopped,
            wall_s=round(time.perf_counter() - wall0, 3),
            warnings=list(self.warnings),
            errors={
                "turns_failed": self.turns_error,
                "attempts_failed": self.attempts_failed,
                "by_kind": dict(self.errors_by_kind),
                "first": list(self.first_errors),
            },
            flush=self.flush_info,
            token_ids_returned=self.token_ids_returned,
            cached_reported=self.cached_reported,
        )
        # the summary of an interrupted run covers the time it actually ran
        smeta = meta
        if self.interrupted:
            smeta = dict(meta, config=dict(meta["config"], minutes=stopped / 60.0))
        if self.gw is not None:
            # through a gateway: its controller, start and parks, in the simulator's terms
            meta["gateway"] = self.gw.record()
            meta["parks"] = self.gw.turns_parked
            control, control_at = self.gw.control()
            meta["gateway"]["summary_control"] = {"control": control, "control_at": control_at}
            smeta = dict(smeta, parks=meta["parks"], config=dict(smeta["config"], control=control,
                                                                 control_at=control_at))  # fmt: skip
        summary = summarize_tables(smeta, tables)
        lags = [x / self.cfg.time_scale * 1000.0 for x in tables["turns"].column("lag_s").to_pylist()]
        summary.update(
            turns_error=self.turns_error,
            turns_aborted=self.turns_aborted,
            client_timeouts=self.client_timeouts,
            client_retries=self.client_retries_sent,
            sessions_abandoned=self.sessions_abandoned,
            lag_p50_ms=_r(_pct(lags, 50), 3),
            lag_p99_ms=_r(_pct(lags, 99), 3),
            lag_max_ms=_r(max(lags) if lags else math.nan, 3),
            wall_s=meta["wall_s"],
            interrupted=self.interrupted,
        )
        meta["summary"] = summary
        self.rec.finish(meta, tables)
        return DriveResult(self.out, meta, list(self.warnings), self.interrupted)


def _r(x: float, nd: int) -> float | None:
    return None if math.isnan(x) else round(x, nd)


async def drive(
    cfg: DriveConfig,
    out: str | Path,
    *,
    workload: Workload | None = None,
    api_key: str | None = None,
    status: bool | None = None,
    log: Callable[[str], None] | None = None,
    force: bool = False,
    handle_signals: bool = True,
) -> DriveResult:
    """Run one driven experiment and write its records to ``out``. ``workload`` overrides the preset/trace."""
    d = Driver(
        cfg, out, workload=workload, api_key=api_key, status=status, log=log, force=force,
        handle_signals=handle_signals,
    )  # fmt: skip
    return await d.run()


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------


def format_summary(s: dict[str, Any], out: Path) -> str:
    deg = f"yes, from minute {s['degraded_from_min']}" if s["persistently_degraded"] else "no"
    rows = [
        ("hit ratio, last 10 min", s["hit_ratio_last10"]),
        ("hit ratio, all turns", s["hit_ratio_all"]),
        ("sessions in system, last 5 min", s["sessions_in_system_last5"]),
        ("turns/s, last 10 min", s["turns_per_s_last10"]),
        ("persistently degraded", deg),
        ("control / parks", f"{s.get('control')} / {s.get('parks')}"),
        ("gateway wait p90, first turns (min)", s.get("gateway_wait_p90_min")),
        ("sessions arrived / finished", f"{s['sessions_arrived']} / {s['sessions_finished']}"),
        ("turns ok / error / aborted", f"{s['turns_done']} / {s['turns_error']} / {s['turns_aborted']}"),
        ("schedule lag p50 / p99 (real ms)", f"{s['lag_p50_ms']} / {s['lag_p99_ms']}"),
        ("wall time (s)", s["wall_s"]),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"{k:<{w}}  {v}" for k, v in rows]
    lines.append(f"records: {out}")
    return "\n".join(lines)


@click.command("drive")
@click.option(
    "--endpoint",
    required=True,
    metavar="URL",
    help="OpenAI-compatible server, e.g. http://localhost:8000 (vLLM, SGLang, a gateway, kvgate engine).",
)
@click.option("--model", default=None, help="Model name to send [default: the first the endpoint lists].")
@click.option(
    "--api",
    type=click.Choice(["completions", "chat"]),
    default="completions",
    show_default=True,
    help="completions: token-id prompts (exact prefix reuse); chat: text messages (approximate lengths).",
)
@click.option("--stream", is_flag=True, help="Stream responses (SSE); records the first-token time.")
@click.option("--api-key", envvar="KVGATE_API_KEY", default=None, help="Bearer token [env: KVGATE_API_KEY].")
@click.option("--preset", default="paper-8b", show_default=True, help="Workload preset: paper-8b, paper-shift.")
@click.option(
    "--trace",
    default=None,
    help="Replay trace shapes (kvgate JSONL) instead; 'bundled' for the packaged mini-SWE-agent set.",
)
@click.option("--max-context", type=int, default=None, help="Truncate trace sessions at this context [default: 38000].")
@click.option("--lam", type=float, default=0.035, show_default=True, help="Base session arrival rate (1/virtual s).")
@click.option("--minutes", type=float, default=90.0, show_default=True, help="Run length (virtual minutes).")
@click.option("--seed", type=int, default=501, show_default=True)
@click.option(
    "--burst",
    "bursts",
    multiple=True,
    metavar="X@S+D",
    help="Extra Poisson stream at X*lam from minute S for D minutes (+N@S+D: N extra sessions). Repeatable.",
)
@click.option(
    "--flush-at",
    type=float,
    default=None,
    metavar="MIN",
    help="Flush the server's prefix cache at this (virtual) minute: vLLM /reset_prefix_cache, else "
    "SGLang /flush_cache.",
)
@click.option(
    "--rate-at",
    "rate_at",
    multiple=True,
    metavar="MIN:LAM",
    help="Change the base arrival rate at a minute. Repeatable.",
)
@click.option(
    "--time-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Virtual seconds per real second (1 for a real engine; match kvgate engine's).",
)
@click.option(
    "--session-header",
    default="X-Session-ID",
    show_default=True,
    help="Header carrying the session id on every turn (the last turn also sends X-Session-End: true).",
)
@click.option(
    "--max-in-flight",
    type=int,
    default=4096,
    show_default=True,
    help="Most turns in flight at once (and pooled connections); waiting for a slot counts as lag.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=3600.0,
    show_default=True,
    help="Real seconds one request may take; a timed-out turn fails without retry.",
)
@click.option(
    "--retries",
    type=int,
    default=3,
    show_default=True,
    help="Retries of a turn after connection errors, 5xx and 429 (exponential backoff from 0.5 s).",
)
@click.option("--client-timeout", "client_timeout_s", type=float, default=None, metavar="S",
              help="Agent-side timeout of one attempt of a turn, virtual seconds [default: none].")  # fmt: skip
@click.option("--client-retries", type=int, default=0, show_default=True,
              help="Retries of a timed-out turn before the agent gives up its session.")  # fmt: skip
@click.option("--retry-backoff", "retry_backoff_s", type=float, default=2.0, show_default=True, metavar="S",
              help="Backoff before the first retry, virtual seconds (doubles per retry).")  # fmt: skip
@click.option("--retry-jitter", type=float, default=0.5, show_default=True,
              help="Backoff jitter: each wait times 1 ± this, drawn per attempt.")  # fmt: skip
@click.option("--no-ignore-eos", is_flag=True, help="Do not send ignore_eos/min_tokens (outputs may end early).")
@click.option(
    "--append-role",
    type=click.Choice(["user", "tool"]),
    default="user",
    show_default=True,
    help="Role of the appended tool-output messages with --api chat.",
)
@click.option("--label", default="", help="Free-form label stored in run.json.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Run directory for the records (jsonl while running, Parquet + run.json at the end).",
)
@click.option("--force", is_flag=True, help="Overwrite a run already in --out.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object at the end.")
def command(
    out: Path, force: bool, as_json: bool, api_key: str | None, no_ignore_eos: bool, **kw: Any
) -> None:  # fmt: skip
    """Drive an OpenAI-compatible endpoint with the simulator's closed-loop agent sessions.

    Same seed, same sessions as `kvgate sim` (arrival times, shapes, think times). Every turn resends the whole
    conversation (previous prompt + the model's output + appended tool tokens) with the session id in a header;
    records have the simulator's schema, times in virtual seconds. A live status line goes to stderr; Ctrl-C
    stops cleanly with the records finished.

    \b
    Against a real vLLM (start it with --enable-prompt-tokens-details):
      kvgate drive --endpoint http://localhost:8000 --burst 1.5@15+5 --out runs/drive-501
    Against kvgate's simulated engine, 30 times faster than real time:
      kvgate drive --endpoint http://localhost:8100 --time-scale 30 --minutes 90 --out runs/fast
    """
    cfg = DriveConfig(
        bursts=tuple(kw.pop("bursts")), rate_at=tuple(kw.pop("rate_at")), ignore_eos=not no_ignore_eos, **kw
    )
    wl = validate(cfg)
    prepare_out(out, force=force, check_only=True)
    res = asyncio.run(drive(cfg, out, workload=wl, api_key=api_key, force=force))
    if as_json:
        click.echo(json.dumps(res.summary, sort_keys=True))
    else:
        click.echo(format_summary(res.summary, out))
    if res.interrupted:
        click.echo("kvgate: interrupted; the records cover the run so far", err=True)
        sys.exit(130)
