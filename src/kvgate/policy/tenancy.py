"""Tenancy: who the sessions belong to, their weights, priority bands and token quotas (read by ``FairPolicy``).

A tenant is any hashable key (the gateway's client key, a header's value, the simulator's tenant class). Every
field has a default, so ``Tenancy()`` is equal shares, one band and no quota.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from kvgate.policy.state import PolicyError


@dataclass(frozen=True)
class Tenancy:
    weights: Mapping[Hashable, float] = field(default_factory=dict)
    """Tenant -> weight (its share of C is weight / the sum of the weights of tenants with sessions in the system)."""
    default_weight: float = 1.0
    priorities: Mapping[Hashable, int] = field(default_factory=dict)
    """Tenant -> its sessions' default priority band (higher is served first); a turn may name its own."""
    default_priority: int = 0
    quotas: Mapping[Hashable, int] = field(default_factory=dict)
    """Tenant -> token budget per window (reserved at a turn's boundary from d_s, settled from usage)."""
    default_quota: int | None = None
    """Budget of a tenant not in ``quotas``; None: unlimited."""
    window_s: float = 60.0
    """Length of a quota window; windows are [k·window_s, (k+1)·window_s) on the driver's clock."""
    starve_after: int = 8
    """Guard of the lowest bands: after this many re-admissions in a row that passed over a held lower band, the
    next one goes to the lowest band with a held session."""

    def __post_init__(self) -> None:
        for key, w in [*self.weights.items(), (None, self.default_weight)]:
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w <= 0:
                raise PolicyError(f"weight of tenant {key!r} must be a positive number, got {w!r}")
        for key, q in [*self.quotas.items(), (None, self.default_quota)]:
            if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 0):
                raise PolicyError(f"quota of tenant {key!r} must be a non-negative int, got {q!r}")
        for key, p in [*self.priorities.items(), (None, self.default_priority)]:
            if isinstance(p, bool) or not isinstance(p, int):
                raise PolicyError(f"priority of tenant {key!r} must be an int, got {p!r}")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise PolicyError(f"window_s must be positive, got {self.window_s!r}")
        if isinstance(self.starve_after, bool) or not isinstance(self.starve_after, int) or self.starve_after < 1:
            raise PolicyError(f"starve_after must be a positive int, got {self.starve_after!r}")

    def weight(self, tenant: Hashable) -> float:
        return float(self.weights.get(tenant, self.default_weight))

    def priority(self, tenant: Hashable) -> int:
        return self.priorities.get(tenant, self.default_priority)

    def quota(self, tenant: Hashable) -> int | None:
        return self.quotas.get(tenant, self.default_quota)


def parse_assignments(text: str, kind: type, what: str) -> dict[str, float] | dict[str, int]:
    """``"A=3,B=1"`` -> ``{"A": 3, "B": 1}`` with values of ``kind`` (int or float); raises PolicyError."""
    out: dict[str, float | int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.rpartition("=")
        if not sep or not key.strip():
            raise PolicyError(f"{what}: expected KEY=VALUE, got {part!r}")
        try:
            out[key.strip()] = kind(value)
        except ValueError:
            raise PolicyError(f"{what}: {value!r} is not {'an integer' if kind is int else 'a number'}") from None
    return out  # type: ignore[return-value]
