"""spec.podTemplate: each field vllmfit refuses (with the spec field to use) and each it merges,
checked on the Deployment the builder writes; the startup probe's scaling; node affinity honoured
by placement; the Deployment with a full template passes the Kubernetes schema."""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest

from vllmfit.core import defaults, placement
from vllmfit.core.memory import SpecError
from vllmfit.core.placement import affinity
from vllmfit.core.spec import api, validate
from vllmfit.operator.rendering import builders, podtemplate
from vllmfit.sources import catalog


def spec_problems(o: api.VLLMDeployment, policy: validate.Policy = validate.DEFAULT_POLICY) -> list[str]:
    """The one validator as the shells call it: with the catalog's answer for the model."""
    return validate.problems(o, catalog_model=catalog.knows(o.spec.model), policy=policy)

FLAGS = api.Flags(max_model_len=8192, max_num_seqs=8, gpu_memory_utilization=0.5)
GIB = 1 << 30


def obj(template: dict[str, Any] | None = None, **spec: Any) -> api.VLLMDeployment:
    if template is not None:
        spec["podTemplate"] = template
    return api.VLLMDeployment.model_validate(
        {"metadata": {"name": "llama", "namespace": "ml"}, "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", **spec}}
    )


def replica() -> api.ReplicaPlacement:
    return api.ReplicaPlacement(replica=0, node="gpu-a", gpus=[api.GpuRef(index=1, uuid="GPU-1")])


def build(template: dict[str, Any] | None = None, *, exclusive: bool = False, weights: int = 0) -> dict[str, Any]:
    o = obj(template)
    assert spec_problems(o) == []
    return builders.deployment(o, replica(), FLAGS, "m", exclusive=exclusive, weights_bytes=weights)


def pod(d: dict[str, Any]) -> dict[str, Any]:
    return d["spec"]["template"]["spec"]


def vllm(d: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod(d)["containers"] if c["name"] == "vllm")


# --- refused: each field vllmfit owns, with what to use instead ----------------------------------------

