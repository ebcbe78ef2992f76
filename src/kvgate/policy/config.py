"""The control's config: which admission control runs, from when, with which options (one config, composed by every
program that runs a policy: the simulator and the gateway)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.errors import UsageError
from kvgate.policy import CONTROLS, Control, PolicyError, Tenancy, make_control, parse_assignments, parse_control


def parse_control_opts(control: str, text: str) -> dict[str, int | float]:
    """``K=V,K=V`` for control ``control`` to a dict, typed as the control declares its options."""
    text = text.strip()
    if not text:
        return {}
    try:
        _, opts = parse_control(control + ":" + text.replace(",", ":"))
    except PolicyError as e:
        raise UsageError(f"--control-opt: {e}") from None
    return opts


@dataclass(frozen=True)
class ControlConfig:
    """The admission control: ``control`` (none, budgeter, ...), ``control_opt`` its options as ``K=V,...``."""

    control: str = "none"
    control_at: float | None = None
    """Minute the control starts; before it the gateway runs ``none``. None: from the start."""
    control_opt: str = ""
    fair_share: bool = False
    """Share C across tenants by weight (``FairPolicy``); False: one FIFO for everyone, tenants or not."""
    tenant_weights: str = ""
    """``KEY=W,...``: tenants' weights (default 1 each)."""
    tenant_priorities: str = ""
    """``KEY=P,...``: tenants' priority bands (higher first; default 0)."""
    tenant_quotas: str = ""
    """``KEY=TOKENS,...``: tenants' token budgets per quota window (default: none)."""
    quota_window_s: float = 60.0

    feeds_residency: ClassVar[bool] = False
    """Whether the program composing this config feeds ``Policy.residency`` (measured resident tokens per
    session); controls that need it (``budgeter-resident``) are refused where it does not."""

    def control_opts(self) -> dict[str, int | float]:
        return parse_control_opts(self.control, self.control_opt)

    def tenancy(self) -> Tenancy | None:
        """The tenancy of a fair policy (None: ``fair_share`` off, nothing set per tenant); raises UsageError."""
        if not (self.fair_share or self.tenant_weights or self.tenant_priorities or self.tenant_quotas):
            return None
        try:
            return Tenancy(
                weights=parse_assignments(self.tenant_weights, float, "--tenant-weight"),
                priorities=parse_assignments(self.tenant_priorities, int, "--tenant-priority"),  # type: ignore[arg-type]
                quotas=parse_assignments(self.tenant_quotas, int, "--tenant-quota"),  # type: ignore[arg-type]
                window_s=self.quota_window_s,
            )
        except PolicyError as e:
            raise UsageError(str(e)) from None

    def make_control(self, kv_pool: int) -> Control:
        """A new instance of the configured control for a KV pool of ``kv_pool`` tokens."""
        return make_control(self.control, kv_pool=kv_pool, **self.control_opts())

    def check_control(self, kv_pool: int | None = None) -> None:
        """Check the control's fields (its options against a pool of ``kv_pool`` tokens); raises UsageError."""
        if self.control not in CONTROLS:
            raise UsageError(f"unknown --control {self.control!r}; choose from {', '.join(CONTROLS)}")
        if self.control_at is not None and not self.control_at >= 0:
            raise UsageError("--control-at must be non-negative")
        try:
            control = self.make_control(kv_pool or 1_000_000)
        except (PolicyError, ValueError, TypeError) as e:
            raise UsageError(f"--control {self.control}: {e}") from None
        if self.tenancy() is not None and not control.fifo_readmit:
            raise UsageError(f"--control {self.control} resumes sessions on its own timer; fair share needs a control "
                             "that re-admits from the queues (budgeter, cap, ...)")
        if control.needs_residency and not self.feeds_residency:
            raise UsageError(
                f"--control {self.control} corrects D with measured residency (KV events), which this "
                "command does not measure; use it with kvgate gateway --kv-events, or use budgeter"
            )
