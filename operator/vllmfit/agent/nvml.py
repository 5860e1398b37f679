"""Reading every GPU of the node through NVML (pynvml, imported by the caller): memory, MIG
devices, and the processes on each, mapped to pods.

Error strings on a GPU (`InventoryGpu.error`) are `<what>: <NVML message>` parts joined by
"; ", e.g. "processes: Not Supported" or "mig 1 memory: Insufficient Permissions";
`vllmfit.core.observe.attribution` reads the "processes:" parts."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from vllmfit import __version__
from vllmfit.agent.cgroups import pod_of_pid
from vllmfit.core.observe.inventory import (
    GpuInventory,
    InventoryGpu,
    InventoryMigDevice,
    InventoryProcess,
    enforcement_of,
)

NO_NVML_HINT = "is the NVIDIA driver installed and the container run with runtimeClassName: nvidia?"
def rfc3339(t: datetime) -> str:
    """UTC, second precision, trailing Z."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.astimezone(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _product(name: str) -> str:
    """GPU Feature Discovery's nvidia.com/gpu.product form: spaces as dashes."""
    return "-".join(name.split())


_MIG_PROFILE = re.compile(r"\bMIG\s+(\S+)")


class _GpuLost(Exception):
    def __init__(self, what: str, err: Exception) -> None:
        super().__init__(f"{what}: {err}")


class _Reader:
    """NVML calls for one GPU: errors become `<what>: <message>` parts instead of exceptions,
    except a lost GPU, which ends the reading of that GPU."""

    def __init__(self, nvml: ModuleType, pods: Callable[[int], tuple[str | None, str | None]]) -> None:
        self.nvml = nvml
        self.pods = pods
        self.errors: list[str] = []
        self._lost = tuple(
            c
            for c in (
                getattr(nvml, "NVMLError_GpuIsLost", None),
                getattr(nvml, "NVMLError_ResetRequired", None),
            )
            if c
        )

    def call(
        self, what: str, fn: Callable[..., Any], *args: Any, default: Any = None, quiet: tuple = ()
    ) -> Any:
        try:
            return fn(*args)
        except self._lost as e:
            raise _GpuLost(what, e) from e
        except quiet:
            return default
        except self.nvml.NVMLError as e:
            self.errors.append(f"{what}: {e}")
            return default

    def memory(self, what: str, handle: Any) -> tuple[int, int] | None:
        """(total, used): NVML v2 "used" (without the driver's reserved memory) when the driver
        has it, v1 otherwise."""
        nvml = self.nvml
        v2 = getattr(nvml, "nvmlMemory_v2", None)
        if v2 is not None:
            try:
                m = nvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
                return int(m.total), int(m.used)
            except self._lost as e:
                raise _GpuLost(what, e) from e
            except (nvml.NVMLError, TypeError):
                pass  # old driver: v1 below
        m = self.call(what, nvml.nvmlDeviceGetMemoryInfo, handle)
        return None if m is None else (int(m.total), int(m.used))

    def processes(self, what: str, handle: Any) -> list[InventoryProcess]:
        raw = self.call(what, self.nvml.nvmlDeviceGetComputeRunningProcesses, handle, default=[])
        out: dict[int, InventoryProcess] = {}
        for p in raw or []:
            pid = int(p.pid)
            if pid in out:
                continue
            used = getattr(p, "usedGpuMemory", None)
            pod, container = self.pods(pid)
            out[pid] = InventoryProcess(
                pid=pid,
                used_bytes=max(0, int(used)) if used is not None else 0,
                pod_uid=pod,
                container_id=container,
            )
        return [out[k] for k in sorted(out)]


def _read_mig(r: _Reader, handle: Any, m: int) -> InventoryMigDevice | None:
    nvml = r.nvml
    mh = r.call(
        f"mig {m}", nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, m, quiet=(nvml.NVMLError_NotFound,)
    )
    if mh is None:
        return None  # empty slot (NotFound) or unreadable (recorded)
    uuid = r.call(f"mig {m} uuid", nvml.nvmlDeviceGetUUID, mh)
    name = r.call(f"mig {m} name", nvml.nvmlDeviceGetName, mh)
    pm = _MIG_PROFILE.search(_text(name)) if name is not None else None
    mem = r.memory(f"mig {m} memory", mh)
    return InventoryMigDevice(
        index=m,
        uuid=_text(uuid) if uuid is not None else "",
        profile=pm.group(1) if pm else "",
        total_bytes=mem[0] if mem else 0,
        used_bytes=mem[1] if mem else 0,
        processes=r.processes(f"mig {m} processes", mh),
    )