REFUSED = [
    ({"spec": {"nodeName": "gpu-b"}}, "podTemplate.spec.nodeName is set by vllmfit; use spec.placement.nodeName instead"),
    ({"spec": {"nodeSelector": {"zone": "a"}}},
     ("podTemplate.spec.nodeSelector is set by vllmfit; use spec.placement.nodeSelector (or a required nodeAffinity "
     "in podTemplate.spec.affinity) instead")),
    ({"spec": {"runtimeClassName": "kata"}},
     "podTemplate.spec.runtimeClassName is set by vllmfit (vllmfit's GPU binding sets it); remove it"),
    ({"spec": {"resourceClaims": [{"name": "gpu"}]}},
     "podTemplate.spec.resourceClaims is set by vllmfit (vllmfit's GPU binding sets it); remove it"),
    ({"spec": {"schedulingGates": [{"name": "mine"}]}},
     "podTemplate.spec.schedulingGates is set by vllmfit (vllmfit's GPU binding sets it); remove it"),
    ({"spec": {"containers": [{"name": "vllm", "image": "x"}]}},
     "podTemplate.spec.containers[vllm].image is set by vllmfit; use spec.image instead"),
    ({"spec": {"containers": [{"name": "vllm", "args": ["--x"]}]}},
     ("podTemplate.spec.containers[vllm].args is set by vllmfit; use spec.extraArgs (the computed flags have their "
     "own spec fields) instead")),
    ({"spec": {"containers": [{"name": "vllm", "command": ["python"]}]}},
     "podTemplate.spec.containers[vllm].command is set by vllmfit; use spec.extraArgs instead"),
    ({"spec": {"containers": [{"name": "vllm", "env": [{"name": "A", "value": "1"}]}]}},
     "podTemplate.spec.containers[vllm].env is set by vllmfit; use spec.env instead"),
    ({"spec": {"containers": [{"name": "vllm", "resources": {"limits": {"cpu": "4"}}}]}},
     "podTemplate.spec.containers[vllm].resources is set by vllmfit; use spec.resources instead"),
    ({"spec": {"containers": [{"name": "vllm", "ports": [{"containerPort": 9000}]}]}},
     "podTemplate.spec.containers[vllm].ports is set by vllmfit (the Service and probes use port 8000); remove it"),
    ({"spec": {"containers": [{"name": "vllm", "volumeMounts": [{"name": "s", "mountPath": "/dev/shm"}]}]}},
     ("podTemplate.spec.containers[vllm].volumeMounts: /dev/shm is vllmfit's memory-backed mount (NCCL needs it); "
     "remove it")),
    ({"spec": {"volumes": [{"name": "dshm", "emptyDir": {}}]}},
     "podTemplate.spec.volumes[dshm]: the name dshm is vllmfit's /dev/shm volume; use another name"),
    ({"spec": {"containers": [{"name": "proxy", "image": "p", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}},
     ("podTemplate.spec.containers[proxy].resources.limits[nvidia.com/gpu] is set by vllmfit (only the vllm container "
     "gets GPUs, through its binding); remove it")),
    ({"spec": {"initContainers": [{"name": "warm", "image": "w", "resources": {"claims": [{"name": "gpu"}]}}]}},
     ("podTemplate.spec.initContainers[warm].resources.claims is set by vllmfit (vllmfit's GPU binding sets it); "
     "remove it")),
    ({"metadata": {"labels": {"vllmfit.dev/replica": "9"}}},
     ("podTemplate.metadata.labels[vllmfit.dev/replica] is set by vllmfit (the operator and the Service select by it); "
     "remove it")),
    ({"metadata": {"labels": {"app.kubernetes.io/managed-by": "helm"}}},
     ("podTemplate.metadata.labels[app.kubernetes.io/managed-by] is set by vllmfit (the operator and the Service "
     "select by it); remove it")),
    ({"metadata": {"annotations": {"vllmfit.dev/placement": "x"}}},
     "podTemplate.metadata.annotations[vllmfit.dev/placement] is set by vllmfit (it records the placement); remove it"),
]

MALFORMED = [  # refused when the spec is read (pydantic, and the CRD's structural schema): issue 21 item 3
    ({"spec": {"tolerations": {"key": "x"}}}, "podTemplate.spec.tolerations must be a list (got dict)"),
    ({"spec": {"containers": [{"image": "no-name"}]}}, "podTemplate.spec.containers[0].name is required"),
]


@pytest.mark.parametrize("template,message", MALFORMED, ids=[m.split(" ")[0] for _, m in MALFORMED])
def test_a_malformed_template_is_refused_when_read(template: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        obj(template)


@pytest.mark.parametrize("template,message", REFUSED, ids=[m.split(" ")[0] for _, m in REFUSED])
def test_each_field_vllmfit_owns_is_refused_naming_what_to_use(template: dict[str, Any], message: str) -> None:
    assert spec_problems(obj(template)) == [message]


def test_binding_env_in_spec_env_is_refused() -> None:
    o = obj(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}])
    assert spec_problems(o) == [
        "spec.env NVIDIA_VISIBLE_DEVICES is set by vllmfit's GPU binding; use spec.placement.gpuIndices to choose GPUs"]


# --- allowed: each field, merged ---------------------------------------------------------------------


def test_tolerations_are_added_after_the_gpu_taint() -> None:
    t = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    assert pod(build({"spec": {"tolerations": [t]}}))["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, t]


def test_a_model_cache_volume_is_added_and_mounted_in_the_vllm_container() -> None:
    d = build({"spec": {
        "volumes": [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}],
        "containers": [{"name": "vllm", "volumeMounts": [{"name": "model-cache", "mountPath": "/root/.cache/huggingface"}]}],
    }})
    assert pod(d)["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                                 {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}]
    assert vllm(d)["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"},
                                       {"name": "model-cache", "mountPath": "/root/.cache/huggingface"}]


@pytest.mark.parametrize("field,value", [
    ("imagePullSecrets", [{"name": "registry"}]),
    ("serviceAccountName", "vllm-sa"),
    ("priorityClassName", "inference-high"),
    ("terminationGracePeriodSeconds", 120),
])
def test_pod_fields_vllmfit_does_not_own_are_set(field: str, value: Any) -> None:
    assert pod(build({"spec": {field: value}}))[field] == value


def test_init_containers_are_added_and_see_no_gpu() -> None:
    init = {"name": "fetch", "image": "busybox", "command": ["true"]}
    assert pod(build({"spec": {"initContainers": [init]}}))["initContainers"] == [
        {**init, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
         "securityContext": builders.RESTRICTED_CONTAINER}]


def test_labels_and_annotations_are_added_next_to_vllmfits() -> None:
    d = build({"metadata": {"labels": {"team": "search"}, "annotations": {"prometheus.io/scrape": "true"}}})
    meta = d["spec"]["template"]["metadata"]
    assert meta["labels"]["team"] == "search" and meta["labels"]["vllmfit.dev/deployment"] == "llama"
    assert meta["annotations"] == {"prometheus.io/scrape": "true", builders.ANNOTATION_PLACEMENT: "gpu-a:1"}


def test_extra_containers_run_next_to_vllm() -> None:
    side = {"name": "metrics-proxy", "image": "proxy:1", "ports": [{"containerPort": 9090}]}
    d = build({"spec": {"containers": [side]}})
    assert [c["name"] for c in pod(d)["containers"]] == ["vllm", "metrics-proxy"]
    assert pod(d)["containers"][1] == {**side, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
                                       "securityContext": builders.RESTRICTED_CONTAINER}


def test_vllm_container_security_context_and_pull_policy_are_set() -> None:
    sc = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    c = vllm(build({"spec": {"containers": [{"name": "vllm", "securityContext": sc, "imagePullPolicy": "Always"}]}}))
    assert (c["securityContext"], c["imagePullPolicy"]) == (sc, "Always")
    assert c["image"] == defaults.DEFAULT_IMAGE and c["command"] == ["vllm", "serve"]


def test_node_affinity_is_anded_with_the_pin_to_the_chosen_node() -> None:
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["eu-1a"]}
    preferred = [{"weight": 1, "preference": {"matchExpressions": [{"key": "fast", "operator": "Exists"}]}}]
    anti = {"preferredDuringSchedulingIgnoredDuringExecution": []}
    d = build({"spec": {"affinity": {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [zone]}]}, "preferredDuringSchedulingIgnoredDuringExecution": preferred},
        "podAntiAffinity": anti}}})
    aff = pod(d)["affinity"]
    pin = {"key": "metadata.name", "operator": "In", "values": ["gpu-a"]}
    assert aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [zone], "matchFields": [pin]}]}
    assert aff["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert aff["podAntiAffinity"] == anti


def test_affinity_without_node_affinity_keeps_the_pin() -> None:
    aff = pod(build({"spec": {"affinity": {"podAffinity": {}}}}))["affinity"]
    assert aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-a"]}]}]


def test_the_gpu_binding_survives_any_allowed_template() -> None:
    template = {"spec": {"tolerations": [], "volumes": [], "containers": [{"name": "vllm", "volumeMounts": []}]}}
    shared, plain = build(template), build()
    assert pod(shared)["runtimeClassName"] == pod(plain)["runtimeClassName"] == "nvidia"
    assert vllm(shared)["env"] == vllm(plain)["env"]
    assert vllm(build(template, exclusive=True))["resources"]["limits"] == {"nvidia.com/gpu": 1}


# --- startup probe -------------------------------------------------------------------------------------


def test_startup_probe_scales_with_the_checkpoint() -> None:
    # 8B bf16: 16.06e9 bytes / (100 MiB/s) = 153.2 s -> 154 s + 600 s = 754 s -> 38 periods of 20 s
    small = vllm(build(weights=16_060_000_000))["startupProbe"]
    assert (small["periodSeconds"], small["failureThreshold"]) == (20, 38)
    # 405B bf16: 810e9 bytes -> 7725.1 s -> 7726 + 600 = 8326 s -> 417 periods (2 h 19 min)
    big = vllm(build(weights=810_000_000_000))["startupProbe"]
    assert big["failureThreshold"] == 417
    assert small["httpGet"] == {"path": "/health", "port": "http"}


def test_startup_probe_timing_set_in_the_spec_wins() -> None:
    c = vllm(build({"spec": {"containers": [{"name": "vllm", "startupProbe": {"failureThreshold": 720}}]}},
                   weights=16_060_000_000))
    assert c["startupProbe"]["failureThreshold"] == 720
    assert c["startupProbe"]["periodSeconds"] == 20 and c["startupProbe"]["httpGet"]["path"] == "/health"


# --- schema and placement -----------------------------------------------------------------------------

FULL = {
    "metadata": {"labels": {"team": "search"}, "annotations": {"a": "b"}},
    "spec": {
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}],
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccountName": "vllm",
        "priorityClassName": "inference",
        "securityContext": {"fsGroup": 1000},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "containers": [
            {"name": "vllm", "volumeMounts": [{"name": "model-cache", "mountPath": "/root/.cache/huggingface"}],
             "startupProbe": {"failureThreshold": 100}},
            {"name": "sidecar", "image": "busybox", "command": ["sleep", "inf"]},
        ],
    },
}


