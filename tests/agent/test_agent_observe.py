"""vllmfit.core.observe.attribution: attribution arithmetic against hand-computed numbers, unit indices, staleness, drift."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from agent_fakes import GIB, MIB, MIG0, POD_A, POD_B, POD_C, POD_D, UUID0, VLLMFIT_PODS, scenario

from vllmfit.agent import nvml as agent_nvml
from vllmfit.core.observe import attribution
from vllmfit.core.observe.inventory import GpuInventory, InventoryGpu, InventoryMigDevice, InventoryProcess

NOW = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)


def _p(pid, used, pod=None):
    return InventoryProcess(pid=pid, used_bytes=used, pod_uid=pod)


def test_attribute_hand_built_inventory():
    """Numbers chosen by hand; the expected values are worked out in the comments."""
    inv = GpuInventory(
        sampled_at="2025-03-04T05:06:07Z",
        gpus=[
            InventoryGpu(
                index=0,
                uuid="GPU-0",
                product="NVIDIA-H100-80GB-HBM3",
                total_bytes=80 * GIB,
                used_bytes=30 * GIB,
                processes=[
                    _p(10, 12 * GIB, "pod-a"),  # ns/a
                    _p(11, 6 * GIB, "pod-b"),  # ns/b
                    _p(12, 4 * GIB, "pod-x"),  # some other pod
                    _p(13, 3 * GIB),  # host process
                    _p(14, 1 * GIB, "pod-a"),  # ns/a again
                ],
            ),
            # listed processes exceed used (sampling race): unexplained clamps to 0
            InventoryGpu(
                index=1,
                uuid="GPU-1",
                product="NVIDIA-H100-80GB-HBM3",
                total_bytes=80 * GIB,
                used_bytes=9 * GIB,
                processes=[_p(20, 8 * GIB, "pod-a"), _p(21, 2 * GIB, "pod-x")],
            ),
            # nothing listed: everything is foreign
            InventoryGpu(index=2, uuid="GPU-2", product="P", total_bytes=80 * GIB, used_bytes=700 * MIB),
        ],
    )
    a = attribution.attribute(inv, {"pod-a": "ns/a", "pod-b": "ns/b"})
    u0, u1, u2 = a.units[0], a.units[1], a.units[2]
    # GPU 0: vllmfit = 12 + 6 + 1 = 19; foreign processes = 4 + 3 = 7; listed = 26; unexplained = 30 - 26 = 4
    assert (u0.vllmfit_bytes, u0.foreign_process_bytes, u0.unexplained_bytes) == (19 * GIB, 7 * GIB, 4 * GIB)
    assert u0.foreign_bytes == 11 * GIB
    assert u0.by_deployment == {"ns/a": 13 * GIB, "ns/b": 6 * GIB}
    assert u0.foreign_pods == {"pod-x": 4 * GIB}
    assert u0.free_bytes == 50 * GIB and u0.attributable
    # GPU 1: vllmfit 8, foreign processes 2, listed 10 > used 9 -> unexplained 0
    assert (u1.vllmfit_bytes, u1.foreign_bytes, u1.unexplained_bytes) == (8 * GIB, 2 * GIB, 0)
    # GPU 2
    assert (u2.vllmfit_bytes, u2.foreign_bytes) == (0, 700 * MIB)
    assert a.by_deployment == {"ns/a": {0: 13 * GIB, 1: 8 * GIB}, "ns/b": {0: 6 * GIB}}
    assert a.foreign_bytes == {0: 11 * GIB, 1: 2 * GIB, 2: 700 * MIB}
    assert a.observed("ns/a", 1) == 8 * GIB and a.observed("ns/a", 2) == 0 and a.observed("ns/zzz", 0) == 0


def test_attribute_collected_scenario(tmp_path):
    inv = agent_nvml.collect(scenario(tmp_path), tmp_path, NOW)
    a = attribution.attribute(inv, VLLMFIT_PODS)
    # GPU 0 (H100): used 52.25 GiB; ns/llama = 40 GiB (pid 1001) + 0 (pid 1004, unknown bytes);
    # foreign processes = 10 (POD_B) + 1 (host) + 0.5 (exited pid) = 11.5 GiB;
    # unexplained = 52.25 - 51.5 = 0.75 GiB; foreign = 12.25 GiB
    # GPU 1 (A100, MIG): no whole-GPU unit; slice 0 -> 2000, slice 1 -> 2001
    # GPU 2 lost: total 0, nothing attributable; GPU 3: processes not listed, all 30 GiB foreign
    assert sorted(a.units) == [0, 2, 3, 2000, 2001]
    u0 = a.units[0]
    assert (u0.uuid, u0.vllmfit_bytes, u0.foreign_process_bytes) == (UUID0, 40 * GIB, 11 * GIB + 512 * MIB)
    assert u0.unexplained_bytes == 768 * MIB
    assert u0.foreign_bytes == 12 * GIB + 256 * MIB
    assert u0.foreign_pods == {POD_B: 10 * GIB}
    m0, m1 = a.units[2000], a.units[2001]
    assert (m0.gpu_index, m0.mig_index, m0.uuid, m0.product) == (
        1,
        0,
        MIG0,
        "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb",
    )
    assert (m0.vllmfit_bytes, m0.foreign_bytes) == (20 * GIB, 256 * MIB)
    assert (m1.vllmfit_bytes, m1.foreign_bytes, m1.foreign_pods) == (0, 5 * GIB, {POD_D: 5 * GIB})
    lost = a.units[2]
    assert (lost.total_bytes, lost.attributable, lost.foreign_bytes, lost.error) == (
        0,
        False,
        0,
        "memory: GPU is lost",
    )
    ns = a.units[3]
    assert (ns.attributable, ns.vllmfit_bytes, ns.foreign_bytes) == (False, 0, 30 * GIB)
    assert a.by_deployment == {"ns/llama": {0: 40 * GIB}, "ns/qwen": {2000: 20 * GIB}}
    assert POD_A in VLLMFIT_PODS and POD_C in VLLMFIT_PODS


def test_attribute_mig_process_error_only_affects_its_slice():
    gpu = InventoryGpu(
        index=0,
        uuid="GPU-0",
        product="NVIDIA-H100-80GB-HBM3",
        total_bytes=80 * GIB,
        mig_enabled=True,
        error="mig 1 processes: Insufficient Permissions",
        mig_devices=[
            InventoryMigDevice(
                index=0,
                uuid="MIG-0",
                profile="1g.10gb",
                total_bytes=10 * GIB,
                used_bytes=3 * GIB,
                processes=[_p(1, 3 * GIB, "u")],
            ),
            InventoryMigDevice(index=1, uuid="MIG-1", total_bytes=10 * GIB, used_bytes=2 * GIB),
        ],
    )
    a = attribution.attribute(GpuInventory(sampled_at="x", gpus=[gpu]), {"u": "ns/d"})
    assert a.units[1000].attributable and a.units[1000].vllmfit_bytes == 3 * GIB
    assert not a.units[1001].attributable and a.units[1001].foreign_bytes == 2 * GIB
    assert a.units[1001].product == "NVIDIA-H100-80GB-HBM3-MIG"


def test_attribute_no_nvml_and_duplicates():
    none = GpuInventory(sampled_at="x", nvml=False, error="NVML not available: NVML Shared Library Not Found")
    a = attribution.attribute(none, {})
    assert (a.units, a.by_deployment, a.nvml, a.error) == ({}, {}, False, none.error)
    dup = GpuInventory(
        sampled_at="x",
        gpus=[
            InventoryGpu(
                index=0,
                uuid="g",
                product="p",
                total_bytes=GIB,
                used_bytes=GIB,
                processes=[_p(5, 100, "u"), _p(5, 100, "u")],
            )
        ],
    )
    assert attribution.attribute(dup, {"u": "ns/d"}).observed("ns/d", 0) == 100


@pytest.mark.parametrize(
    ("gpu", "mig", "idx"),
    [(0, None, 0), (7, None, 7), (0, 0, 1000), (0, 6, 1006), (1, 0, 2000), (12, 3, 13003)],
)
def test_unit_index(gpu, mig, idx):
    assert attribution.unit_index(gpu, mig) == idx
    assert attribution.split_unit_index(idx) == (gpu, mig)


def test_unit_index_bounds():
    for bad in ((-1, None), (999, None), (0, 1000), (0, -1)):
        with pytest.raises(ValueError):
            attribution.unit_index(*bad)
    with pytest.raises(ValueError):
        attribution.split_unit_index(-5)


def test_is_stale():
    inv = GpuInventory(sampled_at="2025-03-04T05:06:07Z")
    assert not attribution.is_stale(inv, NOW + timedelta(seconds=300), 300)
    assert attribution.is_stale(inv, NOW + timedelta(seconds=301), 300)
    assert not attribution.is_stale(inv, NOW - timedelta(seconds=60), 300)  # clock skew: from the future
    assert not attribution.is_stale(inv, datetime(2025, 3, 4, 5, 7, 0), 300)  # naive now = UTC
    assert attribution.is_stale(GpuInventory(sampled_at="2025-03-04T05:06:07+00:00"), NOW + timedelta(hours=1))
    assert attribution.is_stale(GpuInventory(sampled_at="garbage"), NOW, 300)
    assert attribution.age_seconds(inv, NOW + timedelta(seconds=42)) == 42.0


def test_drift():
    assert attribution.drift(10 * GIB, 11 * GIB, 0.10) == (1 * GIB, False)  # exactly +10%: not above
    assert attribution.drift(10 * GIB, 11 * GIB + 1, 0.10) == (1 * GIB + 1, True)
    assert attribution.drift(10 * GIB, 8 * GIB, 0.10) == (-2 * GIB, False)
    assert attribution.drift(0, 1, 0.10) == (1, True)
    assert attribution.drift(0, 0, 0.10) == (0, False)
    assert attribution.drift(100, 105) == (5, False)  # default margin 10%
    with pytest.raises(ValueError):
        attribution.drift(1, 1, -0.1)
