"""The budget of a GPU (ADR-0002: utilization x capacity - reserve) and vLLM's requested memory
R = ceil(T x u), with the utilization that requests a given number of bytes."""

from __future__ import annotations

import math

from vllmfit.core import defaults
from vllmfit.core.memory.versions import VllmVersion

# --- Budget (ADR-0002) -------------------------------------------------------------------------


def budget_bytes(capacity: int, utilization: float = defaults.UTILIZATION, reserve: int = defaults.RESERVE_BYTES) -> int:
    """ADR-0002: budget = utilization x capacity - reserve (never negative)."""
    return max(int(utilization * capacity) - reserve, 0)

def utilization_for(capacity: int, requested: int) -> float:
    """Smallest u with UTILIZATION_DECIMALS decimals such that ceil(capacity x u) >= requested."""
    scale = 10**defaults.UTILIZATION_DECIMALS
    u = math.ceil(requested * scale / capacity) / scale
    return min(u, 1.0)


def requested_bytes(capacity: int, u: float, version: VllmVersion) -> int:
    """vLLM's R: ceil(T x u) (0.15+), T x u before."""
    return math.ceil(capacity * u) if version.ceil_requested else int(capacity * u)