@pytest.mark.parametrize("exclusive", [False, True])
def test_a_deployment_with_every_template_field_is_a_valid_apps_v1_deployment(exclusive: bool) -> None:
    d = build(copy.deepcopy(FULL), exclusive=exclusive, weights=16 * GIB)
    kubernetes_validate.validate(d, kubernetes_validate.latest_version(), strict=True)


def test_required_node_affinity_is_honoured_by_placement() -> None:
    from vllmfit.sources import catalog

    h100 = catalog.gpu("NVIDIA-H100-80GB-HBM3")
    nodes = [placement.NodeInfo(n, {"zone": z, "gen": g}, (placement.GpuSlot(n, 0, h100),))
             for n, z, g in (("a", "x", "3"), ("b", "y", "4"), ("c", "y", "5"))]
    ledger = placement.Ledger(nodes)
    model = catalog.model("Qwen/Qwen2.5-7B-Instruct")

    def where(expressions: list[dict[str, Any]], fields: list[dict[str, Any]] | None = None) -> str | None:
        term: dict[str, Any] = {"matchExpressions": expressions}
        if fields:
            term["matchFields"] = fields
        o = obj({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [term]}}}}})
        d = placement.decide(ledger, placement.request_from_object(o, model))
        return d.replicas[0].node if d.admitted else None

    assert where([{"key": "zone", "operator": "In", "values": ["y"]}]) == "b"
    assert where([{"key": "zone", "operator": "NotIn", "values": ["x", "y"]}]) is None
    assert where([{"key": "gen", "operator": "Gt", "values": ["4"]}]) == "c"
    assert where([{"key": "gen", "operator": "Lt", "values": ["4"]}]) == "a"
    assert where([{"key": "missing", "operator": "DoesNotExist"}, {"key": "zone", "operator": "Exists"}]) == "a"
    assert where([], [{"key": "metadata.name", "operator": "NotIn", "values": ["a", "b"]}]) == "c"


