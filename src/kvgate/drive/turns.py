"""One session's turns over HTTP: the closed loop of :mod:`kvgate.workload.session`, one asyncio task per session.

Session life cycle (closed loop, the simulator's: :class:`kvgate.workload.session.Sessions` says what happens
next, this module makes it happen on the run's clock)::

    arrive ─▶ turn 0 ─▶ think ─▶ turn 1 ─▶ ... ─▶ last turn (X-Session-End: true) ─▶ done
                 ├─ failed (4xx, or retries exhausted) ─▶ abandoned: the session leaves, its end_s stays null
                 └─ the agent's timeout ─▶ backoff ─▶ the same turn again ... ─▶ out of retries: the agent gives up

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvgate.drive.conversation import ConvoPrompt
from kvgate.drive.prompts import TokenPrompt
from kvgate.http.dialect import APIS, SGLANG, VLLM
from kvgate.records import TurnRow
from kvgate.workload.session import Session, Sessions, Turn

if TYPE_CHECKING:
    from kvgate.drive.client import Client, ServerInfo
    from kvgate.drive.config import DriveConfig
    from kvgate.drive.gateway_log import GatewayLog
    from kvgate.drive.prompts import RequestHead, Vocab
    from kvgate.drive.replies import AttemptError, Reply
    from kvgate.drive.status import DriveLog
    from kvgate.drive.tally import Tally
    from kvgate.http.clock import Clock
    from kvgate.records import Recorder


@dataclass(eq=False)
class DrivenSession(Session):
    """A session of the loop with what the driver keeps beside it: its prompt so far, when its last turn ended,
    and its task."""

    prompt: TokenPrompt | ConvoPrompt = field(kw_only=True)
    task: asyncio.Task[None] | None = None


class DriveRun(Protocol):
    """What the sessions' tasks share of the run (:class:`kvgate.drive.driver.Driver` is one)."""

    cfg: DriveConfig
    sessions: Sessions
    clock: Clock
    client: Client
    info: ServerInfo
    rec: Recorder
    tally: Tally
    log: DriveLog
    gw: GatewayLog | None
    vocab: Vocab
    head: RequestHead
    slots: asyncio.Semaphore
    horizon: float
    stopped_at: float | None
    running: int
    """Turns in flight (the samples' ``running``)."""


