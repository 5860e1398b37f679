"""Enforcement as a binding: what a node reports it can enforce (the agent's inventory, versioned and
forward-compatible), the driver's per-container limits a sharing replica gets (request = the booking,
limit = the booking plus the start-up peak a start may reach), and a replica stopped at its limit
reported as OverLimit. No GPU was lent to this work: the driver path is checked as rendered env."""

from __future__ import annotations

import json

from vllmfit.backends import binding, enforcement
from vllmfit.core.defaults import GIB
from vllmfit.core.memory import learned
from vllmfit.core.observe import attribution, inventory
from vllmfit.core.spec import api
from vllmfit.operator.booking import pods

MIB = 1 << 20


def test_a_node_reports_driver_limits_from_r615_and_mps_from_its_daemon() -> None:
    assert inventory.enforcement_of("615.00.01") == ["driver-limits"]
    assert inventory.enforcement_of("620.1", mps_daemon=True) == ["driver-limits", "mps"]
    assert inventory.enforcement_of("580.95.05") == []
    assert inventory.enforcement_of("580.95.05", mps_daemon=True) == ["mps"]
    assert inventory.enforcement_of(None) == [] and inventory.enforcement_of("x") == []


def test_the_inventory_field_is_forward_compatible() -> None:
    old = {"sampled_at": "2030-01-01T00:00:00Z", "gpus": []}  # an agent from before the field: nothing enforced
    assert inventory.GpuInventory.model_validate_json(json.dumps(old)).enforcement == []
    new = {**old, "enforcement": ["driver-limits", "hami-core"], "somethingLater": 1}
    inv = inventory.GpuInventory.model_validate_json(json.dumps(new))
    assert attribution.attribute(inv, {}).enforcement == ("driver-limits",)  # an unknown value is ignored


def test_the_driver_limit_is_the_booking_and_the_start_up_peak_a_start_may_reach() -> None:
    booked = [20 * GIB + 5 * MIB + 3, 30 * GIB]
    env = {e["name"]: e["value"] for e in enforcement.driver_env(booked)}
    # by hand: 20 GiB + 5 MiB (+3 bytes, rounded down) = 20485 MiB; its bound max(4 GiB, a quarter) = 5 GiB + ...
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "0=20485M,1=30720M"
    assert learned.overrun_bound(30 * GIB) == 30 * GIB // 4
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == f"0={(booked[0] + booked[0] // 4) // MIB}M,1={(30 * GIB * 5 // 4) // MIB}M"
    assert enforcement.limit_bytes(8 * GIB) == 12 * GIB  # small bookings: at least 4 GiB of start-up room


def test_driver_limits_come_first_then_mps_where_the_admin_runs_it() -> None:
    assert enforcement.choose(("driver-limits", "mps"), mps_configured=False) == "driver-limits"
    assert enforcement.choose(("mps",), mps_configured=True) == "mps"
    assert enforcement.choose((), mps_configured=False) == "none"


def placement() -> api.ReplicaPlacement:
    return api.ReplicaPlacement(replica=0, node="n", gpus=[api.GpuRef(index=1, uuid="GPU-1", product="H100")])


def test_a_sharing_replica_gets_the_driver_limits_and_a_whole_node_replica_none() -> None:
    b = binding.bind(placement(), 1, exclusive=False, booked=[20 * GIB], enforce="driver-limits")
    names = [e["name"] for e in b.env]
    assert "NVIDIA_GPU_MEMORY_REQUEST" in names and "NVIDIA_GPU_MEMORY_LIMIT" in names
    assert not any("MEMORY" in e["name"] for e in binding.bind(placement(), 1, exclusive=False, booked=[GIB]).env)
    assert binding.bind(placement(), 1, exclusive=True, booked=[GIB], enforce="driver-limits").env == ()


def test_a_replica_stopped_at_its_limit_is_over_limit_and_an_unenforced_one_out_of_memory() -> None:
    def pod(held: str) -> dict:
        return {"metadata": {"annotations": {enforcement.ANNOTATION: held}}, "status": {"phase": "Running",
                "containerStatuses": [{"name": "vllm", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                       "lastState": {"terminated": {"exitCode": 1}}}]}}
    log = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.00 GiB"
    h = pods.pod_health(pod("driver-limits"), log)
    assert (h.reason, h.failed) == ("OverLimit", True) and "stopped at its GPU memory limit (driver-limits)" in h.message
    assert pods.pod_health(pod("none"), log).reason == "CudaOutOfMemory"
