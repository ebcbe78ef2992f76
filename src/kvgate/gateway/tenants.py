"""Tenants at the gateway: who a turn belongs to, its priority, the quota refusal, and the per-tenant books.

A tenant is the client key a request carries (``key-N``, N its place among ``--api-key``), or the value of the
header ``--tenant-header`` names when the request has it (the header is trusted: set it in a proxy in front).
With any tenant option the gateway's policy is :class:`~kvgate.policy.FairPolicy` (:meth:`GatewayConfig.tenancy`):
each tenant's share of the budget by weight, re-admission ordered by the tokens each has been served, priority
bands (``--tenant-priority``, or per request ``--priority-header``), token quotas per window (``--tenant-quota``),
reserved at the turn's boundary from d_s and settled from its usage; a turn over its tenant's quota is answered
429 with ``Retry-After``. Without any, the policy is the plain core, as before tenants.

Metrics keep bounded cardinality: the tenants the options name and the first :data:`NAMED_MAX` others seen have
series of their own; every other tenant counts under ``other`` (a tenant never moves between the two, so every
series stays monotonic). The policy's per-tenant numbers (sessions in the system, held, D_t, quota used) are read
at scrape time and summed under the same labels. The dashboard shows fewer rows still: the top
:data:`kvgate.gateway.dashboard.TOP_TENANTS` by admitted tokens, the rest summed under ``other``.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import click

from kvgate.errors import ClientError, PolicyRefusal, UsageError
from kvgate.gateway.windows import UsageWindows
from kvgate.http.openai import SESSION_HEADER
from kvgate.policy import Tenancy

DEFAULT_TENANT = "default"
"""The tenant of a request that carries no key and no tenant header (the metrics' label for it)."""
OTHER = "other"
"""The metrics' label of the tenants past :data:`NAMED_MAX`."""
NAMED_MAX = 16
"""Tenants seen at run time that get series of their own (beside those the options name)."""
PRIORITY_HEADER = "X-Kvgate-Priority"
TENANT_MAX_LEN = 64
"""A tenant header's value is cut to this many characters."""


class OverQuota(PolicyRefusal):
    """The turn would take its tenant's tokens in the current window over its quota (429, with Retry-After)."""

    http_status = 429

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def key_tenant(client: int) -> str:
    """The tenant name of client key number ``client``."""
    return f"key-{client}"


def keyed_tenancy(t: Tenancy, api_keys: tuple[str, ...]) -> Tenancy:
    """``t`` with every tenant named by an API key itself renamed to the key's tenant name (``key-N``): an operator
    may write ``--tenant-weight sk-abc=3``; logs and metrics never show the key."""
    names = {k: key_tenant(i) for i, k in enumerate(api_keys)}

    def rename(m: Any) -> dict[Hashable, Any]:
        return {names.get(k, k): v for k, v in m.items()}

    return Tenancy(weights=rename(t.weights), default_weight=t.default_weight, priorities=rename(t.priorities),
                   default_priority=t.default_priority, quotas=rename(t.quotas), default_quota=t.default_quota,
                   window_s=t.window_s, starve_after=t.starve_after)


class TenantOf:
    """A request's tenant and priority, as the options say to read them."""

    def __init__(self, tenant_header: str | None, priority_header: str, fair: bool) -> None:
        self.header = tenant_header
        self.priority_header = priority_header
        self.fair = fair
        """Tenancy is on: tenants and priorities are read (off: every turn's tenant is None, as before tenants)."""

    def of(self, headers: Any, client: int | None) -> tuple[str | None, int | None]:
        """``(tenant, priority)`` of a request; ``(None, None)`` without tenancy. Raises ClientError for a
        priority header that is not an integer."""
        if not self.fair:
            return None, None
        tenant = None
        if self.header is not None:
            v = headers.get(self.header, "").strip()
            tenant = v[:TENANT_MAX_LEN] or None
        if tenant is None:
            tenant = key_tenant(client) if client is not None else DEFAULT_TENANT
        raw = headers.get(self.priority_header, "").strip()
        if not raw:
            return tenant, None
        try:
            return tenant, int(raw)
        except ValueError:
            raise ClientError(f"{self.priority_header}: expected an integer priority, got {raw[:40]!r}") from None


@dataclass
class TenantRow:
    """What the gateway counted for one tenant (or for ``other``)."""

    turns: int = 0
    """Turns sent upstream."""
    tokens: int = 0
    """Their demand when admitted (prompt estimate + output budget): the tokens the policy let through."""
    held: int = 0
    """Turns the policy held before sending."""
    held_s: float = 0.0
    """Gateway seconds those turns were held."""
    over_quota: int = 0
    """Turns refused over quota (429)."""
    usage: int = 0
    """Prompt + completion tokens of the answered turns, as the engine reported them."""
    prompt_c: int = 0
    """Prompt tokens of the agent turns that reported cached tokens (the hit ratio's denominator, as the
    gateway's: no one-turn requests, no broken prefixes)."""
    cached: int = 0
    """Their cached tokens."""
    recent: UsageWindows = field(default_factory=UsageWindows)
    """The same over the last 5 minutes."""


POLICY_FIELDS = ("sessions", "parked", "waiting", "demand", "limited", "quota", "used")
"""What the policy counts per tenant (:meth:`kvgate.policy.FairPolicy.tenant_stats`) that the books show:
sessions in the system, held (parked, waiting), D_t, whether it has a quota (summed: how many do), the quota and
its use in the current window."""
PolicyStats = Mapping[Hashable, Mapping[str, Any]]
"""One policy's ``tenant_stats()``."""


@dataclass
class TenantBook:
    """The per-tenant counters, bounded (see the module docstring)."""

    named: set[str] = field(default_factory=set)
    rows: dict[str, TenantRow] = field(default_factory=dict)
    others: int = 0
    """Tenants seen that the options do not name and that have rows of their own."""
    window_s: float = 60.0
    """The quota window (the policy's)."""

    @classmethod
    def of(cls, tenancy: Tenancy | None) -> TenantBook | None:
        if tenancy is None:
            return None
        names = {str(k) for m in (tenancy.weights, tenancy.priorities, tenancy.quotas) for k in m}
        return cls(named=names, window_s=tenancy.window_s)

    def label(self, tenant: Hashable) -> str:
        """The row ``tenant`` counts under: its own, or ``other`` (a tenant the policy knows before the gateway counted
        anything of it gets its row here, under the same bound)."""
        name = DEFAULT_TENANT if tenant is None else str(tenant)
        if name not in self.rows and name not in self.named:
            self.row(name)
        return name if name in self.rows or name in self.named else OTHER

    def policy_rows(self, stats: Iterable[PolicyStats], now: float) -> dict[str, dict[str, int]]:
        """The policies' per-tenant numbers (:data:`POLICY_FIELDS`; one mapping per policy, summed) by row label;
        ``used`` counts only the current quota window, ``quota`` is the summed budgets of the ``limited`` ones."""
        window = math.floor(now / self.window_s)
        out: dict[str, dict[str, int]] = {}
        for per_tenant in stats:
            for key, st in per_tenant.items():
                row = out.get(lab := self.label(key))
                if row is None:
                    row = out[lab] = dict.fromkeys(POLICY_FIELDS, 0)
                for k in ("sessions", "parked", "waiting", "demand"):
                    row[k] += int(st[k])
                if st["quota"] is not None:
                    row["limited"] += 1
                    row["quota"] += st["quota"]
                    row["used"] += int(st["used"]) if st["window"] == window else 0
        return out

    def row(self, tenant: str | None) -> TenantRow:
        name = DEFAULT_TENANT if tenant is None else tenant
        got = self.rows.get(name)
        if got is not None:
            return got
        if name not in self.named:
            if self.others >= NAMED_MAX:
                return self.rows.setdefault(OTHER, TenantRow())
            self.others += 1
        got = self.rows[name] = TenantRow()
        return got

    def sent(self, tenant: str | None, demand: int, held_s: float | None) -> None:
        r = self.row(tenant)
        r.turns += 1
        r.tokens += demand
        if held_s is not None:
            r.held += 1
            r.held_s += held_s

    def table(self) -> list[dict[str, Any]]:
        """Every row, the most tokens first (the gateway's counters; :func:`kvgate.gateway.dashboard.tenant_rows`
        adds the policy's and bounds them)."""
        rows = sorted(self.rows.items(), key=lambda kv: (-kv[1].tokens, kv[0]))
        return [{"tenant": k, "turns": r.turns, "tokens": r.tokens, "held": r.held, "held_s": round(r.held_s, 3),
                 "over_quota": r.over_quota, "usage_tokens": r.usage, "agent_prompt_tokens": r.prompt_c,
                 "cached_tokens": r.cached} for k, r in rows]

    def hit(self, tenant: str | None, now: float, prompt: int, cached: int | None) -> None:
        """An agent turn of ``tenant`` finished with ``prompt`` tokens, ``cached`` of them cached (None: not told)."""
        r = self.row(tenant)
        r.recent.add(now, prompt, cached)
        if cached is not None:
            r.prompt_c += prompt
            r.cached += cached


# -- options -----------------------------------------------------------------------------------------------------
_WINDOW = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|h)?\s*$")


