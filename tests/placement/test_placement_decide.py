"""decide: pinned, rescheduled, selectors, groups, replicas, MIG, messages and checked fixes."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml
from placement_fakes import A100_40, H100, L4, LLAMA_8B, QWEN_05B, check_invariant, node, request

from vllmfit.core import defaults, memory, placement
from vllmfit.core.observe.inventory import GpuInventory, InventoryGpu, InventoryMigDevice, InventoryProcess
from vllmfit.sources import catalog

SMALL = {"maxModelLen": 8192, "kvCache": {"concurrency": 8}}


def _ledger(*nodes: placement.NodeInfo) -> placement.Ledger:
    return placement.Ledger(nodes)


def _fill(ledger: placement.Ledger, node_name: str, index: int, name: str = "filler", **spec: object) -> None:
    """Book a deployment pinned to one GPU (to make room scarce there)."""
    d = placement.decide(
        ledger,
        request(
            name,
            LLAMA_8B,
            placement={"nodeName": node_name, "gpuIndices": [index], "allowReschedule": False},
            **spec,
        ),
    )
    assert d.admitted, d.message
    ledger.book(d)


def _apply(req: placement.Request, fix: str) -> placement.Request:
    """A 'field: value' suggestion applied to the spec (placement.* fields included)."""
    spec = req.spec.model_dump(by_alias=True, exclude_none=True)
    for part in fix.split(", "):
        key, _, value = part.partition(": ")
        parsed = json.loads(value) if value[:1] in "[0123456789" or value in ("true", "false") else value
        if value.startswith("{"):  # kvCache: {tokens: N} replaces the KV request
            parsed = yaml.safe_load(value)
        if key.startswith("placement."):
            field = key.removeprefix("placement.")
            if value.startswith("remove"):
                spec["placement"].pop(field, None)
            else:
                spec["placement"][field] = parsed
        elif "." in key:
            head, _, sub = key.partition(".")
            spec[head] = {**spec.get(head, {}), sub: parsed}
        else:
            spec[key] = parsed
    return placement.Request(req.key, type(req.spec).model_validate(spec), req.model, req.order)


def test_pinned_gpu_is_used_even_when_best_fit_would_pick_another() -> None:
    ledger = _ledger(node("a", H100, 2))
    _fill(ledger, "a", 0, **SMALL)
    d = placement.decide(ledger, request("d", placement={"nodeName": "a", "gpuIndices": [1]}, **SMALL))
    assert d.admitted and d.replicas[0].gpus == (1,) and not d.moved


def test_pinned_overfit_without_reschedule_is_unschedulable_with_a_checked_fix_elsewhere() -> None:
    ledger = _ledger(node("a", H100, 1), node("b", H100, 1))
    _fill(ledger, "a", 0, maxModelLen=65536, kvCache={"concurrency": 6})  # leaves about 11 GiB on a/0
    req = request("d", placement={"nodeName": "a", "gpuIndices": [0], "allowReschedule": False}, **SMALL)
    d = placement.decide(ledger, req)
    assert d.phase == "Unschedulable"
    head = ledger.headroom_bytes("a", 0)
    assert d.message.startswith("pinned placement does not fit: a: GPU 0 needs ")
    assert f"{memory.fmt_gib(head)} of budget left" in d.message
    assert "placement.nodeName: b, placement.gpuIndices: [0]" in d.suggestions
    assert "placement.allowReschedule: true" in d.suggestions
    for fix in d.suggestions:  # every suggestion, applied, fits
        assert placement.decide(ledger, _apply(req, fix)).admitted, fix


def test_pinned_overfit_with_reschedule_moves_with_a_warning() -> None:
    ledger = _ledger(node("a", H100, 1), node("b", H100, 1))
    _fill(ledger, "a", 0, maxModelLen=65536, kvCache={"concurrency": 6})
    d = placement.decide(ledger, request("d", placement={"nodeName": "a", "gpuIndices": [0]}, **SMALL))
    assert d.admitted and d.moved and d.replicas[0].node == "b"
    assert any(
        w.startswith("pinned placement does not fit (a: GPU 0 needs")
        and w.endswith("placed on b GPU 0 instead")
        for w in d.warnings
    )


@pytest.mark.parametrize(
    "pin,why",
    [
        ({"nodeName": "a", "gpuIndices": [7]}, "a: GPU 7 does not exist (GPUs: 0, 1)"),
        ({"nodeName": "zz"}, "zz: node not found"),
        ({"nodeName": "a", "nodeSelector": {"pool": "x"}}, "a: does not match the nodeSelector"),
    ],
)
def test_impossible_pins_say_why(pin: dict, why: str) -> None:
    ledger = _ledger(node("a", H100, 2))
    d = placement.decide(ledger, request("d", placement={**pin, "allowReschedule": False}, **SMALL))
    assert d.phase == "Unschedulable" and d.reasons == (why,)


@pytest.mark.parametrize(
    "spec,reason",
    [
        (
            {"tensorParallelSize": 2, "placement": {"nodeName": "a", "gpuIndices": [0]}},
            "placement.gpuIndices lists 1 GPUs; tensorParallelSize x pipelineParallelSize is 2",
        ),
        (
            {"replicas": 2, "placement": {"nodeName": "a", "gpuIndices": [0]}},
            "placement.gpuIndices pins one GPU group; set replicas: 1 or drop gpuIndices",
        ),
        ({"placement": {"gpuIndices": [0]}}, "placement.gpuIndices requires placement.nodeName"),
        (
            {"maxModelLen": 262144},
            "max_model_len 262144 exceeds what meta-llama/Llama-3.1-8B-Instruct supports",
        ),
    ],
)
def test_invalid_specs_are_rejected(spec: dict, reason: str) -> None:
    d = placement.decide(_ledger(node("a", H100, 2)), request("d", **spec))
    assert d.phase == "Rejected"
    assert any(r.startswith(reason) for r in d.reasons), d.reasons


def test_node_selector_limits_the_search_and_the_fix_drops_it() -> None:
    ledger = _ledger(node("a", H100, 1, labels={"pool": "big"}), node("b", L4, 1, labels={"pool": "small"}))
    ok = placement.decide(ledger, request("d", placement={"nodeSelector": {"pool": "big"}}, **SMALL))
    assert ok.admitted and ok.replicas[0].node == "a"
    req = request("e", placement={"nodeSelector": {"pool": "small"}}, **SMALL)
    d = placement.decide(ledger, req)
    assert d.phase == "Unschedulable"
    assert d.reasons[0].startswith("1 GPU memory (needs at least ")
    assert d.reasons[0].endswith(f", largest budget left {memory.fmt_gib(ledger.headroom_bytes('b', 0))} on b GPU 0)")
    assert d.reasons[1] == "1 node(s) didn't match placement.nodeSelector"
    assert "placement.nodeSelector: remove (fits on a)" in d.suggestions


def test_best_fit_packs_and_spread_spreads() -> None:
    # three GPUs: packing GPU 1 leaves GPUs 0 and 2 whole, room for a TP 2 group (search.keep_room)
    ledger = _ledger(node("a", H100, 3))
    _fill(ledger, "a", 1, **SMALL)
    packed = placement.decide(ledger, request("d", maxModelLen=4096, kvCache={"concurrency": 2}))
    spread = placement.decide(
        ledger, request("d", maxModelLen=4096, kvCache={"concurrency": 2}, placement={"policy": "spread"})
    )
    assert packed.replicas[0].gpus == (1,)  # least headroom that still fits
    assert spread.replicas[0].gpus == (0,)  # most headroom


def test_a_group_needs_tp_gpus_of_one_node() -> None:
    ledger = _ledger(node("a", H100, 1), node("b", H100, 1))
    d = placement.decide(ledger, request("tp2", tensorParallelSize=2, **SMALL))
    assert d.phase == "Unschedulable"
    assert d.message.startswith(
        "0/2 nodes are available: 2 node(s) had fewer than 2 GPUs of one type (at most 1)."
    )
    assert "tensorParallelSize: 2" not in d.suggestions


def test_a_group_takes_the_tightest_gpus_that_fit() -> None:
    ledger = _ledger(node("a", H100, 4))
    _fill(ledger, "a", 1, "f1", maxModelLen=8192, kvCache={"concurrency": 4})
    _fill(ledger, "a", 3, "f3", maxModelLen=8192, kvCache={"concurrency": 8})
    d = placement.decide(ledger, request("tp2", tensorParallelSize=2, maxModelLen=8192, kvCache={"concurrency": 8}))
    assert d.admitted and d.replicas[0].gpus == (1, 3)
    ledger.book(d)
    check_invariant(ledger)


def test_replicas_share_context_and_concurrency() -> None:
    """Unset context: replica 0 picks it; the others run the same (on different headroom)."""
    ledger = _ledger(node("a", H100, 3))
    _fill(ledger, "a", 1, "f1", maxModelLen=8192, kvCache={"concurrency": 8})
    _fill(ledger, "a", 2, "f2", maxModelLen=16384, kvCache={"concurrency": 8})
    d = placement.decide(ledger, request("r", replicas=3, kvCache={"concurrency": 4}))
    assert d.admitted
    lens = {r.sizing.flags.max_model_len for r in d.replicas}
    seqs = {r.sizing.flags.max_num_seqs for r in d.replicas}
    kv = {r.sizing.footprint.kv_cache for r in d.replicas}
    assert len(lens) == 1 and len(seqs) == 1 and len(kv) == 1
    ledger.book(d)
    check_invariant(ledger)


def test_partial_replicas_report_what_was_placed() -> None:
    ledger = _ledger(node("a", H100, 1))
    d = placement.decide(ledger, request("r", replicas=4, maxModelLen=16384, kvCache={"concurrency": 6}))
    assert d.phase == "Unschedulable"
    assert d.message.startswith("2/4 replicas placed; replica 2: 0/1 nodes are available: 1 GPU memory (needs ")
    assert "replicas: 2" in d.suggestions


def test_adding_a_deployment_never_moves_the_ones_before() -> None:
    nodes = [node("a", H100, 2), node("b", A100_40, 2)]
    reqs = [
        request(
            f"d{i}",
            LLAMA_8B if i % 2 else QWEN_05B,
            f"{i:02d}",
            maxModelLen=4096 * (1 + i % 3),
            kvCache={"concurrency": 1 + i % 5},
        )
        for i in range(10)
    ]
    before = placement.plan(nodes, reqs)
    after = placement.plan(nodes, [*reqs, request("late", LLAMA_8B, "99", maxModelLen=32768, kvCache={"concurrency": 8})])
    for r in reqs:
        assert after.decisions[r.key] == before.decisions[r.key]


def test_unschedulable_message_groups_nodes_like_the_scheduler() -> None:
    ledger = _ledger(node("a", H100, 1), node("b", A100_40, 2), node("c", L4, 1))
    _fill(ledger, "a", 0, maxModelLen=65536, kvCache={"concurrency": 6})
    d = placement.decide(ledger, request("big", maxModelLen=32768, kvCache={"concurrency": 8}))
    assert d.phase == "Unschedulable"
    fit = memory.fmt_gib
    # two needs: the H100 tier's vLLM default max_num_seqs (1024, not 256) enlarges the profile run's
    # logits; the A100 40GB and the L4 share one, with the best candidate's numbers: the empty A100
    # 40GB (0.9 x capacity, the counted policy). "at least": maxNumBatchedTokens is unset, so memory.size may
    # lower it. Then the budget policy and what it holds back of each GPU.
    m = re.match(
        r"0/3 nodes are available: 1 GPU memory \(NVIDIA-H100-80GB-HBM3: needs at least [\d.]+ GiB, largest budget "
        r"left [\d.]+ GiB on a GPU 0\), 2 GPU memory \(NVIDIA-A100-SXM4-40GB/NVIDIA-L4: needs at least (\d+\.\d) GiB, "
        r"largest budget left (\d+\.\d) GiB on b GPU 0\)\. Fits with: ",
        d.message,
    )
    assert m, d.message
    assert (
        m.group(2) + " GiB"
        == fit(ledger.headroom_bytes("b", 0))
        == fit(math.ceil(0.9 * A100_40.cuda_total_bytes) + int(0.55 * (1 << 30)))
    )
    assert ledger.headroom_bytes("b", 0) > max(ledger.headroom_bytes("c", 0), ledger.headroom_bytes("a", 0))
    assert d.suggestions, "some change fits (a shorter context at least)"
    for fix in d.suggestions:
        assert placement.decide(
            ledger, _apply(request("big", maxModelLen=32768, kvCache={"concurrency": 8}), fix)
        ).admitted, fix


# --- Nodes from objects --------------------------------------------------------------------------


def _node_obj(name: str, labels: dict | None = None, inventory: GpuInventory | None = None) -> dict:
    ann = {defaults.INVENTORY_ANNOTATION: inventory.model_dump_json(by_alias=True)} if inventory else {}
    return {"metadata": {"name": name, "labels": labels or {}, "annotations": ann}}


def test_gfd_labels_give_whole_gpus() -> None:
    n = placement.node_from_object(
        _node_obj("g", {defaults.GFD_PRODUCT_LABEL: "NVIDIA-L4", defaults.GFD_COUNT_LABEL: "2"}),
        catalog.gpu_for_label,
    )
    assert [(s.index, s.gpu.product, s.foreign_bytes) for s in n.gpus] == [
        (0, "NVIDIA-L4", 0),
        (1, "NVIDIA-L4", 0),
    ]


def test_a_node_without_gpu_information_is_an_error() -> None:
    with pytest.raises(ValueError, match="node cpu-1 has no GPU information"):
        placement.node_from_object(_node_obj("cpu-1"), catalog.gpu_for_label)


def test_inventory_foreign_use_and_mig_slices() -> None:
    mig_total = 42144366592
    inv = GpuInventory(
        sampled_at="2025-01-01T00:00:00Z",
        gpus=[
            InventoryGpu(
                index=0,
                uuid="GPU-0",
                product="NVIDIA-L40S",
                total_bytes=48305799168,
                used_bytes=(12 << 30) + (20 << 30) + (1 << 30),
                processes=[
                    InventoryProcess(pid=1, used_bytes=12 << 30, pod_uid="notebook"),
                    InventoryProcess(pid=2, used_bytes=20 << 30, pod_uid="vllm-pod"),
                ],
            ),
            InventoryGpu(
                index=1,
                uuid="GPU-1",
                product="NVIDIA-A100-SXM4-80GB",
                total_bytes=85899345920,
                mig_enabled=True,
                mig_devices=[
                    InventoryMigDevice(index=0, uuid="MIG-a", profile="3g.40gb", total_bytes=mig_total),
                    InventoryMigDevice(index=1, uuid="MIG-b", profile="3g.40gb", total_bytes=mig_total),
                ],
            ),
            InventoryGpu(
                index=2, uuid="GPU-2", product="NVIDIA-L40S", total_bytes=0, error="memory: GPU is lost"
            ),
        ],
    )
    n = placement.node_from_object(_node_obj("d", inventory=inv), catalog.gpu_for_label, {"vllm-pod": "ns/x"})
    # GPU 0: foreign = the notebook's 12 GiB + 1 GiB no process explains; the vllmfit pod's 20 GiB is booked
    # GPU 1 (MIG): slices 0 and 1 are units 1000 x (1 + 1) + 0 = 2000 and 2001, T = the slice's memory
    assert [(s.index, s.foreign_bytes, s.mig, s.capacity_bytes) for s in n.gpus] == [
        (0, 13 << 30, False, catalog.gpu("NVIDIA-L40S").cuda_total_bytes),
        (2000, 0, True, mig_total),
        (2001, 0, True, mig_total),
    ]
    assert n.gpus[1].gpu.product == "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb" and n.gpus[1].label == "GPU 1 MIG 0"
    assert any("GPU 2: unusable" in w for w in n.warnings)
    # a MIG slice hosts single-GPU deployments only
    ledger = placement.Ledger([n])
    one = placement.decide(
        ledger,
        request(
            "m", QWEN_05B, maxModelLen=4096, kvCache={"concurrency": 4}, placement={"nodeName": "d", "gpuIndices": [2000]}
        ),
    )
    assert one.admitted and one.message == "admitted on d GPU 1 MIG 0"
    two = placement.decide(
        ledger,
        request(
            "t",
            QWEN_05B,
            tensorParallelSize=2,
            maxModelLen=4096,
            kvCache={"concurrency": 4},
            placement={"nodeName": "d", "gpuIndices": [2000, 2001], "allowReschedule": False},
        ),
    )
    assert two.phase == "Unschedulable" and "MIG slices cannot form" in two.message


def test_a_broken_inventory_annotation_is_one_line() -> None:
    obj = {"metadata": {"name": "x", "annotations": {defaults.INVENTORY_ANNOTATION: "{not json"}}}
    with pytest.raises(
        ValueError, match="^node x: annotation vllmfit.dev/gpu-inventory is not a GPU inventory"
    ):
        placement.node_from_object(obj, catalog.gpu_for_label)


def test_unknown_layer_type_warns_and_strict_refuses() -> None:
    """Issue 13: a layer type the memory model does not know is never silent: a warning on the
    decision (the operator's ModelUnderstood condition, the webhook's admission warning), and with
    spec.strict a refusal that names it."""
    from dataclasses import replace as dc_replace

    odd = dc_replace(LLAMA_8B, warnings=("odd: layer type 'hyena_filter' is not modelled; the estimate may be wrong",))
    ledger = _ledger(node("a", H100, 1))
    d = placement.decide(ledger, request("d", odd, **SMALL))
    assert d.admitted and any("hyena_filter" in w for w in d.warnings)
    refused = placement.decide(ledger, request("s", odd, strict=True, **SMALL))
    assert not refused.admitted and "hyena_filter" in refused.message and "strict" in refused.message
