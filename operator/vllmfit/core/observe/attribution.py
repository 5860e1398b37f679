"""Attribution of the GPU memory the node agent observed. Pure: no I/O, no Kubernetes, no NVML.

The node agent (`vllmfit agent`) writes a `GpuInventory` into the node annotation
`vllmfit.dev/gpu-inventory`. The operator reads it back and calls `attribute()` with the pods
vllmfit generated (pod UID -> deployment key "namespace/name") to learn, per schedulable unit:

- how many bytes each vllmfit deployment uses there (`Attribution.by_deployment`), and
- how many bytes something else uses there (`UnitUsage.foreign_bytes`): the ledger counts these
  against the unit's budget on top of the predicted memory of the vllmfit deployments.

Schedulable units and their index
---------------------------------
A GPU without MIG is one unit; its unit index is its NVML index (0..999).
On a GPU with MIG mode on, each MIG device is a unit and the GPU itself is not (a vLLM process
runs inside one slice). MIG device `m` of GPU `g` has the unit index `1000 * (g + 1) + m`
(GPU 0 slice 0 -> 1000, GPU 0 slice 1 -> 1001, GPU 1 slice 0 -> 2000), so unit indices never
collide with whole-GPU indices. `unit_index()` and `split_unit_index()` convert.

The foreign-memory rule
-----------------------
For one unit with `used` bytes in use (NVML) and the listed compute processes:

    vllmfit_bytes     = sum of the bytes of processes whose pod UID is a vllmfit pod
    foreign_proc      = sum of the bytes of all other listed processes
    unexplained_bytes = max(0, used - sum of the bytes of all listed processes)
    foreign_bytes     = foreign_proc + unexplained_bytes

`unexplained_bytes` covers what NVML counts as used but no listed process explains: processes
of other containers the agent could not see, graphics contexts, memory whose process reported
no usage (NVML returns "not available"; the agent records 0 bytes for it). `used` is NVML's
v2 "used" when the driver has it, which excludes the memory the driver reserves for itself
(that is accounted for by the memory model's capacity, not here).

When the agent could not list the processes of a unit (a part of the GPU's error string that
starts with "processes:", or "mig <m> processes:" for MIG device m), nothing can be attributed: all of `used` is unexplained and `attributable`
is False. A GPU the agent could not read at all (GPU is lost, memory unreadable) has
`total_bytes == 0` and `attributable` False; it offers no budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from vllmfit.core import defaults
from vllmfit.core.observe.inventory import (
    ENFORCEMENTS,
    GpuInventory,
    InventoryGpu,
    InventoryMigDevice,
    InventoryProcess,
)

MIG_UNIT_BASE = 1000
"""Unit index of MIG device m on GPU g: MIG_UNIT_BASE * (g + 1) + m."""

PROCESS_ERROR_PREFIX = "processes:"
"""The agent's error strings are `<what>: <NVML message>` joined by '; '. A part starting with
this (or with "mig <m> processes:") means the process list of the unit could not be read."""


def unit_index(gpu_index: int, mig_index: int | None = None) -> int:
    """The unit index of a whole GPU (mig_index None) or of a MIG device of it."""
    if gpu_index < 0 or gpu_index >= MIG_UNIT_BASE - 1:
        raise ValueError(f"GPU index {gpu_index} out of range 0..{MIG_UNIT_BASE - 2}")
    if mig_index is None:
        return gpu_index
    if mig_index < 0 or mig_index >= MIG_UNIT_BASE:
        raise ValueError(f"MIG device index {mig_index} out of range 0..{MIG_UNIT_BASE - 1}")
    return MIG_UNIT_BASE * (gpu_index + 1) + mig_index


def split_unit_index(index: int) -> tuple[int, int | None]:
    """(gpu_index, mig_index or None) of a unit index."""
    if index < 0:
        raise ValueError(f"unit index {index} is negative")
    if index < MIG_UNIT_BASE:
        return index, None
    return index // MIG_UNIT_BASE - 1, index % MIG_UNIT_BASE


@dataclass(frozen=True)
class UnitUsage:
    """Observed memory of one schedulable unit (a whole GPU, or one MIG device)."""

    index: int
    """Unit index (see the module docstring)."""
    gpu_index: int
    mig_index: int | None
    uuid: str
    product: str
    total_bytes: int
    used_bytes: int
    vllmfit_bytes: int
    """Bytes of processes of vllmfit pods."""
    foreign_process_bytes: int
    """Bytes of listed processes that are not of vllmfit pods."""
    unexplained_bytes: int
    """max(0, used - all listed process bytes)."""
    attributable: bool
    """False when the processes (or the whole GPU) could not be read: then vllmfit_bytes is 0 and
    foreign_bytes may include the memory of vllmfit pods."""
    error: str | None = None
    by_deployment: dict[str, int] = field(default_factory=dict)
    """deployment key -> bytes of its processes on this unit."""
    foreign_pods: dict[str, int] = field(default_factory=dict)
    """pod UID -> bytes, for processes of pods that are not vllmfit pods (for messages)."""

    @property
    def foreign_bytes(self) -> int:
        """Memory in use that the ledger must count as not vllmfit's."""
        return self.foreign_process_bytes + self.unexplained_bytes

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes)


