"""The budget of a GPU under a named budget policy users can set (`counted` by default: what one lone
vLLM at `--gpu-memory-utilization u` really uses, ceil(u x capacity) + its CUDA context, less a
reserve; `adr-0002`: utilization x capacity - reserve), and vLLM's requested memory R = ceil(T x u),
with the utilization that requests a given number of bytes."""

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
    """The safety policy of a GPU: how much of it vllmfit hands out.

    With `context_bytes` (the default, `counted`): `ceil(utilization x capacity) + context_bytes -
    reserve`, at most the capacity. That is what ONE vLLM server started alone with
    `--gpu-memory-utilization utilization` really uses, its R = ceil(T x u) plus the CUDA context
    it holds outside R, so vLLM's own default (u 0.9) on an empty GPU is admitted. The context is
    counted once per GPU, never per process (each colocated server books its own in its
    footprint), so a shared GPU keeps its margin: (1 - u) x capacity less one context.

    Without (`adr-0002`, context_bytes 0): ADR-0002 exactly, `utilization x capacity - reserve`.

    Either can be changed cluster-wide (operator --budget-utilization / --budget-reserve, chart
    value `budget`), per node pool (node labels vllmfit.dev/budget-utilization /
    vllmfit.dev/budget-reserve) or in the CLI (`--budget-policy NAME`, the same two flags); each
    keeps the context term of the policy it changes. `source` says which, for messages."""

    utilization: float = defaults.UTILIZATION
    reserve_bytes: int = defaults.COUNTED_RESERVE_BYTES
    source: str = "default"
    context_bytes: int = defaults.COUNTED_CONTEXT_BYTES

    def budget(self, capacity: int) -> int:
        if not self.context_bytes:
            return budget_bytes(capacity, self.utilization, self.reserve_bytes)
        if self.utilization <= 0:  # no vLLM runs at u = 0: nothing is handed out
            return 0
        lone = min(math.ceil(capacity * self.utilization) + self.context_bytes, capacity)
        return max(lone - self.reserve_bytes, 0)

    def held_back(self, capacity: int) -> int:
        """Bytes of the GPU the policy never hands out."""
        return capacity - self.budget(capacity)

    @property
    def name(self) -> str:
        """`counted`, `adr-0002`, or `custom` (other figures)."""
        mine = (self.utilization, self.reserve_bytes, self.context_bytes)
        return next((n for n, p in POLICIES.items()
                     if (p.utilization, p.reserve_bytes, p.context_bytes) == mine), "custom")

    @property
    def formula(self) -> str:
        """'ceil(0.9 x capacity) + 0.55 GiB CUDA context', '0.9 x capacity - 2.0 GiB'."""
        minus = f" - {fmt_gib(self.reserve_bytes)}" if self.reserve_bytes else ""
        if not self.context_bytes:
            return f"{self.utilization:g} x capacity{minus}"
        return f"ceil({self.utilization:g} x capacity) + {self.context_bytes / defaults.GIB:.2f} GiB CUDA context{minus}"

    @property
    def rule(self) -> str:
        """'ceil(0.9 x capacity) + 0.55 GiB CUDA context (counted)', '0.9 x capacity - 2.0 GiB (adr-0002)'."""
        return f"{self.formula} ({self.name})"

    def describe(self, capacity: int) -> str:
        """'budget policy (default) ceil(0.9 x capacity) + 0.55 GiB CUDA context (counted) holds back
        1.6 GiB of 22.0 GiB'"""
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

    def with_utilization(self, utilization: float, reserve_bytes: int | None = None, source: str | None = None
                         ) -> BudgetPolicy:
        """This policy with another utilization (and reserve, source); its context term kept."""
        return replace(self, utilization=utilization, source=self.source if source is None else source,
                       reserve_bytes=self.reserve_bytes if reserve_bytes is None else reserve_bytes)

    def utilization_for(self, capacity: int, bytes_: int) -> float:
        """The smallest utilization (2 decimals) whose budget on `capacity` is at least `bytes_`."""
        # from just below the float estimate upwards, so that rounding (92.00000000001) costs no step
        k = max(math.floor((bytes_ + self.reserve_bytes - self.context_bytes) / capacity * 100) - 1, 0)
        while k < 100 and self.with_utilization(k / 100).budget(capacity) < bytes_:
            k += 1
        return k / 100


DEFAULT_POLICY = BudgetPolicy()
"""`counted`: ceil(0.90 x capacity) + one CUDA context (defaults.BUDGET_POLICY)."""
ADR_POLICY = BudgetPolicy(defaults.UTILIZATION, defaults.RESERVE_BYTES, context_bytes=0)
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
