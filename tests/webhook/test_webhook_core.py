"""The webhook's pure part: parsing messages, defaults, shrink detection, verdicts on a ledger.

Expected values come from elsewhere than the code under test: pydantic's own dump of the spec
defaults, memory.size/budget_bytes for the numbers in messages, and hand-built ledgers whose
answer is known (a full node, a free node).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import pytest
import yaml
from webhook_harness import H100, FakeStore, gfd_node

from vllmfit.core import memory, placement
from vllmfit.core.defaults import GIB
from vllmfit.core.memory import fmt_gib
from vllmfit.core.spec import api, read
from vllmfit.operator.admission import verdict, webhook
from vllmfit.sources import catalog

MODEL_8B = "meta-llama/Llama-3.1-8B-Instruct"


def ledger(*nodes: dict) -> placement.Ledger:
    return placement.Ledger(placement.node_from_object(n, catalog.gpu_for_label) for n in nodes)


def request(name: str = "a", namespace: str = "default", **spec) -> placement.Request:
    obj = api.VLLMDeployment.model_validate({"metadata": {"name": name, "namespace": namespace}, "spec": spec})
    return placement.request_from_object(obj, catalog.model(obj.spec.model))


def usage(led: placement.Ledger) -> dict[tuple[str, int], int]:
    return {(s.node, s.index): led.used_bytes(s.node, s.index) for s in led.slots()}


def footprint(spec: dict, product: str = H100) -> int:
    """The per-GPU bytes of `spec` on an empty GPU, straight from the memory model."""
    req = request(**spec)
    gpu = catalog.gpu(product)
    s = placement.settings_from_spec(req.spec)
    return memory.size(req.model, s, gpu, memory.budget_bytes(gpu.cuda_total_bytes)).footprint.total


# --- read.deployment / read.message ----------------------------------------------------------


@pytest.mark.parametrize(("spec", "field", "got"), [
    ({"model": MODEL_8B, "tensorParallelSize": 0}, "spec.tensorParallelSize", "(got 0)"),
    ({"model": MODEL_8B, "replicas": "three"}, "spec.replicas", "(got 'three')"),
    ({"model": MODEL_8B, "dtype": "int3"}, "spec.dtype", "(got 'int3')"),
    ({"model": MODEL_8B, "placement": {"gpuIndices": ["x"]}}, "spec.placement.gpuIndices.0", "(got 'x')"),
    ({"model": MODEL_8B, "gpuMemoryUtilization": 1.5}, "spec.gpuMemoryUtilization", "(got 1.5)"),
    ({"model": MODEL_8B, "surprise": 1}, "spec.surprise", "unknown field"),
    ({}, "spec.model", "Field required"),
])
def test_a_pydantic_error_is_one_line_naming_the_field(spec, field, got):
    with pytest.raises(webhook.Invalid) as e:
        read.deployment({"metadata": {"name": "a"}, "spec": spec})
    msg = str(e.value)
    assert msg.startswith(field + ": ") and got in msg and "\n" not in msg


def test_several_errors_are_counted_in_the_one_line():
    with pytest.raises(webhook.Invalid) as e:
        read.deployment({"metadata": {"name": "a"}, "spec": {"model": "", "replicas": -1, "tensorParallelSize": 99}})
    assert "; 2 more: spec.tensorParallelSize, spec.replicas" in str(e.value)  # in field order


def test_generate_name_stands_in_for_a_missing_name():
    obj = read.deployment({"metadata": {"generateName": "llm-"}, "spec": {"model": MODEL_8B}})
    assert obj.metadata.name.startswith("llm-")


# --- defaults_patch -----------------------------------------------------------------------------


def pydantic_defaults(spec: dict) -> dict:
    """What pydantic itself says the spec means, in the JSON users write (unset Nones and empty lists
    left out: they mean 'unset' and are not written by the webhook)."""
    dumped = api.VLLMDeploymentSpec.model_validate(spec).model_dump(mode="json", by_alias=True, exclude_none=True)
    return {k: v for k, v in dumped.items() if v != []}


def merge(base: dict, patch: dict) -> dict:
    out = dict(base)
    for k, v in patch.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.mark.parametrize("spec", [
    {"model": MODEL_8B},
    {"model": MODEL_8B, "placement": {"nodeName": "gpu-node-a"}},
    {"model": MODEL_8B, "hfTokenSecretRef": {"name": "hf"}, "modelConfigRef": {"name": "cfg"}},
    {"model": MODEL_8B, "replicas": 0, "enforceEager": True, "image": "vllm/vllm-openai:v0.10.1"},
])
def test_defaults_patch_makes_the_stored_spec_what_pydantic_reads(spec):
    patch = webhook.defaults_patch(spec)
    assert merge(spec, patch) == pydantic_defaults(spec)
    assert all(spec.get(k) != v for k, v in patch.items() if not isinstance(v, dict))  # never overwrites


def test_defaults_patch_names_the_pinned_image_and_never_computed_flags():
    patch = webhook.defaults_patch({"model": MODEL_8B})
    assert patch["image"] == api.VLLMDeploymentSpec.model_fields["image"].default
    assert patch["placement"] == {"allowReschedule": True, "policy": "bestFit"}
    assert not {"maxModelLen", "maxNumSeqs", "gpuMemoryUtilization", "maxNumBatchedTokens"} & set(patch)
    assert webhook.defaults_patch(pydantic_defaults({"model": MODEL_8B})) == {}


def test_the_operators_default_image_replaces_the_pydantic_default():
    assert webhook.defaults_patch({"model": MODEL_8B}, overrides={"image": "registry.local/vllm:v0.9.2"})[
        "image"] == "registry.local/vllm:v0.9.2"
    assert "image" not in webhook.defaults_patch({"model": MODEL_8B, "image": "mine"}, overrides={"image": "x"})


@pytest.mark.parametrize("spec", [{"placement": "here"}, {"placement": None}, {"hfTokenSecretRef": []}, {}])
def test_defaults_patch_leaves_wrong_types_to_the_validator(spec):
    patch = webhook.defaults_patch(spec)
    assert not set(patch) & set(spec)


# --- is_shrink ----------------------------------------------------------------------------------


def spec_of(**kw) -> api.VLLMDeploymentSpec:
    return api.VLLMDeploymentSpec.model_validate({"model": MODEL_8B, **kw})


@pytest.mark.parametrize(("old", "new", "shrink"), [
    ({"replicas": 3}, {"replicas": 1}, True),
    ({"maxModelLen": 32768}, {"maxModelLen": 8192}, True),
    ({"maxModelLen": 32768, "kvCache": {"concurrency": 16}}, {"maxModelLen": 8192, "kvCache": {"concurrency": 8}}, True),
    ({}, {"enforceEager": True}, True),
    ({"gpuMemoryUtilization": 0.5}, {"gpuMemoryUtilization": 0.4}, True),
    ({"maxModelLen": 8192}, {"maxModelLen": 32768}, False),
    ({}, {"maxModelLen": 8192}, False),  # unset means computed: not comparable
    ({"replicas": 3}, {"replicas": 1, "tensorParallelSize": 2}, False),
    ({}, {"model": "Qwen/Qwen2.5-0.5B-Instruct"}, False),
    ({}, {"env": [{"name": "X", "value": "1"}]}, False),  # no memory change at all
    ({}, {}, False),
])
def test_is_shrink(old, new, shrink):
    assert verdict.is_shrink(spec_of(**old), spec_of(**new)) is shrink


# --- check --------------------------------------------------------------------------------------


def test_a_spec_that_fits_is_allowed_without_warnings():
    led = ledger(gfd_node("gpu-node-a", 1))
    v = webhook.check(led, request(model=MODEL_8B, maxModelLen=8192))
    assert v == webhook.Verdict(True)


def test_a_reduced_context_is_admitted_with_a_warning():
    led = ledger(gfd_node("gpu-node-a", 1))
    v = webhook.check(led, request(model=MODEL_8B, kvCache={"concurrency": 8}))  # 131072 tokens x 8 do not fit
    assert v.allowed and any("context reduced" in w for w in v.warnings)


def test_a_group_mixing_capacities_is_admitted_with_a_warning():
    inv = {"sampledAt": "2026-01-01T00:00:00Z", "gpus": [
        {"index": 0, "uuid": "GPU-0", "product": H100, "totalBytes": 81559 << 20},
        {"index": 1, "uuid": "GPU-1", "product": "NVIDIA-H100-NVL", "totalBytes": 95830 << 20}]}
    node = {"metadata": {"name": "mixed", "annotations": {"vllmfit.dev/gpu-inventory": json.dumps(inv)}}}
    pinned = {"nodeName": "mixed", "gpuIndices": [0, 1]}  # unpinned, placement only groups equal GPUs
    v = webhook.check(ledger(node), request(model=MODEL_8B, maxModelLen=8192, tensorParallelSize=2, placement=pinned))
    assert v.allowed and any("mix capacities" in w for w in v.warnings)


def test_a_spec_that_fits_nowhere_is_denied_with_per_gpu_numbers_and_checked_fixes():
    spec = {"model": MODEL_8B, "maxModelLen": 131072, "kvCache": {"concurrency": 64}}
    led = ledger(gfd_node("gpu-node-a", 1))
    v = webhook.check(led, request(**spec))
    need, budget = footprint(spec), memory.DEFAULT_POLICY.budget(catalog.gpu(H100).cuda_total_bytes)
    assert not v.allowed and v.code == 403
    m = re.match(rf"0/1 nodes are available: 1 GPU memory \(needs (?:at least )?([\d.]+) GiB, "
                 rf"largest budget left {re.escape(fmt_gib(budget))} on gpu-node-a GPU 0\)\. Fits with: ", v.message)
    assert "Budget policy" not in v.message  # 970 GiB short is not the policy's doing (issue 31)
    assert m, v.message
    assert budget / GIB < float(m[1]) <= round(need / GIB, 1)  # the need may be a lower bound, never more
    fixes = v.message.split("Fits with: ", 1)[1].split("; or ")
    assert fixes
    for fix in fixes:  # each suggested change, applied to the spec, really fits
        if fix.startswith("budget policy"):
            continue  # a policy change, not a spec change
        change: dict = {}
        for part in fix.split(", "):  # "key: value" or "kvCache.tokens: N", comma-joined when combined
            key, _, value = part.partition(": ")
            head, _, sub = key.partition(".")
            parsed = yaml.safe_load(value)
            if sub:
                change.setdefault(head, {})[sub] = parsed
            else:
                change[key] = parsed
        assert placement.decide(led, request(**{**spec, **change})).admitted, fix


def full_and_free() -> tuple[placement.Ledger, dict]:
    """gpu-node-a's only GPU taken by 'hog'; gpu-node-b free."""
    led = ledger(gfd_node("gpu-node-a", 1), gfd_node("gpu-node-b", 1))
    hog = request("hog", model=MODEL_8B, maxModelLen=40960, kvCache={"concurrency": 8},
                  placement={"nodeName": "gpu-node-a"})
    d = placement.decide(led, hog)
    assert d.admitted and d.replicas[0].node == "gpu-node-a"
    led.book(d)
    return led, {"model": MODEL_8B, "maxModelLen": 32768, "kvCache": {"concurrency": 8}}