@dataclass(frozen=True)
class Attribution:
    """What `attribute()` returns."""

    sampled_at: str
    nvml: bool
    units: dict[int, UnitUsage]
    """unit index -> usage, in ascending unit index."""
    by_deployment: dict[str, dict[int, int]]
    """deployment key -> unit index -> observed bytes (only units where it has processes)."""
    error: str | None = None
    enforcement: tuple[str, ...] = ()
    """The enforcements the node reported (inventory.ENFORCEMENTS it knows, in its order)."""

    @property
    def foreign_bytes(self) -> dict[int, int]:
        """unit index -> foreign bytes."""
        return {i: u.foreign_bytes for i, u in self.units.items()}

    def observed(self, deployment: str, index: int) -> int:
        """Observed bytes of one deployment on one unit (0 when it has no process there)."""
        return self.by_deployment.get(deployment, {}).get(index, 0)


def _unit(
    *,
    index: int,
    gpu_index: int,
    mig_index: int | None,
    uuid: str,
    product: str,
    total: int,
    used: int,
    processes: Iterable[InventoryProcess],
    error: str | None,
    procs_ok: bool,
    pods: Mapping[str, str],
) -> UnitUsage:
    by_dep: dict[str, int] = {}
    foreign_pods: dict[str, int] = {}
    vllmfit = foreign_proc = listed = 0
    seen: set[int] = set()
    for p in processes if procs_ok else ():
        if p.pid in seen:  # the same process listed twice counts once
            continue
        seen.add(p.pid)
        listed += p.used_bytes
        dep = pods.get(p.pod_uid) if p.pod_uid else None
        if dep is not None:
            vllmfit += p.used_bytes
            by_dep[dep] = by_dep.get(dep, 0) + p.used_bytes
        else:
            foreign_proc += p.used_bytes
            if p.pod_uid:
                foreign_pods[p.pod_uid] = foreign_pods.get(p.pod_uid, 0) + p.used_bytes
    return UnitUsage(
        index=index,
        gpu_index=gpu_index,
        mig_index=mig_index,
        uuid=uuid,
        product=product,
        total_bytes=total,
        used_bytes=used,
        vllmfit_bytes=vllmfit,
        foreign_process_bytes=foreign_proc,
        unexplained_bytes=max(0, used - listed),
        attributable=procs_ok,
        error=error,
        by_deployment=by_dep,
        foreign_pods=foreign_pods,
    )


def _process_error(error: str | None, mig_index: int | None) -> bool:
    """Whether the agent's error string says the processes of this unit could not be listed."""
    if not error:
        return False
    prefix = PROCESS_ERROR_PREFIX if mig_index is None else f"mig {mig_index} {PROCESS_ERROR_PREFIX}"
    return any(part.strip().startswith(prefix) for part in error.split(";"))