@pytest.mark.parametrize("required,message", [
    ({"nodeSelectorTerms": "x"}, "nodeSelectorTerms must be a list"),
    ({"nodeSelectorTerms": []}, "nodeSelectorTerms must not be empty"),
    ({"nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Near"}]}]}, "needs a key and an operator"),
    ({"nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["x"]}]}]},
     "Gt needs exactly one integer value"),
    ({"nodeSelectorTerms": [{"matchFields": [{"key": "spec.x", "operator": "In", "values": ["a"]}]}]},
     "matchFields supports only metadata.name"),
])
def test_malformed_node_affinity_is_refused_naming_the_field(required: dict[str, Any], message: str) -> None:
    o = obj({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}}})
    with pytest.raises(SpecError, match=message):
        affinity.required_terms(o.spec)


def test_podtemplate_owned_tables_name_real_fields() -> None:
    assert set(podtemplate.OWNED_CONTAINER_FIELDS) <= set(vllm(build()))


def test_the_model_cache_example_mounts_the_cache_where_hf_home_points() -> None:
    from pathlib import Path

    import yaml

    docs = list(yaml.safe_load_all((Path(__file__).resolve().parents[2] / "examples" / "model-cache.yaml").read_text()))
    [vd] = [d for d in docs if d["kind"] == api.KIND]
    [pvc] = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    o = api.VLLMDeployment.model_validate(vd)
    assert spec_problems(o) == []
    d = builders.deployment(o, replica(), FLAGS, o.spec.model, exclusive=False, weights_bytes=16 * GIB)
    kubernetes_validate.validate(d, kubernetes_validate.latest_version(), strict=True)
    kubernetes_validate.validate(pvc, kubernetes_validate.latest_version(), strict=True)
    c = vllm(d)
    hf_home = next(e["value"] for e in c["env"] if e["name"] == "HF_HOME")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model-cache")
    volume = next(v for v in pod(d)["volumes"] if v["name"] == "model-cache")
    assert mount["mountPath"] == hf_home == "/cache/huggingface"
    assert not hf_home.startswith("/root")  # the pods run as uid 1000 (restricted), /root is not theirs
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