def parse_window(text: str) -> float:
    """``60``, ``60s``, ``5m``, ``1h`` -> seconds; UsageError otherwise."""
    m = _WINDOW.match(text)
    if not m or not float(m.group(1)) > 0:
        raise UsageError(f"--tenant-quota: window {text!r}: expected seconds, or a number with s, m or h")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]


def parse_quotas(items: Iterable[str]) -> tuple[str, float | None]:
    """``--tenant-quota KEY=TOKENS[/WINDOW]`` (repeatable, or comma-separated) -> ``("KEY=TOKENS,...", window_s)``;
    every quota shares one window (None: none given)."""
    parts, windows = [], set()
    for item in items:
        for part in filter(None, (p.strip() for p in item.split(","))):
            spec, slash, window = part.partition("/")
            if slash:
                windows.add(parse_window(window))
            parts.append(spec)
    if len(windows) > 1:
        raise UsageError("--tenant-quota: every quota shares one window; give the same /WINDOW to each")
    return ",".join(parts), (windows.pop() if windows else None)


TENANT_OPTIONS = [
    click.option("--fair-share", is_flag=True, help="Share the budget across tenants by weight, re-admitting by "
                 "tokens served (docs/policy.md); implied by any other tenant option."),
    click.option("--tenant-header", metavar="NAME", help="The request header naming the tenant [default: the "
                 "client key of --api-key]."),
    click.option("--tenant-weight", "tenant_weight", multiple=True, metavar="KEY=W[,...]",
                 help="A tenant's weight (its share of the budget) [default: 1 each]."),
    click.option("--tenant-priority", "tenant_priority", multiple=True, metavar="KEY=P[,...]",
                 help="A tenant's priority band, higher served first [default: 0]."),
    click.option("--priority-header", default=PRIORITY_HEADER, show_default=True, metavar="NAME",
                 help="The request header giving a turn's priority band (an integer)."),
    click.option("--tenant-quota", "tenant_quota", multiple=True, metavar="KEY=TOKENS[/WINDOW][,...]",
                 help="A tenant's token quota per window (e.g. 500000/1m; one window for all) [default: none]; "
                 "beyond it 429."),
    click.option("--otlp-endpoint", metavar="URL", help="Export a span per turn over OTLP/HTTP to URL, e.g. "
                 "http://127.0.0.1:4318/v1/traces (needs the 'otel' extra)."),
]
"""The gateway's tenant and trace options (``kvgate gateway``)."""