def _mig_profile_product(gpu: InventoryGpu, mig: InventoryMigDevice) -> str:
    return f"{gpu.product}-MIG-{mig.profile}" if mig.profile else f"{gpu.product}-MIG"


def attribute(inventory: GpuInventory, pods: Mapping[str, str]) -> Attribution:
    """Split the observed memory of each unit of a node into vllmfit deployments and foreign use.

    `pods` maps the UID of each pod vllmfit generated to its deployment key ("namespace/name").
    See the module docstring for the unit indices and the foreign-memory rule.
    """
    units: dict[int, UnitUsage] = {}
    if inventory.nvml:
        for gpu in inventory.gpus:
            readable = gpu.total_bytes > 0
            if gpu.mig_enabled and readable:
                for mig in gpu.mig_devices:
                    idx = unit_index(gpu.index, mig.index)
                    units[idx] = _unit(
                        index=idx,
                        gpu_index=gpu.index,
                        mig_index=mig.index,
                        uuid=mig.uuid,
                        product=_mig_profile_product(gpu, mig),
                        total=mig.total_bytes,
                        used=mig.used_bytes,
                        processes=mig.processes,
                        error=gpu.error,
                        procs_ok=mig.total_bytes > 0 and not _process_error(gpu.error, mig.index),
                        pods=pods,
                    )
                continue
            idx = unit_index(gpu.index)
            units[idx] = _unit(
                index=idx,
                gpu_index=gpu.index,
                mig_index=None,
                uuid=gpu.uuid,
                product=gpu.product,
                total=gpu.total_bytes,
                used=gpu.used_bytes,
                processes=gpu.processes,
                error=gpu.error,
                procs_ok=readable and not _process_error(gpu.error, None),
                pods=pods,
            )
    units = dict(sorted(units.items()))
    by_deployment: dict[str, dict[int, int]] = {}
    for idx, u in units.items():
        for dep, b in u.by_deployment.items():
            by_deployment.setdefault(dep, {})[idx] = b
    return Attribution(
        enforcement=tuple(e for e in inventory.enforcement if e in ENFORCEMENTS),
        sampled_at=inventory.sampled_at,
        nvml=inventory.nvml,
        units=units,
        by_deployment=dict(sorted(by_deployment.items())),
        error=inventory.error,
    )


def parse_time(value: str) -> datetime:
    """An RFC 3339 time as an aware datetime (a trailing Z and naive times are UTC)."""
    t = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def age_seconds(inventory: GpuInventory, now: datetime) -> float | None:
    """Seconds since the inventory was sampled, or None when sampled_at is not a time."""
    try:
        sampled = parse_time(inventory.sampled_at)
    except ValueError:
        return None
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    return (now - sampled).total_seconds()


def is_stale(
    inventory: GpuInventory, now: datetime, max_age_s: float = defaults.INVENTORY_STALE_SECONDS
) -> bool:
    """True when the inventory is older than max_age_s, or its sampled_at cannot be read.

    A sample from the future (clock skew between node and operator) is not stale.
    """
    age = age_seconds(inventory, now)
    return age is None or age > max_age_s


def drift(
    predicted_bytes: int, observed_bytes: int, margin_fraction: float = defaults.DRIFT_WARNING_FRACTION
) -> tuple[int, bool]:
    """(observed - predicted, warn). warn is True when observed exceeds predicted by more than
    margin_fraction of predicted (with nothing predicted, any observed use warns)."""
    if margin_fraction < 0:
        raise ValueError(f"margin_fraction must be >= 0, got {margin_fraction}")
    d = observed_bytes - predicted_bytes
    if predicted_bytes <= 0:
        return d, observed_bytes > 0
    return d, observed_bytes > predicted_bytes * (1.0 + margin_fraction)