class TurnPlayer:
    """Plays sessions' turns against the driver's client, records every turn and attempt, keeps the demand."""

    def __init__(self, d: DriveRun) -> None:
        self.d = d
        self.cfg = d.cfg
        self.api = APIS[d.cfg.api]
        self.path = self.api.path
        self.token_ids_returned: bool | None = None
        self.cached_reported: bool | None = None

    async def play(self, s: DrivenSession) -> None:
        """The session's life from its arrival: each turn at its time, until it ends, fails or the run stops."""
        d = self.d
        turn = d.sessions.request(s)
        due = s.spec.arrival_s
        body = s.prompt.body(d.head.text(turn.output_tokens, s.spec.sid))
        while True:
            end = await self.turn(s, turn, due, body)
            if end is None:
                d.sessions.leave(s)  # failed, or the agent gave up
                break
            think = d.sessions.finish(s, end)
            if think is None:
                break  # that was its last turn: it ended
            due = end + think
            if due >= d.horizon:
                return  # still thinking when the run ends: in the system, unfinished
            # built before the deadline, not after it
            body = s.prompt.body(d.head.text(s.current().output_tokens, s.spec.sid))
            await d.clock.sleep_until(due)
            turn = d.sessions.request(s)
        self.session_row(s)

    def session_row(self, s: DrivenSession) -> None:
        self.d.rec.session(s.row())

    # -- one turn -------------------------------------------------------------------------------------------------
    async def turn(self, s: DrivenSession, turn: Turn, due: float, body: bytes) -> float | None:
        """Play ``turn`` of ``s`` (scheduled at virtual ``due``); its end, or None when it failed (or the agent gave
        up) and the session ends."""
        d, cfg, tally = self.d, self.cfg, self.d.tally
        k = turn.index
        headers = {}
        if cfg.session_id == "header":  # (none: the session is the conversation's, as agents that name nothing)
            headers[cfg.session_header] = str(s.spec.sid)
            if turn.last:
                headers[cfg.session_end_header] = "true"
        async with d.slots:
            sent = d.clock.now()
            lag = sent - due
            if d.gw is None:
                s.mark_sent(sent)
            d.running += 1
            try:
                if cfg.client_timeout_s is None:
                    reply = await d.client.turn(
                        self.path, body, headers, stream=cfg.stream, api=self.api,
                        on_error=lambda e, attempt, again: self.attempt_failed(s, k, e, attempt, again),
                    )
                else:
                    got = await self.agent_attempts(s, k, due, lag, body, headers)
                    if got is None:  # out of retries: the agent gave up its session
                        return None
                    reply = got
            except asyncio.CancelledError:
                if cfg.client_timeout_s is None:  # (with the agent's timeout, agent_attempts records its attempts)
                    self.aborted_at_end(s, k, due, sent, lag)
                raise
            finally:
                d.running -= 1
        end = d.clock.now()
        tally.lags_ms.append(lag / cfg.time_scale * 1000.0)
        if end > d.horizon:  # finished after the run's end (the horizon timer is due): as the simulator, not done
            tally.turns_aborted += 1
            self.turn_row(s, k, due, sent, lag, d.horizon, s.prompt.n, None, 0, "aborted", None)
            return None
        if not reply.ok:
            tally.turns_error += 1
            s.mark_sent(sent)
            extra = {"error": reply.error, "http_status": reply.http_status, "attempts": reply.attempts}
            self.turn_row(s, k, due, sent, lag, end, s.prompt.n, None, 0, "error", None, extra)
            return None
        wait = math.nan
        left = sent  # when the turn left the gateway (the driver's send without one)
        if d.gw is not None and reply.park_wait_s is not None:
            wait = d.gw.wait_s(reply.park_wait_s)
            left = min(sent + wait, end)
            d.gw.turn(left, reply.hold, reply.control)
        s.mark_sent(left)
        cached = self.cached(reply)
        prompt_tokens = reply.prompt_tokens if reply.prompt_tokens is not None else s.prompt.n
        ids_sent = isinstance(s.prompt, TokenPrompt)
        if ids_sent and reply.prompt_tokens is not None and reply.prompt_tokens != s.prompt.n:
            d.log.warn_once(
                "prompt-count",
                f"the server counted {reply.prompt_tokens} prompt tokens where the driver sent {s.prompt.n} "
                "token ids (it may add special tokens); records keep the server's count",
            )
        out_ids = reply.token_ids
        n_got = (
            reply.completion_tokens if reply.completion_tokens is not None else len(out_ids or ()) or turn.output_tokens
        )
        first = None if reply.first_token_at is None else d.clock.virtual(reply.first_token_at)
        self.turn_row(s, k, due, left, lag, end, prompt_tokens, cached, n_got, "ok", first, wait=wait)
        tally.turn_done(end, prompt_tokens, cached)
        if not turn.last:
            self.extend(s, k, reply, n_got)
        return end

    async def agent_attempts(
        self, s: DrivenSession, k: int, due: float, lag: float, body: bytes, headers: dict[str, str]
    ) -> Reply | None:
        """Turn ``k`` with the agent's timeout and retries (the simulator's, :meth:`Sessions.timed_out`); None
        when the agent gave up its session."""
        d, cfg = self.d, self.cfg
        assert cfg.client_timeout_s is not None

        def hook(e: AttemptError, attempt: int, again: bool) -> None:
            if e.http_status != 409:  # 409: an attempt replaced by its retry in the gateway (expected)
                self.attempt_failed(s, k, e, attempt, again)

        def send() -> asyncio.Task[Reply]:
            coro = d.client.turn(self.path, body, headers, stream=cfg.stream, on_error=hook, api=self.api)
            return asyncio.get_running_loop().create_task(coro)

        task = send()
        stale: list[asyncio.Task[Reply]] = []
        t_sent = d.clock.now()
        in_flight = True  # an attempt is out and has no row yet (none while backing off, or once the agent gave up)
        try:
            try:
                while True:
                    t_sent, in_flight = d.clock.now(), True
                    done, _ = await asyncio.wait({task}, timeout=cfg.client_timeout_s / cfg.time_scale)
                    if done:
                        return task.result()
                    now = d.clock.now()
                    attempt = s.attempt
                    self.turn_row(s, k, due, t_sent, lag, now, s.prompt.n, None, 0, "aborted", None,
                                  {"attempt": attempt})
                    in_flight = False
                    if d.gw is None or attempt >= d.sessions.retries.retries or cfg.session_id == "none":
                        task.cancel()  # the client disconnects: the engine (or the gateway) aborts the attempt
                    else:
                        stale.append(task)  # kept open: its retry replaces it in the gateway
                    backoff = d.sessions.timed_out(s)
                    if backoff is None:
                        return None
                    await d.clock.sleep_until(now + backoff)
                    d.sessions.retry(s)
                    task = send()
            finally:
                pending = [t for t in (task, *stale) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
        except asyncio.CancelledError:
            # the run ended: the attempt still without a row is aborted (a timed-out attempt has its row already;
            # backing off, or once the agent gave up, there is none)
            if in_flight:
                self.aborted_at_end(s, k, due, t_sent, lag, {"attempt": s.attempt})
            raise

    def aborted_at_end(
        self, s: DrivenSession, k: int, due: float, sent: float, lag: float, extra: dict[str, Any] | None = None
    ) -> None:
        """The row of turn ``k``'s attempt cut by the end of the run (or by a stop)."""
        d = self.d
        d.tally.turns_aborted += 1
        end = d.stopped_at if d.stopped_at is not None else d.clock.now()
        self.turn_row(s, k, due, sent, lag, end, s.prompt.n, None, 0, "aborted", None, extra)

    def extend(self, s: DrivenSession, k: int, reply: Reply, n_got: int) -> None:
        """Grow the prompt for turn k+1: + this turn's output + the appended tokens."""
        vocab = self.d.vocab
        shape = s.spec.shape
        key = f"{vocab.key(s.spec.sid)}/turn{k}"
        if isinstance(s.prompt, ConvoPrompt):
            n_app = shape.appends[k]
            s.prompt.extend(k, reply, n_got, vocab.words(f"{key}/append", max(1, n_app)), max(1, n_app))
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
        if reply.usage is not None:
            got = self.d.info.engine.cached(reply.usage)  # the engine's quirks: SGLang reporting omits a 0
            if got is not None:
                return got
        if self.cached_reported is None:
            self.cached_reported = False
        self.d.log.warn_once(
            "cached",
            "the endpoint does not report cached prompt tokens (usage.prompt_tokens_details.cached_tokens); "
            f"recording them as null (unknown). Start vLLM with {VLLM.report_flag} or SGLang with "
            f"{SGLANG.report_flag}",
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
        row = TurnRow(
            s.spec.sid, s.spec.cohort, k, due, sent, nan, nan if first is None else first, end, prompt_tokens, cached,
            output_tokens, wait, None, status, lag,
        )
        self.d.rec.turn(row, extra)

    def attempt_failed(self, s: DrivenSession, k: int, e: AttemptError, attempt: int, again: bool) -> None:
        d = self.d
        where = f"session {s.spec.sid} turn {k}"
        n = d.tally.attempt_failed(e.kind, where, e.text)
        d.rec.error(
            {
                "t_s": round(d.clock.now(), 6), "session": s.spec.sid, "turn": k, "attempt": attempt, "retry": again,
                "kind": e.kind, "http_status": e.http_status, "error": e.text,
            }
        )
        if n <= 3 or n % 1000 == 0:
            what = "retrying" if again else "turn failed"
            d.log(f"{where} attempt {attempt}: {e.text} ({what}; {n} {e.kind} errors so far)")