def tenant_fields(fair_share: bool, tenant_header: str | None, tenant_weight: tuple[str, ...],
                  tenant_priority: tuple[str, ...], priority_header: str, tenant_quota: tuple[str, ...],
                  otlp_endpoint: str | None) -> dict[str, Any]:
    """The :class:`~kvgate.gateway.config.GatewayConfig` fields of :data:`TENANT_OPTIONS`."""
    quotas, window = parse_quotas(tenant_quota)
    out: dict[str, Any] = {
        "fair_share": fair_share, "tenant_header": tenant_header or None, "tenant_weights": ",".join(tenant_weight),
        "tenant_priorities": ",".join(tenant_priority), "priority_header": priority_header,
        "tenant_quotas": quotas, "otlp_endpoint": otlp_endpoint or None,
    }
    if window is not None:
        out["quota_window_s"] = window
    return out


def retry_after(seconds_real: float) -> str:
    """A Retry-After value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds_real)))


def over_quota(s: Any, d: Any) -> OverQuota:
    """The refusal of session ``s``'s turn by the policy's ``OverQuota`` decision ``d`` (gateway seconds)."""
    return OverQuota(f"tenant {s.tenant or DEFAULT_TENANT!r} is over its token quota for this window; retry in "
                     f"{d.retry_after_s:.0f} s", d.retry_after_s)


class Tenants:
    """The request path's tenant side (:class:`kvgate.gateway.turns.TurnPath` calls it): a request's tenant and
    priority, the per-tenant counters, the quota refusal's headers, and the turn's trace
    (:class:`kvgate.gateway.tracing.TurnTraces`, with ``--otlp-endpoint``)."""

    def __init__(self, tenancy: Tenancy | None, cfg: Any) -> None:
        self.reader = TenantOf(cfg.tenant_header, cfg.priority_header, tenancy is not None)
        self.book = TenantBook.of(tenancy)
        """The per-tenant counters (None without tenancy)."""
        self.time_scale = cfg.time_scale
        self.traces: Any = None
        if cfg.otlp_endpoint is not None:
            from kvgate.gateway.tracing import TurnTraces

            self.traces = TurnTraces(cfg.otlp_endpoint, cfg.time_scale)

    def of(self, headers: Any, client: int | None) -> tuple[str | None, int | None, int]:
        """``(tenant, priority, arrival)`` of a request (:meth:`TenantOf.of`; arrival: wall-clock ns, 0 untraced)."""
        return (*self.reader.of(headers, client), 0 if self.traces is None else time.time_ns())

    def bind(self, s: Any, who: tuple[str | None, int | None, int]) -> None:
        """Session ``s`` holds the turn of the request ``who`` was read from."""
        s.tenant, s.priority = who[0], who[1]
        if self.traces is not None:
            self.traces.arrived(s.sid, who[2])

    def sent(self, s: Any, now: float, t_req: float, hold: str, lineage: str) -> list[tuple[str, str]] | None:
        """Session ``s``'s turn goes upstream at ``now``, asked at ``t_req`` (gateway times), ``hold`` what the
        policy did; the headers to send upstream: a named session's id and, traced, ``traceparent``."""
        up = None if s.anonymous else [(SESSION_HEADER, str(s.sid))]
        if self.book is not None:
            self.book.sent(s.tenant, s.demand, now - t_req if hold != "none" else None)
        if self.traces is None:
            return up
        return (up or []) + self.traces.sent(s, now, t_req, hold, lineage)

    def marks(self, s: Any) -> list[int] | None:
        """What the relay fills in for the trace of ``s``'s upstream call (None: not traced)."""
        return None if self.traces is None else self.traces.marks(s)

    def ended(self, s: Any, outcome: str | None) -> None:
        if self.traces is not None:
            self.traces.ended(s, outcome)

    def close(self) -> None:
        if self.traces is not None:
            self.traces.close()

    def answered(self, s: Any, prompt: int, completion: int) -> None:
        if self.book is not None:
            self.book.row(s.tenant).usage += prompt + completion

    def hit(self, s: Any, now: float, prompt: int, cached: int | None, windows: UsageWindows) -> None:
        """``s``'s agent turn counts in the gateway's hit ratio (``windows``) and in its tenant's."""
        windows.add(now, prompt, cached)
        if self.book is not None:
            self.book.hit(s.tenant, now, prompt, cached)

    def refusal(self, s: Any, e: Exception) -> list[tuple[str, str]] | None:
        """The headers of a refusal: ``Retry-After`` (real seconds) for a turn over quota, counted on its tenant."""
        if not isinstance(e, OverQuota):
            return None
        if self.book is not None:
            self.book.row(s.tenant).over_quota += 1
        return [("Retry-After", retry_after(e.retry_after_s / self.time_scale))]


