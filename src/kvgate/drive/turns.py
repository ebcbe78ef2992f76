"""One session's turns over HTTP: the closed loop of the driver, one asyncio task per session.

Session life cycle (closed loop, as in ``sim/runner.py``)::

    arrive ─▶ turn 0 ─▶ think ─▶ turn 1 ─▶ ... ─▶ last turn (X-Session-End: true) ─▶ done
                 └─ failed (4xx, or retries exhausted) ─▶ abandoned: the session leaves, its end_s stays null

After each turn the session sleeps until ``end of turn + think time``, an absolute deadline on the run's clock, so
timing errors never accumulate. The schedule lag of every turn (actual send - scheduled send, virtual seconds) is
recorded in ``lag_s``.

With ``--api completions`` the output part of the next prompt is the completion's own token ids
(``return_token_ids``, vLLM >= 0.10.2); a server that does not return them gets stand-in ids (one warning), so its
cache then matches up to the end of the previous prompt only. The appended part is sized so that prompt lengths
follow the shape exactly (``prompt_tokens()[k]``) even if an output comes back short.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvgate.drive.prompts import ChatPrompt, TokenPrompt

if TYPE_CHECKING:
    from kvgate.drive.driver import Driver
    from kvgate.drive.replies import AttemptError, Reply
    from kvgate.workload.arrivals import SessionSpec

SESSION_END_HEADER = "X-Session-End"


@dataclass(eq=False, slots=True)
class DrivenSession:
    """A session in the driven run: its draw, its prompt so far, and what the records need."""

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


class TurnPlayer:
    """Plays sessions' turns against the driver's client, records every turn and attempt, keeps the demand."""

    def __init__(self, d: Driver) -> None:
        self.d = d
        self.cfg = d.cfg
        self.path = "/v1/completions" if d.cfg.api == "completions" else "/v1/chat/completions"
        self.token_ids_returned: bool | None = None
        self.cached_reported: bool | None = None

    async def play(self, s: DrivenSession) -> None:
        d, spec = self.d, s.spec
        due = spec.arrival_s
        for k in range(spec.shape.turns):
            body = s.prompt.body(d.head.text(spec.shape.outputs[k]))  # built before the deadline, not after it
            if k:
                due = s.last_end + spec.think_s[k - 1]
                if due >= d.horizon:
                    return  # still thinking when the run ends: in the system, unfinished
                await d.clock.sleep_until(due)
            if not await self.turn(s, k, due, body):
                self.leave(s, finished=False)
                return
        self.leave(s, finished=True)

    def leave(self, s: DrivenSession, *, finished: bool) -> None:
        d = self.d
        now = d.clock.now()
        s.left = True
        d.in_system -= 1
        d.demand_total -= s.demand
        s.demand = 0
        if finished:
            s.end = now
        self.session_row(s)

    def session_row(self, s: DrivenSession) -> None:
        sp = s.spec
        self.d.rec.add(
            "sessions",
            (
                sp.sid, sp.cohort, sp.arrival_s, None if math.isnan(s.end) else s.end, sp.shape.turns,
                s.turns_done, None if math.isnan(s.first_sent) else s.first_sent, sp.shape.source,
            ),
        )  # fmt: skip

    # -- one turn -------------------------------------------------------------------------------------------------
    async def turn(self, s: DrivenSession, k: int, due: float, body: bytes) -> bool:
        """Play turn ``k`` of ``s`` (scheduled at virtual ``due``); False when it failed and the session ends."""
        d, cfg, tally = self.d, self.cfg, self.d.tally
        shape = s.spec.shape
        n_out = shape.outputs[k]
        demand = s.prompts[k] + n_out  # as the simulator: this turn's prompt plus its output budget
        d.demand_total += demand - s.demand
        s.demand = demand
        last = k == shape.turns - 1
        headers = {cfg.session_header: str(s.spec.sid)}
        if last:
            headers[SESSION_END_HEADER] = "true"
        async with d.slots:
            sent = d.clock.now()
            lag = sent - due
            if math.isnan(s.first_sent) and d.gw is None:
                s.first_sent = sent
            d.running += 1
            try:
                if cfg.client_timeout_s is None:
                    reply = await d.client.turn(
                        self.path, body, headers, stream=cfg.stream,
                        on_error=lambda e, attempt, again: self.attempt_failed(s, k, e, attempt, again),
                    )  # fmt: skip
                else:
                    got = await self.agent_attempts(s, k, due, lag, body, headers)
                    if got is None:  # out of retries: the agent gives up its session
                        return False
                    reply = got
            except asyncio.CancelledError:
                tally.turns_aborted += 1
                end = d.stopped_at if d.stopped_at is not None else d.clock.now()
                self.turn_row(s, k, due, sent, lag, end, s.prompt.n, None, 0, "aborted", None)
                raise
            finally:
                d.running -= 1
        end = d.clock.now()
        tally.lags_ms.append(lag / cfg.time_scale * 1000.0)
        if end > d.horizon:  # finished after the run's end (the horizon timer is due): as the simulator, not done
            tally.turns_aborted += 1
            self.turn_row(s, k, due, sent, lag, d.horizon, s.prompt.n, None, 0, "aborted", None)
            return False
        if not reply.ok:
            tally.turns_error += 1
            if math.isnan(s.first_sent):
                s.first_sent = sent
            extra = {"error": reply.error, "http_status": reply.http_status, "attempts": reply.attempts}
            self.turn_row(s, k, due, sent, lag, end, s.prompt.n, None, 0, "error", None, extra)
            return False
        wait = math.nan
        left = sent  # when the turn left the gateway (the driver's send without one)
        if d.gw is not None and reply.park_wait_s is not None:
            wait = d.gw.wait_s(reply.park_wait_s)
            left = min(sent + wait, end)
            d.gw.turn(left, reply.hold, reply.control)
        if math.isnan(s.first_sent):
            s.first_sent = left
        cached = self.cached(reply)
        prompt_tokens = reply.prompt_tokens if reply.prompt_tokens is not None else s.prompt.n
        if cfg.api == "completions" and reply.prompt_tokens is not None and reply.prompt_tokens != s.prompt.n:
            d.log.warn_once(
                "prompt-count",
                f"the server counted {reply.prompt_tokens} prompt tokens where the driver sent {s.prompt.n} "
                "token ids (it may add special tokens); records keep the server's count",
            )
        out_ids = reply.token_ids
        n_got = reply.completion_tokens if reply.completion_tokens is not None else len(out_ids or ()) or n_out
        first = None if reply.first_token_at is None else d.clock.virtual(reply.first_token_at)
        self.turn_row(s, k, due, left, lag, end, prompt_tokens, cached, n_got, "ok", first, wait=wait)
        tally.turn_done(end, prompt_tokens, cached)
        s.turns_done = k + 1
        s.last_end = end
        if not last:
            self.extend(s, k, reply, n_got)
        return True

    async def agent_attempts(
        self, s: DrivenSession, k: int, due: float, lag: float, body: bytes, headers: dict[str, str]
    ) -> Reply | None:
        """Turn ``k`` with the agent's timeout and retries (the simulator's semantics); None when it gave up."""
        d, cfg, tally = self.d, self.cfg, self.d.tally
        assert cfg.client_timeout_s is not None

        def hook(e: AttemptError, attempt: int, again: bool) -> None:
            if e.http_status != 409:  # 409: an attempt replaced by its retry in the gateway (expected)
                self.attempt_failed(s, k, e, attempt, again)

        def send() -> asyncio.Task[Reply]:
            coro = d.client.turn(self.path, body, headers, stream=cfg.stream, on_error=hook)
            return asyncio.get_running_loop().create_task(coro)

        attempt = 0
        task = send()
        stale: list[asyncio.Task[Reply]] = []
        try:
            while True:
                t_sent = d.clock.now()
                done, _ = await asyncio.wait({task}, timeout=cfg.client_timeout_s / cfg.time_scale)
                if done:
                    return task.result()
                tally.client_timeouts += 1
                now = d.clock.now()
                self.turn_row(s, k, due, t_sent, lag, now, s.prompt.n, None, 0, "aborted", None, {"attempt": attempt})
                if d.gw is None or attempt >= cfg.client_retries:
                    task.cancel()  # the client disconnects: the engine (or the gateway) aborts the attempt
                else:
                    stale.append(task)  # kept open: its retry replaces it in the gateway
                if attempt >= cfg.client_retries:
                    tally.sessions_abandoned += 1
                    return None
                attempt += 1
                u = float(np.random.default_rng([cfg.seed, 4, s.spec.sid, k, attempt]).uniform(-1.0, 1.0))
                delay = cfg.retry_backoff_s * 2 ** (attempt - 1) * (1.0 + cfg.retry_jitter * u)
                await d.clock.sleep_until(now + delay)
                tally.client_retries_sent += 1
                task = send()
        finally:
            pending = [t for t in (task, *stale) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    def extend(self, s: DrivenSession, k: int, reply: Reply, n_got: int) -> None:
        """Grow the prompt for turn k+1: + this turn's output + the appended tokens."""
        vocab = self.d.vocab
        shape = s.spec.shape
        key = f"{vocab.key(s.spec.sid)}/turn{k}"
        if isinstance(s.prompt, ChatPrompt):
            n_app = shape.appends[k]
            s.prompt.extend(k, reply.text, n_got, vocab.words(f"{key}/append", max(1, n_app)), max(1, n_app))
            return
        if reply.token_ids is not None:
            self.token_ids_returned = True
            out = ",".join(map(str, reply.token_ids))
            n_out = len(reply.token_ids)
        else:
            self.token_ids_returned = False
            self.d.log.warn_once(
                "token-ids",
                "the server returned no completion token ids (vLLM >= 0.10.2 does for return_token_ids); appending "
                "stand-in ids, so each turn reuses the cache only up to the end of the previous prompt",
            )
            n_out = n_got
            out = vocab.ids(f"{key}/output", n_out)
        # NOTE: the append is sized so the next prompt has the shape's length even if the output came back short.
        n_app = max(0, s.prompts[k + 1] - s.prompt.n - n_out)
        s.prompt.extend(out, n_out, vocab.ids(f"{key}/append", n_app), n_app)

    def cached(self, reply: Reply) -> int | None:
        if reply.cached_reported:
            self.cached_reported = True
            return reply.cached_tokens
        info = self.d.info
        if info.kind == "sglang" and info.cache_report:
            return 0  # SGLang with --enable-cache-report omits the field when nothing was cached
        if self.cached_reported is None:
            self.cached_reported = False
        self.d.log.warn_once(
            "cached",
            "the endpoint does not report cached prompt tokens (usage.prompt_tokens_details.cached_tokens); "
            "recording them as null (unknown). Start vLLM with --enable-prompt-tokens-details or SGLang with "
            "--enable-cache-report",
        )
        return None

    def turn_row(
        self,
        s: DrivenSession,
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
        self.d.rec.add(
            "turns",
            (
                s.spec.sid, s.spec.cohort, k, due, sent, nan, nan if first is None else first, end,
                prompt_tokens, cached, output_tokens, wait, None, status, lag,
            ),
            extra,
        )  # fmt: skip

    def attempt_failed(self, s: DrivenSession, k: int, e: AttemptError, attempt: int, again: bool) -> None:
        d = self.d
        where = f"session {s.spec.sid} turn {k}"
        n = d.tally.attempt_failed(e.kind, where, e.text)
        d.rec.error(
            {
                "t_s": round(d.clock.now(), 6), "session": s.spec.sid, "turn": k, "attempt": attempt, "retry": again,
                "kind": e.kind, "http_status": e.http_status, "error": e.text,
            }
        )  # fmt: skip
        if n <= 3 or n % 1000 == 0:
            what = "retrying" if again else "turn failed"
            d.log(f"{where} attempt {attempt}: {e.text} ({what}; {n} {e.kind} errors so far)")