def test_pinned_where_it_does_not_fit_is_moved_with_a_warning_when_allowed():
    led, spec = full_and_free()
    v = webhook.check(led, request(**spec, placement={"nodeName": "gpu-node-a"}))
    assert v.allowed and any("gpu-node-b" in w for w in v.warnings)


def test_pinned_where_it_does_not_fit_is_denied_naming_where_it_would_fit():
    led, spec = full_and_free()
    v = webhook.check(led, request(**spec, placement={"nodeName": "gpu-node-a", "allowReschedule": False}))
    assert not v.allowed and v.code == 403
    assert "It fits on gpu-node-b GPU [0]" in v.message and "allowReschedule" in v.message


def test_a_spec_the_memory_model_refuses_is_invalid():
    v = webhook.check(ledger(gfd_node("gpu-node-a", 8)), request(model=MODEL_8B, tensorParallelSize=3))
    assert not v.allowed and v.code == 422 and v.message


def test_dry_run_says_where_and_books_nothing():
    led = ledger(gfd_node("gpu-node-a", 1))
    before = usage(led)
    v = webhook.check(led, request(model=MODEL_8B, maxModelLen=8192), dry_run=True)
    assert v.allowed and any("would be placed on gpu-node-a GPU [0]" in w for w in v.warnings)
    assert usage(led) == before and led.deployments() == []


