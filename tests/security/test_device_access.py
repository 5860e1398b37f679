"""Issue 21 items 2 and 3: no podTemplate gives a container other than vLLM's a GPU, and no
malformed template stops anything but its own spec.

Each escape of item 2 is refused, naming the field, by the rule the webhook and the operator
share (builders.spec_problems -> vllmfit.core.spec.validate), and every container but
vllm's is given NVIDIA_VISIBLE_DEVICES=void whatever its image or envFrom says. Written first and
run on the old code: every escape but the `nvidia.com/gpu` sidecar passed, sidecars kept their
env, `affinity: "x"` was accepted by the spec types and raised AttributeError in the merge."""

from __future__ import annotations

from typing import Any

import pytest

from vllmfit.backends import binding
from vllmfit.core.spec import api, validate
from vllmfit.operator.admission import webhook
from vllmfit.operator.rendering import builders, podtemplate
from vllmfit.sources import catalog


def spec_problems(o: api.VLLMDeployment, policy: validate.Policy = validate.DEFAULT_POLICY) -> list[str]:
    """The one validator as the shells call it: with the catalog's answer for the model."""
    return validate.problems(o, catalog_model=catalog.knows(o.spec.model), policy=policy)

FLAGS = api.Flags(max_model_len=8192, max_num_seqs=8, gpu_memory_utilization=0.5)
SIDECAR = {"name": "proxy", "image": "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"}


def body(template: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    if template is not None:
        spec["podTemplate"] = template
    return {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment",
            "metadata": {"name": "llama", "namespace": "tenant-a"},
            "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", **spec}}


def obj(template: dict[str, Any] | None = None, **spec: Any) -> api.VLLMDeployment:
    return api.VLLMDeployment.model_validate(body(template, **spec))


def side(**fields: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{**SIDECAR, **fields}]}}


