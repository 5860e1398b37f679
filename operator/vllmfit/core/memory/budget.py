"""The budget of a GPU (utilization x capacity - reserve) under a named budget policy users can
set (`counted` by default, `adr-0002`), and vLLM's requested memory R = ceil(T x u), with the utilization that requests a given number
of bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vllmfit.core import defaults
from vllmfit.core.memory.types import fmt_gib
from vllmfit.core.memory.versions import VllmVersion

# --- Budget (ADR-0002) -------------------------------------------------------------------------


def budget_bytes(capacity: int, utilization: float = defaults.UTILIZATION, reserve: int = defaults.RESERVE_BYTES) -> int:
    """ADR-0002: budget = utilization x capacity - reserve (never negative)."""
    return max(int(utilization * capacity) - reserve, 0)


@dataclass(frozen=True)
class BudgetPolicy:
    """The safety policy of a GPU: vllmfit hands out `utilization x capacity - reserve` of it.

    Two named policies (`POLICIES`): `counted` (the default: 0.90 x capacity, no reserve; every
    overhead ADR-0002's reserve stood for is booked in the footprint, so each byte is held back
    once) and `adr-0002` (ADR-0002 exactly: 0.90 x capacity - 2 GiB). Either can be changed
    cluster-wide (operator --budget-utilization / --budget-reserve, chart value `budget`), per node
    pool (node labels vllmfit.dev/budget-utilization / vllmfit.dev/budget-reserve) or in the CLI
    (`--budget-policy NAME`, the same two flags). `source` says which, for messages."""

    utilization: float = defaults.UTILIZATION
    reserve_bytes: int = defaults.COUNTED_RESERVE_BYTES
    source: str = "default"

    def budget(self, capacity: int) -> int:
        return budget_bytes(capacity, self.utilization, self.reserve_bytes)

    def held_back(self, capacity: int) -> int:
        """Bytes of the GPU the policy never hands out."""
        return capacity - self.budget(capacity)

    @property
    def name(self) -> str:
        """`counted`, `adr-0002`, or `custom` (other figures)."""
        return next((n for n, p in POLICIES.items()
                     if (p.utilization, p.reserve_bytes) == (self.utilization, self.reserve_bytes)), "custom")

    @property
    def formula(self) -> str:
        """'0.9 x capacity', '0.9 x capacity - 2.0 GiB'."""
        minus = f" - {fmt_gib(self.reserve_bytes)}" if self.reserve_bytes else ""
        return f"{self.utilization:g} x capacity{minus}"

    @property
    def rule(self) -> str:
        """'0.9 x capacity (counted)', '0.9 x capacity - 2.0 GiB (adr-0002)'."""
        return f"{self.formula} ({self.name})"

    def describe(self, capacity: int) -> str:
        """'budget policy (default) 0.9 x capacity (counted) holds back 2.2 GiB of 22.0 GiB'"""
        return (f"budget policy ({self.source}) {self.rule} holds back {fmt_gib(self.held_back(capacity))} "
                f"of {fmt_gib(capacity)}")

    def error(self, capacity: int | None = None) -> str | None:
        """Why this policy is invalid (for a GPU of `capacity` bytes, if given), else None."""
        if not 0 <= self.utilization <= 1:
            return (f"budget utilization {self.utilization:g} ({self.source}) is outside [0, 1]; "
                    f"e.g. {defaults.UTILIZATION} keeps the default")
        if self.reserve_bytes < 0:
            return f"budget reserve {self.reserve_bytes} bytes ({self.source}) must not be negative"
        if capacity is not None and self.reserve_bytes > capacity:
            return (f"budget reserve {fmt_gib(self.reserve_bytes)} ({self.source}) is larger than the GPU "
                    f"({fmt_gib(capacity)}); use less than {fmt_gib(capacity)}")
        return None


DEFAULT_POLICY = BudgetPolicy()
"""`counted`: 0.90 x capacity (defaults.BUDGET_POLICY)."""
ADR_POLICY = BudgetPolicy(defaults.UTILIZATION, defaults.RESERVE_BYTES)
"""`adr-0002`: 0.90 x capacity - 2 GiB, ADR-0002's figures exactly."""
POLICIES: dict[str, BudgetPolicy] = {"counted": DEFAULT_POLICY, "adr-0002": ADR_POLICY}
"""The budget policies by name (`--budget-policy`)."""


def policy_named(name: str, source: str = "default") -> BudgetPolicy:
    """A named budget policy (ValueError naming the choices when unknown)."""
    if name not in POLICIES:
        raise ValueError(f"budget policy {name!r} is not one of {', '.join(POLICIES)}")
    return replace(POLICIES[name], source=source)


def default_policy(memory_policy: str = "vllm") -> BudgetPolicy:
    """The default budget policy of a memory policy: `counted` for `vllm` (its footprint books the
    overheads), `adr-0002` for `adr` (its footprint is weights + KV only, as ADR-0002 sizes them)."""
    return ADR_POLICY if memory_policy == "adr" else DEFAULT_POLICY


def utilization_for(capacity: int, requested: int) -> float:
    """Smallest u with UTILIZATION_DECIMALS decimals such that ceil(capacity x u) >= requested."""
    scale = 10**defaults.UTILIZATION_DECIMALS
    u = math.ceil(requested * scale / capacity) / scale
    return min(u, 1.0)


def utilization_within(capacity: int, room: int) -> float:
    """Largest u with UTILIZATION_DECIMALS decimals such that ceil(capacity x u) <= room (0 if none)."""
    scale = 10**defaults.UTILIZATION_DECIMALS
    u = max(math.floor(room * scale / capacity), 0) / scale
    while u > 0 and math.ceil(capacity * u) > room:
        u = round(u - 1 / scale, defaults.UTILIZATION_DECIMALS)
    return min(u, 1.0)


def requested_bytes(capacity: int, u: float, version: VllmVersion) -> int:
    """vLLM's R: ceil(T x u) (0.15+), T x u before."""
    return math.ceil(capacity * u) if version.ceil_requested else int(capacity * u)