# --- updates ------------------------------------------------------------------------------------


def test_an_update_is_checked_with_its_own_allocation_released():
    led = ledger(gfd_node("gpu-node-a", 1))
    old = {"model": MODEL_8B, "maxModelLen": 32768, "kvCache": {"concurrency": 8}}
    led.book(placement.decide(led, request("a", **old)))
    new = {"model": MODEL_8B, "maxModelLen": 40960, "kvCache": {"concurrency": 8}}
    # precondition: as a second deployment it would not fit next to the first, alone it does
    assert not placement.decide(led, request("b", **new)).admitted
    assert footprint(new) <= memory.budget_bytes(catalog.gpu(H100).cuda_total_bytes)
    assert webhook.check(led, request("a", **new), old=spec_of(**old)).allowed
    bigger = {"model": MODEL_8B, "maxModelLen": 131072, "kvCache": {"concurrency": 64}}
    assert not webhook.check(led, request("a", **bigger), old=spec_of(**old)).allowed


def test_an_update_that_shrinks_is_always_admitted():
    led = ledger(gfd_node("gpu-node-a", 1))
    old = {"model": MODEL_8B, "maxModelLen": 40960, "replicas": 1}
    led.book(placement.decide(led, request("a", **old)))
    # a process vllmfit does not manage now takes most of the GPU: the node is overcommitted
    node = led.nodes["gpu-node-a"]
    slot = dataclasses.replace(node.gpus[0], foreign_bytes=60 << 30)
    led.set_node(dataclasses.replace(node, gpus=(slot,)))
    new = {"model": MODEL_8B, "maxModelLen": 16384, "replicas": 1}
    assert not placement.decide(led, request("a", **new)).admitted  # precondition: it does not fit
    v = webhook.check(led, request("a", **new), old=spec_of(**old))
    assert v.allowed and any("needs less than before" in w for w in v.warnings)
    grow = {"model": MODEL_8B, "maxModelLen": 49152, "replicas": 1}
    assert not webhook.check(led, request("a", **grow), old=spec_of(**old)).allowed