ESCAPES: list[tuple[str, dict[str, Any], str]] = [
    ("sidecar NVIDIA_VISIBLE_DEVICES=all", side(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
     "podTemplate.spec.containers[proxy].env[NVIDIA_VISIBLE_DEVICES]"),
    ("sidecar NVIDIA_VISIBLE_DEVICES=0", side(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]),
     "podTemplate.spec.containers[proxy].env[NVIDIA_VISIBLE_DEVICES]"),
    ("initContainer NVIDIA_VISIBLE_DEVICES", {"spec": {"initContainers": [
        {**SIDECAR, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}},
     "podTemplate.spec.initContainers[proxy].env[NVIDIA_VISIBLE_DEVICES]"),
    ("sidecar NVIDIA_DRIVER_CAPABILITIES", side(env=[{"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "all"}]),
     "podTemplate.spec.containers[proxy].env[NVIDIA_DRIVER_CAPABILITIES]"),
    ("sidecar NVIDIA_MIG_MONITOR_DEVICES", side(env=[{"name": "NVIDIA_MIG_MONITOR_DEVICES", "value": "all"}]),
     "podTemplate.spec.containers[proxy].env[NVIDIA_MIG_MONITOR_DEVICES]"),
    ("privileged sidecar", side(securityContext={"privileged": True}),
     "podTemplate.spec.containers[proxy].securityContext.privileged"),
    ("privileged initContainer", {"spec": {"initContainers": [{**SIDECAR, "securityContext": {"privileged": True}}]}},
     "podTemplate.spec.initContainers[proxy].securityContext.privileged"),
    ("privileged vllm container", {"spec": {"containers": [{"name": "vllm", "securityContext": {"privileged": True}}]}},
     "podTemplate.spec.containers[vllm].securityContext.privileged"),
    ("sidecar nvidia.com/gpu", side(resources={"limits": {"nvidia.com/gpu": 1}}),
     "podTemplate.spec.containers[proxy].resources.limits[nvidia.com/gpu]"),
    ("sidecar nvidia.com/gpu.shared", side(resources={"requests": {"nvidia.com/gpu.shared": 1}}),
     "podTemplate.spec.containers[proxy].resources.requests[nvidia.com/gpu.shared]"),
    ("sidecar nvidia.com/mig-1g.10gb", side(resources={"limits": {"nvidia.com/mig-1g.10gb": 1}}),
     "podTemplate.spec.containers[proxy].resources.limits[nvidia.com/mig-1g.10gb]"),
    ("initContainer amd.com/gpu", {"spec": {"initContainers": [{**SIDECAR, "resources": {"limits": {"amd.com/gpu": 1}}}]}},
     "podTemplate.spec.initContainers[proxy].resources.limits[amd.com/gpu]"),
    ("hostPID", {"spec": {"hostPID": True}}, "podTemplate.spec.hostPID"),
    ("hostIPC", {"spec": {"hostIPC": True}}, "podTemplate.spec.hostIPC"),
    ("shareProcessNamespace", {"spec": {"shareProcessNamespace": True}}, "podTemplate.spec.shareProcessNamespace"),
    ("hostPath /dev", {"spec": {"volumes": [{"name": "d", "hostPath": {"path": "/dev"}}]}},
     "podTemplate.spec.volumes[d].hostPath.path '/dev'"),
    ("hostPath /dev/nvidia0", {"spec": {"volumes": [{"name": "d", "hostPath": {"path": "/dev/nvidia0"}}]}},
     "podTemplate.spec.volumes[d].hostPath.path '/dev/nvidia0'"),
    ("hostPath //dev/../dev/", {"spec": {"volumes": [{"name": "d", "hostPath": {"path": "//dev/../dev/"}}]}},
     "podTemplate.spec.volumes[d].hostPath.path"),
    ("hostPath /", {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
     "podTemplate.spec.volumes[root].hostPath.path '/'"),
    ("hostPath /proc/driver/nvidia", {"spec": {"volumes": [{"name": "p", "hostPath": {"path": "/proc/driver/nvidia"}}]}},
     "podTemplate.spec.volumes[p].hostPath.path '/proc/driver/nvidia'"),
    ("hostPath /run/nvidia/driver", {"spec": {"volumes": [{"name": "p", "hostPath": {"path": "/run/nvidia/driver"}}]}},
     "podTemplate.spec.volumes[p].hostPath.path '/run/nvidia/driver'"),
    ("CDI annotation", {"metadata": {"annotations": {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}}},
     "podTemplate.metadata.annotations[cdi.k8s.io/gpu]"),
    ("ephemeralContainers", {"spec": {"ephemeralContainers": [{"name": "dbg", "image": "x"}]}},
     "podTemplate.spec.ephemeralContainers"),
    ("spec.env NVIDIA_IMEX_CHANNELS", {}, "spec.env NVIDIA_IMEX_CHANNELS"),
    ("spec.resources nvidia.com/mig-3g.40gb", {}, "spec.resources.limits[nvidia.com/mig-3g.40gb]"),
]
EXTRA_SPEC: dict[str, dict[str, Any]] = {
    "spec.env NVIDIA_IMEX_CHANNELS": {"env": [{"name": "NVIDIA_IMEX_CHANNELS", "value": "0"}]},
    "spec.resources nvidia.com/mig-3g.40gb": {"resources": {"limits": {"nvidia.com/mig-3g.40gb": 1}}},
}


@pytest.mark.parametrize("name,template,field", ESCAPES, ids=[e[0] for e in ESCAPES])
def test_each_gpu_escape_is_refused_naming_the_field(name: str, template: dict[str, Any], field: str) -> None:
    problems = spec_problems(obj(template or None, **EXTRA_SPEC.get(name, {})))
    assert len(problems) == 1, problems
    assert problems[0].startswith(field), problems
    assert "\n" not in problems[0]


@pytest.mark.parametrize("name,template,field", ESCAPES[:6], ids=[e[0] for e in ESCAPES[:6]])
async def test_the_webhook_denies_each_escape_with_the_same_line(name: str, template: dict[str, Any], field: str) -> None:
    with pytest.raises(webhook.Invalid, match=field.replace("[", r"\[").replace("]", r"\]")):
        await webhook.review(None, body(template), None, "CREATE", False)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/data/models", "/mnt/hf-cache", "/devices", "/opt/dev"])
def test_host_paths_are_allowed_only_where_the_admin_allows(path: str) -> None:
    # issue 30: an allow-list; a path that reaches no device is still refused unless the admin names it
    o = obj({"spec": {"volumes": [{"name": "m", "hostPath": {"path": path}}]}})
    [problem] = spec_problems(o)
    assert problem.startswith("podTemplate.spec.volumes[m].hostPath.path") and "allowed: none" in problem
    allowed = validate.Policy(host_paths=(path.rsplit("/", 1)[0] or path, path))
    assert spec_problems(o, allowed) == []


def test_sidecars_may_keep_harmless_env_and_resources() -> None:
    template = side(env=[{"name": "CUDA_VISIBLE_DEVICES", "value": ""}, {"name": "NVIDIA_DISABLE_REQUIRE", "value": "1"}],
                    resources={"limits": {"cpu": "1", "memory": "1Gi"}}, securityContext={"privileged": False})
    assert spec_problems(obj(template)) == []


def build(template: dict[str, Any] | None, *, exclusive: bool = False, claim: str | None = None) -> dict[str, Any]:
    o = obj(template)
    assert spec_problems(o) == []
    r = api.ReplicaPlacement(replica=0, node="gpu-a", gpus=[api.GpuRef(index=1, uuid="GPU-1")])
    return builders.deployment(o, r, FLAGS, "m", exclusive=exclusive, claim_template=claim)["spec"]["template"]["spec"]


def env_of(c: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in c.get("env") or []:  # Kubernetes: the last entry of a name wins, and env wins over envFrom
        out[e["name"]] = e.get("value", "")
    return out


@pytest.mark.parametrize("mode", ["shared", "exclusive", "dra"])
def test_every_container_but_vllm_gets_void(mode: str) -> None:
    template = {"spec": {
        "initContainers": [{"name": "fetch", "image": "cuda", "envFrom": [{"configMapRef": {"name": "gpu-env"}}]}],
        "containers": [{"name": "proxy", "image": "cuda", "env": [{"name": "A", "value": "1"}]}]}}
    pod = build(template, exclusive=mode == "exclusive", claim="llama-0-x" if mode == "dra" else None)
    others = [*pod["initContainers"], *[c for c in pod["containers"] if c["name"] != "vllm"]]
    assert [c["name"] for c in others] == ["fetch", "proxy"]
    for c in others:
        assert env_of(c)["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert c["env"][-1] == {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
    assert env_of(next(c for c in others if c["name"] == "proxy"))["A"] == "1"
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    visible = env_of(vllm).get("NVIDIA_VISIBLE_DEVICES")
    # shared: the booked GPU; exclusive: the device plugin sets it; DRA: the driver's CDI edits
    # inject the claimed GPU, and void keeps an image's own `all` (CUDA images) from adding more.
    assert visible == {"shared": "GPU-1", "exclusive": None, "dra": "void"}[mode]


def test_dra_binding_names_no_gpu_through_env() -> None:
    b = binding.bind(api.ReplicaPlacement(replica=0, node="n", gpus=[api.GpuRef(index=0, uuid="GPU-0")]), 1,
                     exclusive=False, claim_template="t")
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in b.env


# --- item 3: a poison template is that spec's error, never the operator's ---------------------------

POISON = [
    ({"spec": {"affinity": "x"}}, "podTemplate.spec.affinity must be an object (got 'x')"),
    ({"spec": {"affinity": 3}}, "podTemplate.spec.affinity must be an object (got 3)"),
    ({"spec": {"tolerations": "x"}}, "podTemplate.spec.tolerations must be a list (got 'x')"),
    ({"spec": {"volumes": ["x"]}}, "podTemplate.spec.volumes[0] must be an object (got 'x')"),
    ({"spec": {"containers": [{"name": "vllm", "volumeMounts": "x"}]}},
     "podTemplate.spec.containers[vllm].volumeMounts must be a list (got 'x')"),
    ({"spec": {"containers": [{"name": "p", "env": [{"value": "1"}]}]}},
     "podTemplate.spec.containers[p].env[0].name is required"),
    ({"spec": {"hostPID": "true"}}, "podTemplate.spec.hostPID must be true or false (got 'true')"),
    ({"spec": {"terminationGracePeriodSeconds": True}},
     "podTemplate.spec.terminationGracePeriodSeconds must be a whole number (got True)"),
]


@pytest.mark.parametrize("template,message", POISON, ids=[m.split(" ")[0] for _, m in POISON])
async def test_a_malformed_template_is_refused_by_the_types_and_the_webhook(template: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        obj(template)
    with pytest.raises(webhook.Invalid) as e:
        await webhook.review(None, body(template), None, "CREATE", False)  # type: ignore[arg-type]
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("spec", [{"affinity": "x"}, {"affinity": {"nodeAffinity": "x"}},
                                  {"containers": "x"}, {"tolerations": 5}, {"containers": [{"name": "vllm",
                                                                                             "startupProbe": "x"}]}])
def test_the_merge_raises_only_a_template_error(spec: dict[str, Any]) -> None:
    """A template that got past the types (an old stored object, a bug) is still one spec's error."""
    template = api.PodTemplate.model_construct(metadata=None, spec=spec)  # no validation
    pod = {"containers": [{"name": "vllm", "env": []}],
           "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
               "nodeSelectorTerms": [{"matchFields": []}]}}}}
    try:
        podtemplate.merge(pod, {}, template)
    except podtemplate.TemplateError as e:
        assert str(e).startswith("podTemplate cannot be merged") and isinstance(e, ValueError)


# --- issue 21 item 4: an inline model config is not trusted for a model vllmfit knows ----------------

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 2048}


@pytest.mark.parametrize("field", ["modelConfig", "modelConfigRef"])
def test_a_model_config_for_a_catalog_model_is_refused(field: str) -> None:
    value: object = TINY if field == "modelConfig" else {"name": "cfg"}
    problems = spec_problems(obj(**{field: value}))  # spec.model: Llama-3.1-8B, in the catalog
    assert problems == [(f"spec.{field}: meta-llama/Llama-3.1-8B-Instruct is in vllmfit's catalog, whose config is "
                        f"what vLLM loads; remove spec.{field} (a config that differs from the real one would book "
                        "the wrong memory)")]


def test_a_model_config_for_a_model_vllmfit_does_not_know_is_used() -> None:
    o = api.VLLMDeployment.model_validate({"metadata": {"name": "t", "namespace": "ns"},
                                           "spec": {"model": "acme/private-tiny", "modelConfig": TINY}})
    assert spec_problems(o) == []
