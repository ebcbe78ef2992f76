"""``kvgate drive``: the closed-loop agent driver, playing the simulator's workload against a real endpoint.

The driver replaces the simulator's engine with any OpenAI-compatible server (vLLM, SGLang, a gateway in front of
them, or ``kvgate engine``) and keeps everything else: the same workload module draws the same sessions for the
same seed (arrival times, shapes, think times), the records have the simulator's schema, and the run directory
reads with :func:`kvgate.records.load_run` like a simulated one.

Time and scheduling. All workload times are virtual seconds (:mod:`kvgate.drive.config`), run ``time_scale``
times faster than real time on the one scaled clock (:class:`kvgate.http.clock.Clock`). There is one scheduler:
the event loop's timer heap, fed with *absolute* deadlines ``t0 + virtual / time_scale``. A session arrives by a
timer at its arrival time and then plays its turns in its own task (:mod:`kvgate.drive.turns`);
``benchmarks/bench_driver.py`` measures the schedule lag with 1,000 concurrent sessions.

Records. Rows are appended to ``turns.jsonl``, ``sessions.jsonl`` and ``samples.jsonl`` as they happen, with a
provisional ``run.json`` written first (:class:`kvgate.records.Recorder`), so a crash loses at most the turns in
flight and the partial directory still loads. At the end (the horizon, or Ctrl-C) they
become Parquet plus the final ``run.json`` (kind "drive", config, seed, version, summary); failed attempts stay in
``errors.jsonl``. Columns the driver cannot observe: ``admit_s``, ``park_wait_s`` NaN, turn ``preemptions`` null,
and in samples the gateway's ``admitted``, ``parked``, ``gateway_waiting``, ``admitted_demand_tokens`` and the
engine's ``waiting``, ``preemptions`` are -1, ``kv_usage`` NaN, ``kv_pool`` -1 unless the server reported its
pool (C as :mod:`kvgate.http.openai` defines it). ``running`` is the driver's turns in flight.

Through a kvgate gateway (detected by its ``/kvgate/info``) the gateway's side is observable and recorded
(:mod:`kvgate.drive.gateway_log`): each turn's ``park_wait_s`` and ``sent_s`` (= send + park wait), so
``first_sent_s`` is when the first turn left the gateway; the samples' gateway columns; in ``run.json`` the
control, its switches, the parked and waiting turns, the gateway's counters over the run and its upstream's
kind and pool; and the summary's ``control``, ``parks`` and ``gateway_wait_p90_min`` as the simulator computes
them. A first turn aborted at the end of the run keeps ``first_sent_s`` null (it may still have been held).

The retry policy is in :mod:`kvgate.drive.client` (``aiohttp``, imported when a run starts). The command
(:mod:`kvgate.drive.command`) imports this module only when it runs, so the CLI stays fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import gc
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from kvgate.drive.config import DriveConfig, check_fields, validate
from kvgate.drive.conversation import ConvoPrompt
from kvgate.drive.gateway_log import GatewayLog
from kvgate.drive.prompts import RequestHead, TokenPrompt, Vocab
from kvgate.drive.report import DriveResult, final_meta, start_meta
from kvgate.drive.status import DriveLog, StatusLine
from kvgate.drive.tally import Tally
from kvgate.drive.turns import DrivenSession, TurnPlayer
from kvgate.http.clock import Clock
from kvgate.http.dialect import APIS
from kvgate.records import SampleRow
from kvgate.workload.session import Sessions
from kvgate.workload.triggers import TRIGGER_PATH, Trigger, triggers_of

if TYPE_CHECKING:
    from kvgate.drive.client import Client, ServerInfo
    from kvgate.records import Recorder
    from kvgate.workload.arrivals import SessionSpec
    from kvgate.workload.shapes import Workload

__all__ = ["DriveConfig", "DriveOptions", "DriveResult", "Driver", "drive", "validate"]


class DriveOptions(TypedDict, total=False):
    """How one run is driven, beside its config (none of it is stored in ``run.json``)."""

    workload: Workload | None
    """Overrides the config's preset or trace."""
    api_key: str | None
    status: bool | None
    """The status line: True live, False none, None live on a terminal (plain lines otherwise)."""
    log: Callable[[str], None] | None
    force: bool
    """Overwrite a run already in the output directory."""
    handle_signals: bool
    """Stop cleanly on SIGINT and SIGTERM (main thread only)."""