def policy_stats(fleet: Any) -> list[PolicyStats]:
    """The per-tenant numbers of each distinct fair policy of ``fleet`` (its replicas', or the shared one)."""
    seen: dict[int, PolicyStats] = {}
    for r in fleet.replicas:
        p = r.policy
        if p is not None and id(p) not in seen and hasattr(p, "tenant_stats"):
            seen[id(p)] = p.tenant_stats()
    return list(seen.values())


TENANT_GAUGES = (
    ("kvgate_tenant_sessions", "sessions", "Sessions in the system (admitted or held), per tenant."),
    ("kvgate_tenant_sessions_parked", "parked", "Sessions parked at a turn boundary, per tenant."),
    ("kvgate_tenant_sessions_waiting", "waiting", "New sessions waiting for admission, per tenant."),
    ("kvgate_tenant_demand_tokens", "demand", "D_t: the resident demand of the tenant's admitted sessions."),
    ("kvgate_tenant_quota_used_tokens", "used", "Tokens reserved or used of the tenant's quota in the current "
     "window (tenants with a quota)."),
)


def tenant_families(book: TenantBook | None, fleet: Any = None, now: float = 0.0) -> Iterable[Any]:
    """The per-tenant series of ``/metrics`` (nothing without tenancy): ``kvgate_tenant_*{tenant}``; with
    ``fleet``, its policies' gauges too (at gateway time ``now``)."""
    if book is None:
        return
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, doc, attr in (
        ("kvgate_tenant_turns", "Turns sent upstream, per tenant (bounded: the named and first ones, else other).",
         "turns"),
        ("kvgate_tenant_admitted_tokens", "Demand of the turns the policy let through (d_s), per tenant.", "tokens"),
        ("kvgate_tenant_held_turns", "Turns the policy held before sending, per tenant.", "held"),
        ("kvgate_tenant_held_seconds", "Gateway seconds turns were held, per tenant.", "held_s"),
        ("kvgate_tenant_over_quota", "Turns refused over the tenant's quota (429).", "over_quota"),
        ("kvgate_tenant_usage_tokens", "Prompt + completion tokens the engine reported, per tenant.", "usage"),
        ("kvgate_tenant_agent_prompt_tokens", "Prompt tokens of agent turns that reported cached tokens, per tenant "
         "(the hit ratio's denominator).", "prompt_c"),
        ("kvgate_tenant_agent_cached_tokens", "Cached tokens of those turns, per tenant.", "cached"),
    ):
        fam = CounterMetricFamily(name, doc, labels=["tenant"])
        for tenant, row in book.rows.items():
            fam.add_metric([tenant], float(getattr(row, attr)))
        yield fam
    if fleet is None:
        return
    rows = book.policy_rows(policy_stats(fleet), now)
    for name, key, doc in TENANT_GAUGES:
        g = GaugeMetricFamily(name, doc, labels=["tenant"])
        for tenant, r in rows.items():
            if key != "used" or r["limited"]:
                g.add_metric([tenant], float(r[key]))
        yield g