# --- review: the store's states ------------------------------------------------------------------


class Unresolvable(Exception):
    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


class Store(FakeStore):
    def __init__(self, error: Exception | None = None, ready: bool = True):
        super().__init__([gfd_node("gpu-node-a", 1)], ready=ready)
        self.error = error

    async def request_for(self, obj):
        if self.error:
            raise self.error
        return placement.request_from_object(obj, catalog.model(obj.spec.model))


OBJ = {"metadata": {"name": "a", "namespace": "default"}, "spec": {"model": MODEL_8B, "maxModelLen": 8192}}


async def test_a_model_that_may_resolve_later_is_allowed_with_a_warning():
    v = await webhook.review(Store(Unresolvable("spec.modelConfigRef: ConfigMap default/c not found", True)),
                             OBJ, None, "CREATE", False)
    assert v == webhook.Verdict(True, warnings=(
        "spec.modelConfigRef: ConfigMap default/c not found; the operator will retry",))
    v = await webhook.review(Store(Unresolvable("unknown model 'x'", False)), OBJ, None, "CREATE", False)
    assert v == webhook.Verdict(False, "unknown model 'x'", code=422)


async def test_a_review_that_cannot_be_checked_is_refused_unless_fail_open():
    """Fail closed (issue 29): before the ledger is rebuilt, or when the namespace's places are all
    taken until the budget ends, the review is refused saying why; only --webhook-fail-open lets it
    through, with a warning that it was not checked."""
    assert await webhook.review(Store(ready=False), OBJ, None, "CREATE", False) == webhook.Verdict(
        False, webhook.NOT_READY, code=429)
    opened = await webhook.review(Store(ready=False), OBJ, None, "CREATE", False, webhook.Admission(fail_open=True))
    assert opened.allowed and opened.warnings[0].endswith(webhook.FAIL_OPEN)
    store = Store()
    adm = webhook.Admission(budget_s=0.05, per_namespace=1)
    assert await adm.slot("default", asyncio.get_running_loop().time() + 1)  # another review holds it
    big = {**OBJ, "spec": {**OBJ["spec"], "model": "meta-llama/Llama-3.1-405B-Instruct"}}  # decided on a thread
    v = await webhook.review(store, big, None, "CREATE", False, adm)
    assert v == webhook.Verdict(False, webhook.LATE.format(budget=0.05, step=webhook.BUSY.format(n=1)), code=429)
    # a small spec that fits is decided on the event loop: it needs no place
    assert (await webhook.review(store, OBJ, None, "CREATE", False, adm)).allowed
    other = {**big, "metadata": {"name": "a", "namespace": "team-b"}}
    v = await webhook.review(store, other, None, "CREATE", False, adm)  # another tenant is not held
    assert not v.allowed and v.code == 403 and "0/1 nodes are available" in v.message
    adm.free("default")
    assert (await webhook.review(store, big, None, "CREATE", False, adm)).code == 403


