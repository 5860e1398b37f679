"""The node inventory annotation `vllmfit.dev/gpu-inventory` that the node agent publishes: every GPU
of a node, its MIG devices and the processes on each. Versioned and forward-compatible."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

INVENTORY_SCHEMA_VERSION = 1
"""The newest inventory schema this vllmfit writes and fully understands. A field added later is
optional with a default that means "not reported" (an older agent's annotation still reads), and a
newer agent's unknown fields are ignored."""

DRIVER_LIMITS = "driver-limits"
"""The driver's per-container GPU memory limits: NVIDIA driver r615 and later, whose container
toolkit CDI hook reads NVIDIA_GPU_MEMORY_REQUEST / NVIDIA_GPU_MEMORY_LIMIT from a container's env."""
MPS = "mps"
"""An MPS control daemon on the node: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT holds per client."""
ENFORCEMENTS = (DRIVER_LIMITS, MPS)
"""Every enforcement a node can report, the operator's preference first."""
DRIVER_LIMITS_MIN_MAJOR = 615


def enforcement_of(driver_version: str | None, mps_daemon: bool = False) -> list[str]:
    """What a node with this driver (and an MPS control daemon or not) can enforce."""
    out = []
    try:
        major = int(str(driver_version or "").split(".", 1)[0])
    except ValueError:
        major = 0
    if major >= DRIVER_LIMITS_MIN_MAJOR:
        out.append(DRIVER_LIMITS)
    if mps_daemon:
        out.append(MPS)
    return out


class _Inventory(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class InventoryProcess(_Inventory):
    """A process using GPU memory."""

    pid: int = Field(description="Host PID.")
    used_bytes: int = Field(ge=0, description="GPU memory the process uses.")
    pod_uid: str | None = Field(default=None, description="UID of the pod it belongs to (from /proc/<pid>/cgroup).")
    container_id: str | None = Field(default=None, description="Container ID, if found.")


class InventoryMigDevice(_Inventory):
    """A MIG slice of a GPU."""

    index: int = Field(description="MIG device index within its GPU.")
    uuid: str = Field(description="MIG device UUID (MIG-...).")
    profile: str = Field(default="", description="Profile name, e.g. 1g.10gb.")
    total_bytes: int = Field(ge=0, description="Memory of the slice.")
    used_bytes: int = Field(default=0, ge=0, description="Memory in use on the slice.")
    processes: list[InventoryProcess] = Field(default_factory=list)


class InventoryGpu(_Inventory):
    """One GPU as NVML reports it."""

    index: int = Field(ge=0, description="NVML index.")
    uuid: str = Field(description="GPU UUID.")
    product: str = Field(description="Product name in GFD label form (spaces as dashes), e.g. NVIDIA-H100-80GB-HBM3.")
    total_bytes: int = Field(ge=0, description="Total memory (NVML).")
    used_bytes: int = Field(default=0, ge=0, description="Memory in use (NVML).")
    processes: list[InventoryProcess] = Field(default_factory=list, description="Compute processes on it.")
    mig_enabled: bool = Field(default=False, description="MIG mode is on.")
    mig_devices: list[InventoryMigDevice] = Field(default_factory=list, description="MIG slices, when MIG is on.")
    error: str | None = Field(default=None, description="NVML error reading this GPU (e.g. GPU is lost).")


class GpuInventory(_Inventory):
    """The value of the `vllmfit.dev/gpu-inventory` node annotation (JSON)."""

    schema_version: int = Field(default=INVENTORY_SCHEMA_VERSION, description="Schema version of this annotation.")
    sampled_at: str = Field(description="When the agent sampled NVML (RFC 3339, UTC).")
    agent_version: str = Field(default="", description="vllmfit version of the agent.")
    driver_version: str | None = Field(default=None, description="NVIDIA driver version.")
    nvml: bool = Field(default=True, description="False when NVML could not be initialised on the node.")
    error: str | None = Field(default=None, description="Why NVML could not be read, if it could not.")
    gpus: list[InventoryGpu] = Field(default_factory=list, description="Every GPU of the node.")
    enforcement: list[str] = Field(default_factory=list, max_length=8, description=(
        "Per-container GPU memory enforcement the node supports (driver-limits, mps); an unknown value is "
        "ignored, none reported: nothing enforced there."))
