"""Enforcement of what is booked, as a binding of its own beside reservation pods and DRA (pure).

Counting bytes is not enforcing them. Where the node's GPU stack can, a replica that shares GPUs
gets a limit the driver holds it to, chosen per node from what the node agent reports it supports
(vllmfit.core.observe.inventory.ENFORCEMENTS), on by default:

- `driver-limits` (NVIDIA driver r615 and later, the container toolkit's CDI hook, cgroup v2): the
  container's env `NVIDIA_GPU_MEMORY_REQUEST` = the bytes booked on each GPU and
  `NVIDIA_GPU_MEMORY_LIMIT` = the booking plus the start-up peak vllmfit lets a start reach (the
  over-run a start may teach, vllmfit.core.memory.learned.overrun_bound), per device ordinal in
  MiB (`0=22418M,1=22418M`: the request rounded down, the limit rounded down too);
- `mps`: the MPS binding's CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (vllmfit.backends.binding.Mps), where the
  admin runs MPS daemons (chart value `mps.enabled`);
- `none`: counted, not enforced (the operator says so: condition `Enforced` False and an Event).

A replica that owns every GPU of its node has no neighbour to protect (`exclusive`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllmfit.core.memory import learned
from vllmfit.core.observe.inventory import DRIVER_LIMITS, MPS
from vllmfit.core.spec import api

ANNOTATION = f"{api.GROUP}/enforcement"
"""On a replica's pods held to their booking: how (driver-limits or mps); the pod health reads it."""
NONE = "none"
EXCLUSIVE = "exclusive"
ENFORCED = (DRIVER_LIMITS, MPS)
CHOSEN = (DRIVER_LIMITS, NONE)
"""The modes `choose` picks per node (MPS is the admin's choice, exclusive the pinning's)."""
REQUEST_ENV = "NVIDIA_GPU_MEMORY_REQUEST"
LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"
MIB = 1 << 20


def choose(supported: Sequence[str], mps_configured: bool) -> str:
    """The enforcement of a sharing replica on a node that reports `supported`: the driver's own
    limits first, then MPS where the admin runs it, else none."""
    if DRIVER_LIMITS in supported:
        return DRIVER_LIMITS
    if mps_configured:
        return MPS
    return NONE


def limit_bytes(booked: int) -> int:
    """The hard limit of a GPU booked `booked` bytes: the booking plus the start-up peak allowed."""
    return booked + learned.overrun_bound(booked)


def per_device(values: Sequence[int]) -> str:
    return ",".join(f"{i}={n // MIB}M" for i, n in enumerate(values))


def driver_env(booked: Sequence[int]) -> tuple[dict[str, Any], ...]:
    """The driver-limits binding's env for a replica booked `booked` bytes on each of its GPUs
    (in the container's device order, which follows the GPU index order vllmfit pins)."""
    return ({"name": REQUEST_ENV, "value": per_device(booked)},
            {"name": LIMIT_ENV, "value": per_device([limit_bytes(b) for b in booked])})


def of_pod(exclusive: bool, shared: bool, enforce: str, mps: bool) -> str:
    """What holds a replica's pod to its booking: exclusive (no neighbour), the driver's limits or
    MPS (a sharing replica), or none (DRA replicas, and sharing replicas on a node with neither)."""
    if exclusive:
        return EXCLUSIVE
    if shared and enforce == DRIVER_LIMITS:
        return DRIVER_LIMITS
    if shared and mps:
        return MPS
    return NONE