class Driver:
    """One driven run. ``await Driver(cfg, out).run()``; :meth:`stop` ends it early (records intact)."""

    def __init__(self, cfg: DriveConfig, out: str | Path, **opts: Unpack[DriveOptions]) -> None:
        self.cfg = cfg
        self.out = Path(out)
        workload = opts.get("workload")
        if workload is None:
            workload = validate(cfg)
        else:
            check_fields(cfg)
        self.workload = workload
        self.api_key = opts.get("api_key")
        self.force = opts.get("force", False)
        self.handle_signals = opts.get("handle_signals", True)
        self.log = DriveLog(opts.get("log"))
        self.status = StatusLine(opts.get("status"), self.log, self._status_text)
        self.interrupted = False
        # run state, shared with the sessions' tasks (:class:`TurnPlayer`)
        self.horizon = cfg.horizon_s
        self.sessions = Sessions(cfg.agent_retries())
        """The closed loop: every session, those in the system and their demand, the agents' retries."""
        self.running = 0
        self.tally = Tally()
        self.flush_info: dict[str, Any] | None = None
        self.stopped_at: float | None = None
        """Virtual time the run stopped (None while it runs)."""
        self.gw: GatewayLog | None = None
        """The gateway's side when the endpoint is a kvgate gateway."""
        self.player = TurnPlayer(self)
        self._stop: asyncio.Event | None = None
        self._handles: list[asyncio.TimerHandle] = []
        self._sample_handle: asyncio.TimerHandle | None = None
        self._next_sample = 0.0
        self._trigger_tasks: list[asyncio.Task[None]] = []
        self._crash: BaseException | None = None
        # set up by run()
        self.clock: Clock
        self.client: Client
        self.info: ServerInfo
        self.rec: Recorder
        self.vocab: Vocab
        self.head: RequestHead
        self.slots: asyncio.Semaphore

    @property
    def warnings(self) -> list[str]:
        return self.log.warnings

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
        if self.stopped_at is None:
            self.stopped_at = min(self.clock.now(), self.horizon)
            for h in self._handles:
                h.cancel()
            if self._sample_handle is not None:
                self._sample_handle.cancel()
        tasks = [t for t in self._tasks() if not t.done()]
        tasks += [t for t in self._trigger_tasks if not t.done()]
        for t in tasks:
            t.cancel()
        return tasks

    async def run(self) -> DriveResult:
        from kvgate.drive.client import Client
        from kvgate.records import Recorder

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        wall0 = time.perf_counter()
        started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        specs = cfg.session_specs(self.workload)
        self.client = Client(
            cfg.endpoint, max_connections=cfg.max_in_flight, timeout_s=cfg.timeout_s, retries=cfg.retries,
            backoff_s=cfg.backoff_s, api_key=self.api_key,
        )
        async with self.client:
            self.info = await self.client.probe()  # UsageError when the endpoint is down
            model = cfg.model or (self.info.models[0] if self.info.models else None)
            if cfg.model is None and model is None:
                self.log.warn_once("model", "the endpoint lists no models and --model is not set; sending no model")
            if self.info.gateway is not None:
                self.gw = GatewayLog(self.info.gateway, cfg.time_scale)
                if self.gw.scale_mismatch:
                    self.log.warn_once(
                        "gateway-scale",
                        f"the gateway runs at --time-scale {self.info.gateway.get('time_scale')} and the driver at "
                        f"{cfg.time_scale:g}; its park waits are converted to the driver's clock",
                    )
            self.rec = Recorder(self.out, force=self.force)
            base_meta = start_meta(cfg, self.workload.name, self.client.base, self.info, started, model)
            self.rec.write_meta({**base_meta, "partial": True})
            self.vocab = Vocab(cfg.seed)
            self.head = RequestHead(
                model, api=cfg.api, stream=cfg.stream, ignore_eos=cfg.ignore_eos, token_ids=cfg.token_ids,
                session_field=cfg.session_field,
            )
            self.slots = asyncio.Semaphore(cfg.max_in_flight)
            self._stop = asyncio.Event()
            # NOTE: a full collection of everything imported and generated so far takes tens of ms, a stall every
            # turn in flight would feel; freeze it out of the collector for the run (undone in the finally below).
            gc.collect()
            gc.freeze()
            self.clock = Clock(loop, cfg.time_scale)
            self._handles = [self.clock.call_at(sp.arrival_s, self._arrive, sp) for sp in specs]
            self._handles.append(self.clock.call_at(self.horizon, self._at_horizon))
            self._sample_handle = self.clock.call_at(0.0, self._sample_tick)
            for trigger in triggers_of(cfg):  # each played at its minute (bursts and rate changes: in the arrivals)
                if trigger.over_http and trigger.at_s < self.horizon:
                    self._handles.append(self.clock.call_at(trigger.at_s, self._start_trigger, trigger))
            signals = self._install_signals(loop)
            self.status.start(loop)
            gw_poll = loop.create_task(self._poll_gateway()) if self.gw is not None else None
            try:
                await self._stop.wait()
            finally:
                gc.unfreeze()
                await asyncio.gather(*self._halt(), return_exceptions=True)
                if gw_poll is not None:
                    gw_poll.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await gw_poll
                if self.gw is not None:
                    self.gw.end = await self.client.gateway_info()
                for sig in signals:
                    loop.remove_signal_handler(sig)
                await self.status.stop()
            res = self._finish(base_meta, wall0)
        if self._crash is not None:
            raise self._crash
        return res

    # -- setup helpers --------------------------------------------------------------------------------------------
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
        self._take_sample(self._next_sample)
        if self._next_sample <= self.horizon + 1e-9 and self.stopped_at is None:
            self._sample_handle = self.clock.call_at(self._next_sample, self._sample_tick)

    def _take_sample(self, t: float) -> None:
        pool = self.info.kv_pool if self.info.kv_pool is not None else -1
        admitted, parked, waiting, gw_demand = self.gw.sample() if self.gw is not None else (-1, -1, -1, -1)
        ss = self.sessions
        row = SampleRow(t, ss.in_system, admitted, parked, waiting, self.running, -1, math.nan, ss.demand, gw_demand,
                        pool, -1)
        self.rec.sample(row)
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
        if self.stopped_at is not None:
            return
        shape = spec.shape
        key = self.vocab.key(spec.sid)
        n_unique = shape.initial_tokens - shape.shared_tokens
        prompt: TokenPrompt | ConvoPrompt
        cfg = self.cfg
        if not APIS[cfg.api].chat_like:
            prompt = TokenPrompt(self.vocab, key, shape.shared_tokens, n_unique)
        else:
            prompt = ConvoPrompt(cfg.api, self.vocab, key, shape.shared_tokens, n_unique, role=cfg.append_role,
                                 tools=cfg.tools, nonce=cfg.system_nonce, compact_every=cfg.compact_every)
        s = DrivenSession(spec, self.sessions.prompts_of(shape), prompt=prompt)
        self.sessions.arrive(s)
        s.task = asyncio.get_running_loop().create_task(self.player.play(s))
        s.task.add_done_callback(self._session_done)

    def _session_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if self._crash is None:  # a bug: stop the run, finish the records, then re-raise
            self._crash = exc
            self.log(f"internal error, stopping: {exc!r}")
            self.stop(interrupted=True)

    def _start_trigger(self, trigger: Trigger) -> None:
        self._trigger_tasks.append(asyncio.get_running_loop().create_task(trigger.play(self)))

    # -- the triggers' player (kvgate.workload.triggers.Player) --------------------------------------------------
    async def post_trigger(self, trigger: Trigger) -> None:
        """Ask a kvgate engine to apply ``trigger`` to its engine (``POST /kvgate/trigger``)."""
        spec = f"{trigger.kind}:{trigger.spec()}"
        self.log(f"trigger {spec} at minute {self.clock.now() / 60:.2f}")
        status, text = await self.client.post_admin(TRIGGER_PATH, {"trigger": spec})
        if status != 200:
            self.log.warn_once(f"trigger {trigger.kind}", f"could not play trigger {spec}: {TRIGGER_PATH} answered "
                               f"{status} {text}".strip())

    async def flush(self) -> None:
        """Empty the server's prefix cache (the flush trigger, played): vLLM's reset, else SGLang's flush."""
        at = self.clock.now()
        self.log(f"flush at minute {at / 60:.2f}")
        retry_s = self.cfg.flush_retry_s / self.cfg.time_scale
        info = await self.client.flush(kind=self.info.kind, retry_s=retry_s, log=self.log)
        info.update(at_s=at, done_s=self.clock.now())
        self.flush_info = info
        if info["ok"]:
            self.log(f"flush done via {info['endpoint']} after {info['attempts']} attempt(s)")
        else:
            self.log.warn_once(
                "flush", f"could not flush the prefix cache: {info['endpoint']} answered {info['answer']}"
            )

    def _status_text(self) -> str:
        return self.tally.status_text(self.clock.now(), self.horizon, self.sessions.in_system, self.running)

    def _tasks(self) -> list[asyncio.Task[None]]:
        tasks = []
        for s in self.sessions.values():
            task = s.task if isinstance(s, DrivenSession) else None
            if task is not None:
                tasks.append(task)
        return tasks

    # -- the end --------------------------------------------------------------------------------------------------
    def _finish(self, base_meta: dict[str, Any], wall0: float) -> DriveResult:
        for sid in sorted(self.sessions):
            s = self.sessions[sid]
            if not s.left:
                self.rec.session(s.row())  # still in the system at the end: end_s null
        tables = self.rec.tables()
        stopped = self.stopped_at if self.stopped_at is not None else self.horizon
        meta = dict(base_meta)
        meta.update(
            partial=False,
            interrupted=self.interrupted,
            stopped_at_s=stopped,
            wall_s=round(time.perf_counter() - wall0, 3),
            warnings=list(self.warnings),
            errors=self.tally.errors(),
            flush=self.flush_info,
            token_ids_returned=self.player.token_ids_returned,
            cached_reported=self.player.cached_reported,
        )
        final_meta(
            meta, tables, tally=self.tally, sessions=self.sessions, gw=self.gw, stopped=stopped,
            interrupted=self.interrupted, time_scale=self.cfg.time_scale,
        )
        self.rec.finish(meta, tables)
        return DriveResult(self.out, meta, list(self.warnings), self.interrupted)


async def drive(cfg: DriveConfig, out: str | Path, **opts: Unpack[DriveOptions]) -> DriveResult:
    """Run one driven experiment and write its records to ``out``. ``workload`` overrides the preset/trace."""
    return await Driver(cfg, out, **opts).run()
