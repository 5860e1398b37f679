"""vllmfit.agent_nvml.collect with FakeNVML and a fake /proc tree; cgroup parsing; the real pynvml here."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime

import pynvml
import pytest
from agent_fakes import (
    A100_TOTAL,
    CID_A,
    CID_B,
    CID_C,
    CID_D,
    GIB,
    H100_TOTAL,
    MIB,
    MIG0,
    MIG1,
    MIG_TOTAL,
    POD_A,
    POD_B,
    POD_C,
    POD_D,
    UUID0,
    UUID2,
    UUID3,
    FakeGpu,
    FakeNVML,
    FakeProc,
    scenario,
)

from vllmfit.agent import cgroups as agent_cgroups
from vllmfit.agent import nvml as agent_nvml
from vllmfit.agent import publish as agent_publish
from vllmfit.core.observe.inventory import GpuInventory

NOW = datetime(2025, 3, 4, 5, 6, 7, 891000, tzinfo=UTC)


@pytest.fixture
def inv(tmp_path):
    fake = scenario(tmp_path)
    out = agent_nvml.collect(nvml=fake, proc_root=tmp_path, now=NOW)
    assert fake.init_calls == 1 and fake.shutdown_calls == 1 and not fake.initialized
    return out


def test_node_level_fields(inv):
    assert inv.nvml is True and inv.error is None
    assert inv.sampled_at == "2025-03-04T05:06:07Z"
    assert inv.driver_version == "550.54.15"
    assert inv.agent_version
    assert [g.index for g in inv.gpus] == [0, 1, 2, 3]


def test_h100_processes_mapped_to_pods(inv):
    g = inv.gpus[0]
    assert (g.uuid, g.product) == (UUID0, "NVIDIA-H100-80GB-HBM3")
    assert g.total_bytes == H100_TOTAL
    assert g.used_bytes == 52 * GIB + 256 * MIB  # v2 used: 40+10+1 GiB + 512 + 768 MiB, reserved excluded
    assert g.mig_enabled is False and g.mig_devices == [] and g.error is None
    got = [(p.pid, p.used_bytes, p.pod_uid, p.container_id) for p in g.processes]
    assert got == [
        (1001, 40 * GIB, POD_A, CID_A),  # cgroup v2, systemd, containerd
        (1002, 10 * GIB, POD_B, CID_B),  # cgroup v1, cgroupfs, docker
        (1003, 1 * GIB, None, None),  # host process
        (1004, 0, POD_A, CID_A),  # usedGpuMemory None -> 0; namespaced cgroup path
        (1005, 512 * MIB, None, None),  # no /proc entry
    ]


def test_mig_two_slices(inv):
    g = inv.gpus[1]
    assert g.product == "NVIDIA-A100-SXM4-80GB" and g.total_bytes == A100_TOTAL
    assert g.mig_enabled is True
    assert g.processes == []  # with MIG on, processes are listed per MIG device only
    assert [(m.index, m.uuid, m.profile, m.total_bytes, m.used_bytes) for m in g.mig_devices] == [
        (0, MIG0, "3g.40gb", MIG_TOTAL, 20 * GIB + 256 * MIB),
        (1, MIG1, "3g.40gb", MIG_TOTAL, 5 * GIB),
    ]
    assert [(p.pid, p.used_bytes, p.pod_uid, p.container_id) for p in g.mig_devices[0].processes] == [
        (2001, 20 * GIB, POD_C, CID_C)
    ]
    assert [(p.pid, p.pod_uid, p.container_id) for p in g.mig_devices[1].processes] == [(2002, POD_D, CID_D)]
    assert g.error is None  # empty slots (NotFound) are not errors


def test_lost_gpu_recorded_not_raised(inv):
    g = inv.gpus[2]
    assert g.uuid == UUID2 and g.product == "NVIDIA-A100-SXM4-80GB"
    assert g.total_bytes == 0 and g.used_bytes == 0 and g.processes == []
    assert g.error == "memory: GPU is lost"


def test_process_listing_not_supported(inv):
    g = inv.gpus[3]
    assert (g.uuid, g.total_bytes, g.used_bytes) == (UUID3, 40 * GIB, 30 * GIB)
    assert g.processes == []
    assert g.error == "processes: Not Supported"


def test_json_round_trip(inv):
    text = agent_publish.to_json(inv)
    assert GpuInventory.model_validate_json(text) == inv
    doc = json.loads(text)
    assert "sampledAt" in doc and "driverVersion" in doc
    assert doc["gpus"][0]["processes"][0] == {
        "pid": 1001,
        "usedBytes": 40 * GIB,
        "podUid": POD_A,
        "containerId": CID_A,
    }
    assert doc["gpus"][1]["migDevices"][0]["totalBytes"] == MIG_TOTAL
    assert "null" not in text  # exclude_none


def test_memory_v1_fallback_when_no_v2(tmp_path):
    gpu = FakeGpu("GPU-x", "Tesla T4", 15 * GIB, used=2 * GIB, reserved=300 * MIB, mig_slots=None)
    old = FakeNVML([gpu], memory_v2=False)
    assert agent_nvml.collect(old, tmp_path, NOW).gpus[0].used_bytes == 2 * GIB + 300 * MIB
    gpu.fail["nvmlDeviceGetMemoryInfo_v2"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    g = agent_nvml.collect(FakeNVML([gpu]), tmp_path, NOW).gpus[0]
    assert (g.used_bytes, g.error, g.mig_enabled) == (2 * GIB + 300 * MIB, None, False)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "RM has detected an NVML/RM version mismatch."),
    ],
)
def test_init_failure_gives_no_nvml_inventory(tmp_path, code, reason):
    inv = agent_nvml.collect(FakeNVML([], init_error=code), tmp_path, NOW)
    assert (inv.nvml, inv.gpus, inv.error) == (False, [], f"NVML not available: {reason}")
    assert agent_nvml.no_nvml_reason(inv) == reason


def test_device_count_failure(tmp_path):
    fake = FakeNVML([], count_error=pynvml.NVML_ERROR_UNKNOWN)
    inv = agent_nvml.collect(fake, tmp_path, NOW)
    assert (inv.nvml, inv.gpus, inv.error) == (True, [], "device count: Unknown Error")
    assert fake.shutdown_calls == 1


def test_other_per_call_errors(tmp_path):
    no_perm = pynvml.NVML_ERROR_NO_PERMISSION
    gpus = [
        FakeGpu(
            "GPU-a",
            "NVIDIA L4",
            24 * GIB,
            1 * GIB,
            fail={"nvmlDeviceGetHandleByIndex": pynvml.NVML_ERROR_GPU_IS_LOST},
        ),
        FakeGpu("GPU-b", "NVIDIA L4", 24 * GIB, 1 * GIB, fail={"nvmlDeviceGetName": no_perm}),
        FakeGpu("GPU-c", "NVIDIA L4", 24 * GIB, 1 * GIB, fail={"*": pynvml.NVML_ERROR_GPU_IS_LOST}),
        FakeGpu("GPU-d", "NVIDIA L4", 24 * GIB, 1 * GIB, fail={"nvmlDeviceGetMemoryInfo": no_perm}),
        FakeGpu("GPU-e", "NVIDIA L4", 24 * GIB, 1 * GIB, procs=[FakeProc(9, 1 * GIB)], mig_slots=[]),
    ]
    inv = agent_nvml.collect(FakeNVML(gpus), tmp_path, NOW)
    assert [(g.uuid, g.product, g.total_bytes, g.error) for g in inv.gpus] == [
        ("", "", 0, "handle: GPU is lost"),
        ("GPU-b", "", 24 * GIB, "name: Insufficient Permissions"),
        ("", "", 0, "uuid: GPU is lost"),
        ("GPU-d", "NVIDIA-L4", 0, "memory: Insufficient Permissions"),
        ("GPU-e", "NVIDIA-L4", 24 * GIB, None),
    ]
    assert [(p.pid, p.pod_uid) for p in inv.gpus[4].processes] == [(9, None)]


def test_mig_slot_errors(tmp_path):
    from agent_fakes import FakeMig

    bad = FakeMig(
        "MIG-bad",
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        10 * GIB,
        0,
        fail={"nvmlDeviceGetComputeRunningProcesses": pynvml.NVML_ERROR_NO_PERMISSION},
    )
    gpu = FakeGpu("GPU-m", "NVIDIA H100 80GB HBM3", H100_TOTAL, 0, mig_enabled=True, mig_slots=[None, bad])
    g = agent_nvml.collect(FakeNVML([gpu]), tmp_path, NOW).gpus[0]
    assert [(m.index, m.profile, m.total_bytes) for m in g.mig_devices] == [(1, "1g.10gb", 10 * GIB)]
    assert g.error == "mig 1 processes: Insufficient Permissions"


_U = "7f3c1a2b-4d5e-6f70-8192-a3b4c5d6e7f8"
_C = "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # cgroup v2, systemd driver
        (
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{_U.replace('-', '_')}.slice"
            + f"/cri-containerd-{_C}.scope",
            (_U, _C),
        ),
        (f"0::/kubepods.slice/kubepods-pod{_U.replace('-', '_')}.slice/docker-{_C}.scope", (_U, _C)),
        # kind nests under kubelet.slice
        (
            "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice"
            + f"/kubelet-kubepods-burstable-pod{_U.replace('-', '_')}.slice/cri-containerd-{_C}.scope",
            (_U, _C),
        ),
        # cgroup v1, cgroupfs driver, several controllers; guaranteed pod
        (f"12:devices:/kubepods/pod{_U}/{_C}\n11:memory:/kubepods/pod{_U}/{_C}\n0::/", (_U, _C)),
        # cgroup v1, first line names the pod only (pod-level cgroup), a later one the container
        (f"3:cpu:/kubepods/burstable/pod{_U}\n2:memory:/kubepods/burstable/pod{_U}/crio-{_C}", (_U, _C)),
        # pod-level cgroup only
        (
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_U.replace('-', '_')}.slice",
            (_U, None),
        ),
        # not a pod
        ("0::/system.slice/containerd.service", (None, None)),
        ("0::/user.slice/user-1000.slice/session-3.scope", (None, None)),
        ("", (None, None)),
    ],
)
def test_parse_cgroup(text, expected):
    assert agent_cgroups.parse_cgroup(text) == expected


def test_pod_of_pid_unreadable(tmp_path):
    assert agent_cgroups.pod_of_pid(424242, tmp_path) == (None, None)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_real_pynvml_without_driver_gives_clean_inventory():
    try:  # what the real library says here, independently of the agent
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        expected = str(e)
    else:  # pragma: no cover - a driver without nvidia-smi
        pynvml.nvmlShutdown()
        pytest.skip("NVML initialises on this machine")
    inv = agent_nvml.collect(now=NOW)
    assert (inv.nvml, inv.gpus) == (False, [])
    assert inv.error == f"NVML not available: {expected}"
    assert "NVML" in expected or "Driver" in expected


def test_the_node_reports_what_it_can_enforce(tmp_path):
    gpu = FakeGpu(UUID0, "NVIDIA H100 80GB HBM3", H100_TOTAL, GIB)
    assert agent_nvml.collect(FakeNVML([gpu]), tmp_path, NOW).enforcement == []  # driver 550: counted only
    assert agent_nvml.collect(FakeNVML([gpu], driver="615.20.01"), tmp_path, NOW).enforcement == ["driver-limits"]
    (tmp_path / "mps").mkdir()
    (tmp_path / "mps" / "control").write_text("")
    inv = agent_nvml.collect(FakeNVML([gpu]), tmp_path, NOW, mps_pipe=str(tmp_path / "mps"))
    assert inv.enforcement == ["mps"]
