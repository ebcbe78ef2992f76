"""The policy core: may this session take its next turn? (the paper's actuator, §5, with several controls).

No I/O and no clock: a driver feeds events carrying ``now`` into ``Policy.handle`` and gets decisions back,
and sends ``Timer(now)`` when ``next_deadline()`` is reached. The in-process simulator and the HTTP gateway
drive it the same way. See ``core`` for the actuator, ``state`` for the transition table, ``limits`` for the
controls, ``view`` for what a control sees of the policy and the actions it returns, and docs/policy.md for the
whole story.

>>> from kvgate.policy import Policy, make_control, TurnRequested, Proceed
>>> policy = Policy(make_control("budgeter", kv_pool=400_000))
>>> policy.handle(TurnRequested(0.0, "s1", context_tokens=6_000, output_tokens=300))
[Proceed(session='s1')]
>>> policy.demand
6300
"""

from kvgate.policy.core import Policy
from kvgate.policy.events import (
    Decision,
    Event,
    OverQuota,
    Park,
    Proceed,
    SessionEnded,
    SessionId,
    Timer,
    TurnAborted,
    TurnFinished,
    TurnRequested,
)
from kvgate.policy.fair import FairPolicy
from kvgate.policy.limits import (
    AIMD,
    CONTROLS,
    AdaptiveCap,
    AdmissionCap,
    Budgeter,
    BudgeterResident,
    Cap,
    Control,
    NoControl,
    Thunder,
    make_control,
    parse_control,
)
from kvgate.policy.state import TRANSITIONS, PolicyError, SessionState
from kvgate.policy.tenancy import Tenancy, parse_assignments
from kvgate.policy.view import Action, PolicyView, Resume, SessionAction, SessionView, Suspend

__all__ = [
    "AIMD",
    "CONTROLS",
    "Action",
    "TRANSITIONS",
    "AdaptiveCap",
    "AdmissionCap",
    "Budgeter",
    "BudgeterResident",
    "Cap",
    "Decision",
    "Event",
    "FairPolicy",
    "OverQuota",
    "Control",
    "NoControl",
    "Park",
    "Policy",
    "PolicyError",
    "PolicyView",
    "Proceed",
    "Resume",
    "SessionAction",
    "SessionEnded",
    "SessionId",
    "SessionState",
    "SessionView",
    "Suspend",
    "Tenancy",
    "Thunder",
    "Timer",
    "TurnAborted",
    "TurnFinished",
    "TurnRequested",
    "make_control",
    "make_policy",
    "parse_assignments",
    "parse_control",
]


def make_policy(control: Control, *, now: float = 0.0, tenancy: Tenancy | None = None) -> Policy:
    """The policy for a driver: ``Policy`` without tenancy, ``FairPolicy`` with it."""
    return Policy(control, now=now) if tenancy is None else FairPolicy(control, now=now, tenancy=tenancy)