@pytest.mark.parametrize("kind", ["gated", "dra"])
def test_reservation_gates_and_dra_claims_survive_an_allowed_template(kind: str) -> None:
    o = obj(copy.deepcopy(FULL))
    assert spec_problems(o) == []
    extra = {"gated": True, "pins": ["GPU-1"]} if kind == "gated" else {"claim_template": "llama-0-gpus"}
    plain = builders.deployment(obj(), replica(), FLAGS, "m", exclusive=False, **extra)
    d = builders.deployment(o, replica(), FLAGS, "m", exclusive=False, **extra)
    for field in ("schedulingGates", "resourceClaims", "runtimeClassName"):
        assert pod(d).get(field) == pod(plain).get(field), field
    assert vllm(d)["resources"].get("claims") == vllm(plain)["resources"].get("claims")
    assert vllm(d)["env"] == vllm(plain)["env"]
    for key, value in plain["spec"]["template"]["metadata"]["annotations"].items():
        assert d["spec"]["template"]["metadata"]["annotations"][key] == value


# --- The restricted Pod Security Standard by default (issue 14) --------------------------------


def test_vllm_pods_are_restricted_by_default() -> None:
    # The fields https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted asks for.
    d = build()
    p, c = pod(d), vllm(d)
    assert p["securityContext"]["runAsNonRoot"] is True
    assert p["securityContext"]["runAsUser"] not in (None, 0)
    assert p["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HOME"] == "/tmp" and env["USER"] == "vllm"  # a uid without a passwd entry still has caches
    for obj in (p, c):
        assert "privileged" not in obj.get("securityContext", {})


def test_a_pod_template_security_context_is_merged_over_the_default() -> None:
    # issue 30: field by field, so the restricted defaults stay where the template says nothing
    p = pod(build({"spec": {"securityContext": {"fsGroup": 2000, "supplementalGroups": [3000]}}}))
    assert p["securityContext"] == {**builders.RESTRICTED_POD, "fsGroup": 2000, "supplementalGroups": [3000]}
    sc = {"capabilities": {"add": ["NET_BIND_SERVICE"]}, "readOnlyRootFilesystem": True}
    assert vllm(build({"spec": {"containers": [{"name": "vllm", "securityContext": sc}]}}))["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}


def test_root_is_allowed_only_under_the_baseline_level() -> None:
    from vllmfit.core.spec import validate

    root = obj({"spec": {"securityContext": {"runAsUser": 0, "runAsNonRoot": False}}})
    assert [p.split(":")[0] for p in spec_problems(root)] == [
        "podTemplate.spec.securityContext.runAsNonRoot", "podTemplate.spec.securityContext.runAsUser"]
    assert spec_problems(root, validate.Policy(level="baseline")) == []
    caps = obj({"spec": {"containers": [{"name": "vllm", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]}})
    [problem] = spec_problems(caps, validate.Policy(level="baseline"))
    assert problem.startswith("podTemplate.spec.containers[vllm].securityContext.capabilities.add[IPC_LOCK]")


def test_the_users_home_wins_over_the_default() -> None:
    spec = api.VLLMDeploymentSpec.model_validate({"model": "org/m", "env": [{"name": "HOME", "value": "/data"}]})
    assert spec.env[0]["value"] == "/data"
    obj = api.VLLMDeployment.model_validate({"metadata": {"name": "llama"}, "spec": {
        "model": "meta-llama/Llama-3.1-8B-Instruct", "env": [{"name": "HOME", "value": "/data"}]}})
    rep = api.ReplicaPlacement(replica=0, node="gpu-a", gpus=[api.GpuRef(index=1)])
    flags = api.Flags(max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.5)
    d = builders.deployment(obj, rep, flags, obj.spec.model, exclusive=False)
    homes = [e["value"] for e in vllm(d)["env"] if e["name"] == "HOME"]
    assert homes == ["/data"]