def _read_gpu(nvml: ModuleType, i: int, pods: Callable[[int], tuple[str | None, str | None]]) -> InventoryGpu:
    r = _Reader(nvml, pods)
    got: dict[str, Any] = {"uuid": "", "product": ""}
    try:
        handle = r.call("handle", nvml.nvmlDeviceGetHandleByIndex, i)
        if handle is None:
            return InventoryGpu(index=i, uuid="", product="", total_bytes=0, error="; ".join(r.errors))
        uuid = r.call("uuid", nvml.nvmlDeviceGetUUID, handle)
        got["uuid"] = _text(uuid) if uuid is not None else ""
        name = r.call("name", nvml.nvmlDeviceGetName, handle)
        got["product"] = _product(_text(name)) if name is not None else ""
        mem = r.memory("memory", handle)
        total, used = mem if mem else (0, 0)
        mode = r.call(
            "mig mode",
            nvml.nvmlDeviceGetMigMode,
            handle,
            quiet=(nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound),
        )
        mig_on = bool(mode) and mode[0] == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        migs: list[InventoryMigDevice] = []
        procs: list[InventoryProcess] = []
        if mig_on:  # processes are listed per MIG device, where they run
            count = r.call("mig count", nvml.nvmlDeviceGetMaxMigDeviceCount, handle, default=0) or 0
            migs = [d for m in range(int(count)) if (d := _read_mig(r, handle, m)) is not None]
        else:
            procs = r.processes("processes", handle)
        return InventoryGpu(
            index=i,
            uuid=got["uuid"],
            product=got["product"],
            total_bytes=total,
            used_bytes=used,
            processes=procs,
            mig_enabled=mig_on,
            mig_devices=migs,
            error="; ".join(r.errors) or None,
        )
    except _GpuLost as e:  # nothing of it can be trusted: no memory, no processes
        return InventoryGpu(
            index=i,
            uuid=got["uuid"],
            product=got["product"],
            total_bytes=0,
            error="; ".join([*r.errors, str(e)]),
        )


def collect(
    nvml: ModuleType | None = None, proc_root: str | os.PathLike[str] = "/proc", now: datetime | None = None,
    mps_pipe: str | None = None,
) -> GpuInventory:
    """One sample of every GPU of this machine. Never raises for NVML errors.

    nvml: the pynvml module (default: the real one) or a stand-in with the same functions.
    proc_root: where /proc of the host is (the agent runs with hostPID).
    mps_pipe: the MPS control daemon's pipe directory as mounted in the agent (its `control` socket
    there: the node reports "mps" enforcement); the driver's own limits come from its version.
    """
    if nvml is None:
        import pynvml

        nvml = pynvml
    sampled_at = rfc3339(now or datetime.now(UTC))
    base: dict[str, Any] = {"sampled_at": sampled_at, "agent_version": __version__}
    try:
        nvml.nvmlInit()
    except (nvml.NVMLError, OSError) as e:
        return GpuInventory(**base, nvml=False, error=f"NVML not available: {e}")
    try:
        driver = None
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError:
            pass
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            return GpuInventory(**base, driver_version=driver, error=f"device count: {e}")
        cache: dict[int, tuple[str | None, str | None]] = {}

        def pods(pid: int) -> tuple[str | None, str | None]:
            if pid not in cache:
                cache[pid] = pod_of_pid(pid, proc_root)
            return cache[pid]

        gpus = [_read_gpu(nvml, i, pods) for i in range(count)]
        return GpuInventory(**base, driver_version=driver, gpus=gpus,
                            enforcement=enforcement_of(driver, bool(mps_pipe) and os.path.exists(os.path.join(
                                str(mps_pipe), "control"))))
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def no_nvml_reason(inventory: GpuInventory) -> str:
    """The NVML message of an inventory taken without NVML ("NVML Shared Library Not Found")."""
    return (inventory.error or "unknown error").removeprefix("NVML not available: ")