async def test_an_update_of_a_spec_that_no_longer_parses_is_checked_as_new():
    old = {"metadata": {"name": "a"}, "spec": {"model": MODEL_8B, "retired": True}}
    assert (await webhook.review(Store(), OBJ, old, "UPDATE", False)).allowed


async def test_a_pod_template_that_fights_vllmfit_is_denied_naming_the_field():
    obj = {**OBJ, "spec": {**OBJ["spec"], "podTemplate": {"spec": {"nodeName": "gpu-node-b"}}}}
    with pytest.raises(webhook.Invalid, match=r"^podTemplate.spec.nodeName is set by vllmfit; "
                                              r"use spec.placement.nodeName instead$"):
        await webhook.review(Store(), obj, None, "CREATE", False)
    ok = {**OBJ, "spec": {**OBJ["spec"], "podTemplate": {"spec": {"serviceAccountName": "vllm"}}}}
    assert (await webhook.review(Store(), ok, None, "CREATE", False)).allowed


def test_scaling_up_keeps_the_replicas_it_holds_and_only_new_ones_must_fit():
    led = ledger(gfd_node("gpu-node-a", 2))
    one = {"model": MODEL_8B, "maxModelLen": 32768, "replicas": 1, "kvCache": {"concurrency": 8}}
    d = placement.decide(led, request("a", **one))
    led.book(d)
    [r0] = d.replicas
    flags = api.Flags(max_model_len=d.flags.max_model_len, max_num_seqs=d.flags.max_num_seqs,
                      gpu_memory_utilization=d.flags.gpu_memory_utilization)
    # the other GPU fills up: a second replica fits nowhere, the first stays where it is
    node = led.nodes["gpu-node-a"]
    other = next(s for s in node.gpus if s.index != r0.gpus[0])
    full = dataclasses.replace(other, foreign_bytes=70 << 30)
    led.set_node(dataclasses.replace(node, gpus=tuple(full if s.index == other.index else s for s in node.gpus)))
    two = {**one, "replicas": 2}
    v = webhook.check(led, request("a", **two), old=spec_of(**one), old_flags=flags)
    assert not v.allowed and v.code == 403
    # room on the second GPU again: admitted, and replica 0 is not moved
    led.set_node(node)
    v = webhook.check(led, request("a", **two), old=spec_of(**one), old_flags=flags)
    assert v.allowed
    keep = placement.held_replicas(led, "default/a", 1)
    assert [(k.node, k.gpus) for k in keep] == [(r0.node, r0.gpus)]
    assert webhook.check(led, request("a", **{**one, "replicas": 0}), old=spec_of(**one)).allowed


def test_a_pod_template_change_needs_a_fit_check_only_when_its_node_affinity_changes():
    zone = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}}
    plain = spec_of()
    tolerating = spec_of(podTemplate={"spec": {"tolerations": [{"key": "x", "operator": "Exists"}]}})
    zoned = spec_of(podTemplate={"spec": zone})
    assert webhook.memory_changes(plain, tolerating) == []
    assert webhook.memory_changes(plain, zoned) == ["pod_template"]
    assert webhook.memory_changes(tolerating, spec_of(podTemplate={"spec": {**zone, "serviceAccountName": "s"}})) == [
        "pod_template"]


async def test_a_review_that_fails_gives_its_namespace_place_back():
    """A store that cannot give a snapshot makes the review fail (the handler answers 400), and
    the namespace keeps both its places: a failure never leaks one."""
    class Broken(Store):
        def __init__(self) -> None:
            super().__init__()

            def snapshot():
                raise RuntimeError("no ledger")

            self.books.snapshot = snapshot

    adm = webhook.Admission(per_namespace=1)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="no ledger"):
            await webhook.review(Broken(), OBJ, None, "CREATE", False, adm)
    assert adm._deciding == {}
    assert (await webhook.review(Store(), OBJ, None, "CREATE", False, adm)).allowed
