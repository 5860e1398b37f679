"""DRA backend, pure part: slices and claims -> GPUs and foreign use, the claim template (validated
strictly against the resource.k8s.io/v1 schemas of 1.34, 1.35 and 1.36), the read-back check, the
scheduler's failure text."""

from __future__ import annotations

import copy
from decimal import Decimal
from pathlib import Path

import kubernetes.utils
import kubernetes_validate
import pytest
import yaml

from vllmfit.backends import dra
from vllmfit.core.placement import GpuSlot, NodeInfo
from vllmfit.sources import catalog

DATA = Path(__file__).parent.parent / "data" / "dra"
DRA_KUBE = ["1.34.0", "1.35.0", "1.36.0"]
GIB, MIB = 1 << 30, 1 << 20
H100_UUID0 = "GPU-4f8e2a9c-1b3d-4e5f-8a7b-0c1d2e3f4a5b"


def slice8() -> dict:
    return yaml.safe_load((DATA / "slice-8xh100.yaml").read_text())


def example_slice(node: str = "kind-worker", n: int = 2, generation: int = 1) -> dict:
    """What dra-example-driver's GPU profile publishes with gpuAllowMultipleAllocations=true."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-gpu.example.com-x"},
            "spec": {"driver": "gpu.example.com", "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": [{"name": f"gpu-{i}", "allowMultipleAllocations": True,
                                  "attributes": {"index": {"int": i}, "uuid": {"string": f"gpu-{i}{i}{i}"},
                                                 "model": {"string": "LATEST-GPU-MODEL"},
                                                 "driverVersion": {"version": "1.0.0"}},
                                  "capacity": {"memory": {"value": "80Gi", "requestPolicy": {
                                      "default": "80Gi", "validRange": {"min": "8Gi", "max": "80Gi", "step": "8Gi"}}}}}
                                 for i in reversed(range(n))]}}


@pytest.mark.parametrize("q", ["81559Mi", "18Gi", "1e9", "100", "1.5Gi", "500m", "2k", "7M", "19327352833"])
def test_quantities_agree_with_the_kubernetes_client(q: str) -> None:
    assert dra.quantity_bytes(q) == int(kubernetes.utils.parse_quantity(q).to_integral_value(rounding="ROUND_CEILING"))
    with pytest.raises(ValueError):
        dra.quantity_bytes("lots")


def test_canonical_quantity_round_trips() -> None:
    for n in (18 * GIB, 81559 * MIB, 19327352833, 3 * 1024):
        assert dra.quantity_bytes(dra.quantity(n)) == n
    assert dra.quantity(18 * GIB) == "18Gi" and dra.quantity(81559 * MIB) == "81559Mi"
    assert Decimal(dra.quantity(19327352833)) == 19327352833


def test_nvidia_slice_gives_eight_shareable_h100s_in_name_order() -> None:
    devs = dra.devices_from_slices([slice8()])["h100-node-a"]
    assert [d.name for d in devs] == [f"gpu-{i}" for i in range(8)]
    d0 = devs[0]
    assert (d0.uuid, d0.product, d0.memory_bytes, d0.shareable) == (H100_UUID0, "NVIDIA-H100-80GB-HBM3",
                                                                     81559 * MIB, True)
    assert dra.backend_for("auto", devs) == "dra"
    no_share = slice8()
    for d in no_share["spec"]["devices"]:
        d.pop("allowMultipleAllocations")  # what the API server keeps without DRAConsumableCapacity
    assert dra.backend_for("auto", dra.devices_from_slices([no_share])["h100-node-a"]) == "device-plugin"
    assert dra.backend_for("dra", []) == "dra" and dra.backend_for("device-plugin", devs) == "device-plugin"


def test_only_the_newest_complete_generation_of_a_pool_counts() -> None:
    old, new = example_slice(n=2, generation=1), example_slice(n=3, generation=2)
    got = dra.devices_from_slices([old, new], drivers=("gpu.example.com",))
    assert [d.name for d in got["kind-worker"]] == ["gpu-0", "gpu-1", "gpu-2"]  # by the index attribute
    partial = example_slice(n=3, generation=3)
    partial["spec"]["pool"]["resourceSliceCount"] = 2  # one of two slices published so far
    assert dra.devices_from_slices([old, new, partial], drivers=("gpu.example.com",)) == {}
    assert dra.devices_from_slices([new]) == {}  # another driver


def claim(name: str, device: str, consumed: str | None, *, pool: str = "h100-node-a",
          driver: str = "gpu.nvidia.com", labels: dict | None = None) -> dict:
    c = yaml.safe_load((DATA / "claim-status.yaml").read_text())
    c["metadata"]["name"] = name
    c["metadata"]["labels"] = labels or {}
    [r] = c["status"]["allocation"]["devices"]["results"]
    r.update({"pool": pool, "device": device, "driver": driver})
    if consumed is None:
        r.pop("consumedCapacity")
    else:
        r["consumedCapacity"] = {"memory": consumed}
    return c


def test_foreign_claims_and_rounding_become_foreign_use() -> None:
    devs = dra.devices_from_slices([slice8()])["h100-node-a"]
    by_key = {d.key: d for d in devs}
    mine = {"app.kubernetes.io/managed-by": "vllmfit", "vllmfit.dev/deployment": "a", "vllmfit.dev/replica": "0"}
    claims = [claim("foreign", "gpu-0", "18Gi"),
              claim("whole", "gpu-2", None),  # no consumedCapacity: it holds the whole device
              claim("gpu.nvidia.com-prefixed", "gpu-3", None),
              claim("a-0-gpus-x", "gpu-1", "20Gi", labels=mine),
              claim("elsewhere", "gpu-9", "1Gi")]
    claims[2]["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = {"gpu.nvidia.com/memory": "4Gi"}
    uses = dra.consumption(claims, by_key)
    assert [(u.claim, u.device[2], u.bytes, u.deployment) for u in uses] == [
        ("llm/foreign", "gpu-0", 18 * GIB, None), ("llm/whole", "gpu-2", 81559 * MIB, None),
        ("llm/gpu.nvidia.com-prefixed", "gpu-3", 4 * GIB, None), ("llm/a-0-gpus-x", "gpu-1", 20 * GIB, "llm/a")]
    info = dra.node_from_dra("h100-node-a", {}, devs, uses, catalog.gpu_for_label,
                             booked={("h100-node-a", 1): 19 * GIB})
    foreign = {s.index: s.foreign_bytes for s in info.gpus}
    # vllmfit's own claim consumes 1 GiB more than it booked (rounded up by the device's step): counted as foreign
    assert foreign == {0: 18 * GIB, 1: 1 * GIB, 2: 81559 * MIB, 3: 4 * GIB, 4: 0, 5: 0, 6: 0, 7: 0}
    assert info.gpus[0].gpu == catalog.gpu("NVIDIA-H100-80GB-HBM3") and info.gpus[0].uuid == H100_UUID0


def test_the_agent_index_wins_and_its_foreign_use_is_a_floor() -> None:
    devs = dra.devices_from_slices([slice8()])["h100-node-a"]
    h100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    agent = NodeInfo("h100-node-a", {}, (GpuSlot("h100-node-a", 5, h100, H100_UUID0, 30 * GIB),))
    info = dra.node_from_dra("h100-node-a", {}, devs, [], catalog.gpu_for_label, agent=agent)
    slot = next(s for s in info.gpus if s.uuid == H100_UUID0)
    assert (slot.index, slot.foreign_bytes) == (5, 30 * GIB)


def tp2() -> dict:
    return dra.claim_template("llama-0", "llm", "llama", 0, [(H100_UUID0, 18 * GIB), ("GPU-9a8b", 19327352833)],
                              device_class="gpu.nvidia.com")


@pytest.mark.parametrize("version", DRA_KUBE)
def test_claim_template_validates_strictly(version: str) -> None:
    assert kubernetes_validate.validate(tp2(), version, strict=True)
    one = dra.claim_template("x-1", "llm", "x", 1, [("gpu-000", 8 * GIB)], device_class="gpu.example.com",
                             driver="gpu.example.com")
    assert kubernetes_validate.validate(one, version, strict=True)


def test_claim_template_asks_per_gpu_for_the_booked_bytes_pinned_by_uuid() -> None:
    t = tp2()
    reqs = t["spec"]["spec"]["devices"]["requests"]
    assert [r["exactly"]["capacity"]["requests"]["memory"] for r in reqs] == ["18Gi", "19327352833"]
    assert reqs[0]["exactly"]["selectors"][0]["cel"]["expression"] == \
        f'device.attributes["gpu.nvidia.com"].uuid == "{H100_UUID0}"'
    assert t["spec"]["spec"]["devices"]["constraints"] == [{"requests": ["gpu0", "gpu1"],
                                                           "distinctAttribute": "gpu.nvidia.com/uuid"}]
    assert t["spec"]["metadata"]["labels"]["vllmfit.dev/deployment"] == "llama"
    assert dra.claim_owner({"metadata": {"namespace": "llm", **t["spec"]["metadata"]}}) == ("llm/llama", 0)


def test_read_back_finds_what_the_api_server_dropped() -> None:
    sent = tp2()
    assert dra.dropped_fields(sent, copy.deepcopy(sent)) == []
    stored = copy.deepcopy(sent)  # what 1.34/1.35 keep without DRAConsumableCapacity
    for r in stored["spec"]["spec"]["devices"]["requests"]:
        r["exactly"].pop("capacity")
    stored["spec"]["spec"]["devices"]["constraints"][0].pop("distinctAttribute")
    assert dra.dropped_fields(sent, stored) == ["requests[gpu0].exactly.capacity.requests.memory",
                                                "requests[gpu1].exactly.capacity.requests.memory",
                                                "constraints[0].distinctAttribute"]
    canonical = copy.deepcopy(sent)  # the API server may re-spell a quantity: same bytes is fine
    canonical["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = "18432Mi"
    assert dra.dropped_fields(sent, canonical) == []


def test_scheduler_allocation_failures_are_recognised() -> None:
    msg = ("0/2 nodes are available: 1 cannot allocate all claims, 1 node(s) didn't match Pod's node "
           "affinity/selector. still not schedulable, preemption: 0/2 nodes are available: 2 Preemption is not "
           "helpful for scheduling.")
    pod = {"spec": {"resourceClaims": [{"name": "gpus"}]}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": msg}]}}
    assert dra.allocation_failure(pod) == msg
    gated = copy.deepcopy(pod)
    gated["status"]["conditions"][0]["reason"] = "SchedulingGated"
    assert dra.allocation_failure(gated) is None
    cpu = copy.deepcopy(pod)
    cpu["status"]["conditions"][0]["message"] = "0/2 nodes are available: 2 Insufficient cpu."
    assert dra.allocation_failure(cpu) is None


# --- issue 21 items 5, 6: every capacity, request policies, device types, counters, bounds ----------
# Written first: on the old code the template asked for memory alone (dra-example-driver's compute
# default, the whole device, took every later claim's room), MIG devices were counted as GPUs and a
# claim on one was not foreign use of its GPU, a slice's memory was replaced by the catalog's, and
# numbers from slices and claims were taken unbounded.

def compute_slice(n: int = 1) -> dict:
    """dra-example-driver v0.4.0's GPU profile: a `compute` capacity next to `memory`."""
    s = example_slice(n=n)
    for d in s["spec"]["devices"]:
        d["capacity"]["compute"] = {"value": "100", "requestPolicy": {
            "default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}}
    return s


@pytest.mark.parametrize("version", DRA_KUBE)
def test_every_capacity_a_device_publishes_is_requested_within_its_policy(version: str) -> None:
    [dev] = dra.devices_from_slices([compute_slice()], drivers=("gpu.example.com",))["kind-worker"]
    assert [c.name for c in dev.capacities] == ["compute", "memory"]
    t = dra.claim_template("x-0", "llm", "x", 0, [(dev.uuid, 16 * GIB)], device_class="gpu.example.com",
                           driver="gpu.example.com", devices=[dev])
    [req] = t["spec"]["spec"]["devices"]["requests"]
    # memory as booked (the scheduler rounds it to the 8Gi step), compute at the least the range allows
    assert req["exactly"]["capacity"]["requests"] == {"compute": "1", "memory": "16Gi"}
    assert kubernetes_validate.validate(t, version, strict=True)


def test_capacities_without_a_policy_and_with_valid_values() -> None:
    s = example_slice(n=1)
    caps = s["spec"]["devices"][0]["capacity"]
    caps["cores"] = {"value": "64"}  # no policy: any amount; left out it would take all 64
    caps["slots"] = {"value": "8", "requestPolicy": {"default": "8", "validValues": ["2", "4", "8"]}}
    [dev] = dra.devices_from_slices([s], drivers=("gpu.example.com",))["kind-worker"]
    assert dra.capacity_requests(dev, 10 * GIB) == {"cores": "1", "memory": "10Gi", "slots": "2"}


def test_a_request_the_policy_cannot_grant_is_refused_before_anything_is_written() -> None:
    s = example_slice(n=1)
    s["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"] = {"default": "20Gi",
                                                                      "validValues": ["10Gi", "20Gi"]}
    [dev] = dra.devices_from_slices([s], drivers=("gpu.example.com",))["kind-worker"]
    assert dra.capacity_requests(dev, 15 * GIB) == {"memory": "15Gi"}  # rounded to 20Gi by the scheduler
    with pytest.raises(dra.Unsatisfiable, match="'memory' capacity cannot grant 30Gi"):
        dra.capacity_requests(dev, 30 * GIB)


@pytest.mark.parametrize("q,want,got", [
    ({"validRange": {"min": "8Gi", "max": "80Gi", "step": "8Gi"}}, 9 * GIB, 16 * GIB),
    ({"validRange": {"min": "8Gi", "max": "80Gi", "step": "8Gi"}}, 1, 8 * GIB),
    ({"validRange": {"min": "8Gi", "max": "80Gi", "step": "8Gi"}}, 81 * GIB, None),
    ({"validRange": {"min": "1Mi"}}, 5 * GIB + 1, 5 * GIB + 1),  # no step: as asked
    ({"validValues": ["4Gi", "2Gi"]}, 3 * GIB, 4 * GIB),
])
def test_rounding_follows_the_scheduler(q: dict, want: int, got: int | None) -> None:
    policy = dra._policy(q)
    assert policy is not None and policy.rounded(want) == got


def mig_slice() -> dict:
    """NVIDIA's driver with MIG: whole GPU gpu-0 and its MIG device, both consuming counter set gpu-0-counters."""
    s = slice8()
    s["spec"]["devices"] = s["spec"]["devices"][:2]
    whole = s["spec"]["devices"][0]
    whole["attributes"]["type"] = {"string": "gpu"}
    whole["consumesCounters"] = [{"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "81559Mi"}}}]
    mig = {"name": "gpu-0-mig-3g40gb-0", "attributes": {"type": {"string": "mig"}, "profile": {"string": "3g.40gb"},
                                                        "uuid": {"string": "MIG-1"},
                                                        "parentUUID": {"string": H100_UUID0}},
           "capacity": {"memory": {"value": "40192Mi"}}}
    counted = {"name": "gpu-0-part", "attributes": {"type": {"string": "mig"}},
               "consumesCounters": [{"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "10Gi"}}}],
               "capacity": {"memory": {"value": "10Gi"}}}
    s["spec"]["devices"] += [mig, counted]
    return s


def test_mig_devices_are_not_gpus_and_a_claim_on_one_is_foreign_use_of_its_gpu() -> None:
    devs = dra.devices_from_slices([mig_slice()])["h100-node-a"]
    assert [d.name for d in devs] == ["gpu-0", "gpu-1"]  # the MIG devices are not counted as GPUs
    by_key = {d.key: d for d in devs}
    uses = dra.consumption([claim("mig-job", "gpu-0-mig-3g40gb-0", None), claim("part", "gpu-0-part", None)], by_key)
    assert [(u.claim, u.device[2], u.bytes) for u in uses] == [
        ("llm/mig-job", "gpu-0", 40192 * MIB),  # by parentUUID
        ("llm/part", "gpu-0", 10 * GIB)]  # by the shared counter set
    info = dra.node_from_dra("h100-node-a", {}, devs, uses, catalog.gpu_for_label)
    assert {s.index: s.foreign_bytes for s in info.gpus} == {0: 40192 * MIB + 10 * GIB, 1: 0}


def test_values_from_the_cluster_are_bounded() -> None:
    s = slice8()
    s["spec"]["devices"][0]["capacity"]["memory"]["value"] = "1Pi"  # more than any GPU
    s["spec"]["devices"][1]["capacity"]["memory"]["value"] = "1e400"
    s["spec"]["devices"][2]["capacity"] = {f"c{i}": {"value": "1"} for i in range(40)}  # too many capacities
    s["spec"]["devices"][3]["attributes"]["index"] = {"int": 10**9}  # an index no node has: ignored
    devs = dra.devices_from_slices([s])["h100-node-a"]
    assert [d.name for d in devs] == ["gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7"]
    assert devs[0].index is None
    huge = example_slice(n=dra.limits.MAX_GPUS_PER_NODE + 1)
    assert dra.devices_from_slices([huge], drivers=("gpu.example.com",)) == {}  # more GPUs than a node has
    by_key = {d.key: d for d in devs}
    [u] = dra.consumption([claim("big", "gpu-3", "100Ti")], by_key)
    assert u.bytes == 81559 * MIB  # never more than the device has


def test_a_catalog_entry_never_replaces_the_memory_a_slice_reports() -> None:
    s = slice8()
    s["spec"]["devices"] = s["spec"]["devices"][:1]
    s["spec"]["devices"][0]["capacity"]["memory"]["value"] = "40Gi"  # named H100 80GB, publishes 40 GiB
    devs = dra.devices_from_slices([s])["h100-node-a"]
    info = dra.node_from_dra("h100-node-a", {}, devs, [], catalog.gpu_for_label)
    h100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    gpu = info.gpus[0].gpu
    assert gpu.memory_bytes == 40 * GIB
    assert gpu.cuda_total_bytes == 40 * GIB - (h100.memory_bytes - h100.cuda_total_bytes)


def test_a_dra_node_keeps_the_taints_and_cordon_of_its_node_object() -> None:
    from dataclasses import replace

    from vllmfit.core.placement import taints
    devs = dra.devices_from_slices([slice8()])["h100-node-a"]
    facts = replace(NodeInfo("h100-node-a", {}, ()), taints=(taints.Taint("k", "v", "NoSchedule"),), unschedulable=True)
    info = dra.node_from_dra("h100-node-a", {}, devs, [], catalog.gpu_for_label, facts=facts)
    assert info.taints == facts.taints and info.unschedulable
