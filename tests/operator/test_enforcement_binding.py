"""The running operator (KMock) binds a sharing replica's booking to the driver's per-container limit
where the node's agent reports it can (driver r615+), and says so where it cannot: condition
`Enforced` False, and its admission's Event is a Warning that says so. No GPU was lent to this work: what the driver does with
the env is NVIDIA's; this checks what vllmfit writes."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from opkit import DEPLOYMENTS, Cluster, Operator, node, vd

from vllmfit.core import defaults

pytestmark = pytest.mark.looptime
QWEN7 = "Qwen/Qwen2.5-7B-Instruct"
MIB = 1 << 20


def inventory(n: int, enforcement: list[str]) -> dict[str, str]:
    gpus = [{"index": i, "uuid": f"GPU-0000000{i}-0000-0000-0000-000000000000", "product": "NVIDIA-H100-80GB-HBM3",
             "total_bytes": 81559 * MIB, "used_bytes": 0, "processes": []} for i in range(n)]
    at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {defaults.INVENTORY_ANNOTATION: json.dumps({"sampled_at": at, "nvml": True, "gpus": gpus,
                                                       "driver_version": "615.1", "enforcement": enforcement})}


def env_of(dep: dict[str, Any]) -> dict[str, str]:
    c = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    return {e["name"]: e.get("value") for e in c["env"]}


def condition(cluster: Cluster, name: str) -> dict[str, Any] | None:
    return next((c for c in cluster.status(name).get("conditions") or [] if c["type"] == "Enforced"), None)


async def test_a_sharing_replica_gets_the_driver_limit_where_the_node_supports_it(
        cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=2, annotations=inventory(2, ["driver-limits"])))
    await cluster.create(vd("a", QWEN7, maxModelLen=4096))
    st = await cluster.phase("a", "Admitted")
    dep = await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"), what="a-0")
    booked = st["memory"][0]["totalBytes"]
    env = env_of(dep)
    assert env["NVIDIA_GPU_MEMORY_REQUEST"] == f"0={booked // MIB}M"
    assert env["NVIDIA_GPU_MEMORY_LIMIT"] == f"0={(booked + max(4 << 30, booked // 4)) // MIB}M"
    assert dep["spec"]["template"]["metadata"]["annotations"]["vllmfit.dev/enforcement"] == "driver-limits"
    c = await cluster.until(lambda: condition(cluster, "a"), what="Enforced")
    assert (c["status"], c["reason"]) == ("True", "Enforced")


async def test_a_replica_without_enforcement_is_said_to_run_without_it(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(node("gpu-a", gpus=2, annotations=inventory(2, [])))
    await cluster.create(vd("a", QWEN7, maxModelLen=4096))
    await cluster.phase("a", "Admitted")
    dep = await cluster.until(lambda: cluster.get(DEPLOYMENTS, "a-0"), what="a-0")
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in env_of(dep)
    c = await cluster.until(lambda: condition(cluster, "a"), what="Enforced")
    assert (c["status"], c["reason"]) == ("False", "NotEnforced") and "replica 0 on gpu-a" in c["message"]
    admitted = await cluster.event("a", "Admitted")  # its admission's Event says it, as a Warning
    assert admitted["type"] == "Warning" and c["message"] in admitted["message"]




async def test_enforcement_that_changes_after_the_admission_gets_a_warning_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A change of `Enforced` written after the admission (its Deployments written again, a
    replica added where nothing enforces its booking) posts a `NotEnforced` Warning of its own,
    once per message; the admission says it in its own Event (`post=False`: nothing posted)."""
    import bookkit

    from vllmfit.backends.enforcement import NONE
    from vllmfit.operator.binding import enforcement

    posted: list[tuple[str, str, str]] = []
    monkeypatch.setattr(enforcement, "post_event", lambda body, *event: posted.append(event))
    store = bookkit.two_nodes()
    rec = store.cache.records["ns/a"]
    on = rec.placement[0].node
    assert [c.status for c in rec.conditions if c.type == "Enforced"] == ["True"]  # its node to itself, then
    why = (f"replica 0 on {on}: the node reports no per-container GPU memory limit (NVIDIA driver r615+ or an MPS "
           "daemon): its booking is counted, not enforced")
    assert enforcement.said(store, rec, {0: (on, NONE)}, post=False) == why and posted == []
    assert await enforcement.report_modes(store, rec, {0: (on, NONE)}) is False and posted == []  # nothing new
    assert await enforcement.report_modes(store, rec, {0: (on, NONE), 1: ("gpu-x", NONE)}) is True
    assert posted == [("Warning", "NotEnforced", why.replace(":", ", replica 1 on gpu-x:", 1))]
    assert await enforcement.report_modes(store, rec, {0: (on, NONE), 1: ("gpu-x", NONE)}) is False
    assert len(posted) == 1
