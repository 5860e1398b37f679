"""Issue 29 item 3 and issue 30: one validator. One table of specs goes through `vllmfit plan` (the
CLI, from a file), the webhook's review and the operator's check of every spec it handles
(handlers.common.checked, with the ConfigMaps read from a KMock API server), and each must get the
same verdict: refused with one line naming the field, or allowed.

On the old code `plan` admitted the first four (issue 29) and every path admitted the issue 30
escapes (parents of the refused host paths, code in the vllm container, memory flags, device env
through envFrom)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from opkit import Cluster

from vllmfit import main as cli
from vllmfit.core.spec import api, read
from vllmfit.operator.admission import webhook
from vllmfit.operator.booking.state import Options, Store, Workers
from vllmfit.operator.handlers import common

pytestmark = pytest.mark.looptime  # hang guards and waits in virtual seconds (issue 29): no wall time

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SIDE = {"name": "proxy", "image": "busybox:1.36"}
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
        "num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 64}
CONFIGMAPS = [
    {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gpu-env", "namespace": "tenant-a"},
     "data": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}},
    {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "code-env", "namespace": "tenant-a"},
     "data": {"LD_PRELOAD": "/cfg/evil.so"}},
    {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "log-env", "namespace": "tenant-a"},
     "data": {"VLLM_LOGGING_LEVEL": "DEBUG", "HF_HUB_OFFLINE": "1"}},
]


def tpl(**pod: Any) -> dict[str, Any]:
    return {"podTemplate": {"spec": pod}}


def vllm(**fields: Any) -> dict[str, Any]:
    return tpl(containers=[{"name": "vllm", **fields}])


def host(path: str) -> dict[str, Any]:
    return tpl(volumes=[{"name": "h", "hostPath": {"path": path}}])


# name, spec fields, the field the one-line reason starts with (None: allowed)
TABLE: list[tuple[str, dict[str, Any], str | None]] = [
    # issue 29: plan admitted these four
    ("sidecar NVIDIA_VISIBLE_DEVICES", tpl(containers=[{**SIDE, "env": [{"name": "NVIDIA_VISIBLE_DEVICES",
                                                                        "value": "all"}]}]),
     "podTemplate.spec.containers[proxy].env[NVIDIA_VISIBLE_DEVICES]"),
    ("/dev hostPath", host("/dev"), "podTemplate.spec.volumes[h].hostPath.path '/dev'"),
    ("catalog model, inline modelConfig", {"modelConfig": TINY}, "spec.modelConfig: " + MODEL),
    ("spec.env CUDA_VISIBLE_DEVICES", {"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]},
     "spec.env CUDA_VISIBLE_DEVICES"),
    # issue 30 item 1: parents of the refused host paths, and every other host path
    ("hostPath /run", host("/run"), "podTemplate.spec.volumes[h].hostPath.path '/run'"),
    ("hostPath /var/run", host("/var/run"), "podTemplate.spec.volumes[h].hostPath.path '/var/run'"),
    ("hostPath /var/lib", host("/var/lib"), "podTemplate.spec.volumes[h].hostPath.path '/var/lib'"),
    ("hostPath /etc", host("/etc"), "podTemplate.spec.volumes[h].hostPath.path '/etc'"),
    ("hostPath /usr/bin", host("/usr/bin"), "podTemplate.spec.volumes[h].hostPath.path '/usr/bin'"),
    ("hostPath /data", host("/data"), "podTemplate.spec.volumes[h].hostPath.path '/data'"),
    # issue 30 item 2: code in the vllm container
    ("vllm postStart", vllm(lifecycle={"postStart": {"exec": {"command": [
        "python3", "-c", "import torch; x = torch.empty(60 << 30, dtype=torch.uint8, device='cuda')"]}}}),
     "podTemplate.spec.containers[vllm].lifecycle"),
    ("spec.env PYTHONPATH", {"env": [{"name": "PYTHONPATH", "value": "/cfg"}]}, "spec.env PYTHONPATH"),
    ("spec.env LD_PRELOAD", {"env": [{"name": "LD_PRELOAD", "value": "/cfg/x.so"}]}, "spec.env LD_PRELOAD"),
    ("spec.env VLLM_PLUGINS", {"env": [{"name": "VLLM_PLUGINS", "value": "evil"}]}, "spec.env VLLM_PLUGINS"),
    ("spec.env PYTHONSTARTUP", {"env": [{"name": "PYTHONSTARTUP", "value": "/cfg/s.py"}]}, "spec.env PYTHONSTARTUP"),
    ("spec.env LD_LIBRARY_PATH", {"env": [{"name": "LD_LIBRARY_PATH", "value": "/cfg"}]},
     "spec.env LD_LIBRARY_PATH"),
    ("spec.env PYTORCH_CUDA_ALLOC_CONF", {"env": [{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "x"}]},
     "spec.env PYTORCH_CUDA_ALLOC_CONF is not on the allow-list"),
    ("sitecustomize over site-packages", tpl(
        volumes=[{"name": "code", "configMap": {"name": "code"}}],
        containers=[{"name": "vllm", "volumeMounts": [{"name": "code", "subPath": "sitecustomize.py",
                                                       "mountPath": "/usr/local/lib/python3.12/dist-packages/"
                                                                    "sitecustomize.py"}]}]),
     "podTemplate.spec.containers[vllm].volumeMounts[code].mountPath"),
    ("vllm workingDir", vllm(workingDir="/cfg"), "podTemplate.spec.containers[vllm].workingDir"),
    ("SYS_ADMIN and root", vllm(securityContext={"capabilities": {"add": ["SYS_ADMIN"]}, "runAsUser": 0}),
     "podTemplate.spec.containers[vllm].securityContext.capabilities.add[SYS_ADMIN]"),
    ("vllm probe exec", vllm(livenessProbe={"exec": {"command": ["python3", "-c", "1"]}}),
     "podTemplate.spec.containers[vllm].livenessProbe.exec"),
    ("envFrom code ConfigMap", vllm(envFrom=[{"configMapRef": {"name": "code-env"}}]),
     "podTemplate.spec.containers[vllm].envFrom[configMapRef code-env] LD_PRELOAD"),
    ("envFrom Secret", vllm(envFrom=[{"secretRef": {"name": "creds"}}]),
     "podTemplate.spec.containers[vllm].envFrom[secretRef creds]"),
    ("envFrom missing ConfigMap", vllm(envFrom=[{"configMapRef": {"name": "nope"}}]),
     "podTemplate.spec.containers[vllm].envFrom[configMapRef nope]"),
    # issue 30 item 3: memory flags and env
    ("--mm-processor-kwargs", {"extraArgs": ["--mm-processor-kwargs", '{"max_pixels": 99999999}']},
     "extraArgs --mm-processor-kwargs"),
    ("--enable-eplb", {"extraArgs": ["--enable-eplb"]}, "extraArgs --enable-eplb"),
    ("--num-redundant-experts", {"extraArgs": ["--num-redundant-experts=32"]}, "extraArgs --num-redundant-experts"),
    ("envFrom CUDA_VISIBLE_DEVICES", vllm(envFrom=[{"configMapRef": {"name": "gpu-env"}}]),
     "podTemplate.spec.containers[vllm].envFrom[configMapRef gpu-env] CUDA_VISIBLE_DEVICES"),
    # the other allow-lists
    ("nfs volume", tpl(volumes=[{"name": "n", "nfs": {"server": "x", "path": "/"}}]), "podTemplate.spec.volumes[n].nfs"),
    ("unbounded emptyDir", tpl(volumes=[{"name": "s", "emptyDir": {}}]), "podTemplate.spec.volumes[s].emptyDir.sizeLimit"),
    ("hostNetwork", tpl(hostNetwork=True), "podTemplate.spec.hostNetwork"),
    ("Unconfined seccomp", tpl(securityContext={"seccompProfile": {"type": "Unconfined"}}),
     "podTemplate.spec.securityContext.seccompProfile.type"),
    ("sidecar hostPort", tpl(containers=[{**SIDE, "ports": [{"containerPort": 80, "hostPort": 80}]}]),
     "podTemplate.spec.containers[proxy].ports[0].hostPort"),
    ("schedulerName", tpl(schedulerName="mine"), "podTemplate.spec.schedulerName"),
    # issue 29's parser: what the API types refuse, in one wording everywhere (the webhook's, with
    # what was given and how many more; plan and the operator said less, each its own way)
    ("negative replicas", {"replicas": -1}, "spec.replicas: Input should be greater than or equal to 0 (got -1)"),
    ("unknown field", {"surprise": 1}, "spec.surprise: unknown field"),
    ("no model", {"model": None}, "spec.model: Input should be a valid string"),
    ("three wrong fields", {"dtype": "int3", "tensorParallelSize": 0, "replicas": "x"},
     ("spec.dtype: Input should be 'auto', 'bfloat16', 'float16' or 'float32' (got 'int3'); 2 more: "
     "spec.tensorParallelSize, spec.replicas")),
    # what a tenant legitimately writes passes everywhere
    ("a good spec", {
        "env": [{"name": "HF_HOME", "value": "/cache/hf"},
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        "extraArgs": ["--served-model-name", "llama", "--enable-prefix-caching"],
        **tpl(volumes=[{"name": "cache", "persistentVolumeClaim": {"claimName": "hf"}},
                       {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
              containers=[{"name": "vllm", "volumeMounts": [{"name": "cache", "mountPath": "/cache/hf"}],
                           "envFrom": [{"configMapRef": {"name": "log-env"}}], "startupProbe": {"periodSeconds": 30}},
                          {**SIDE, "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}}}])}, None),
]


def body(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment",
            "metadata": {"name": name, "namespace": "tenant-a"}, "spec": {"model": MODEL, "maxModelLen": 4096, **spec}}


def slug(name: str) -> str:
    return "t-" + "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")[:40].strip("-")


def plan_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-a", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8"}}}
    docs = [node, *CONFIGMAPS, *(body(slug(n), spec) for n, spec, _ in TABLE)]
    f = tmp_path / "all.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    capsys.readouterr()
    cli.main(["plan", "-f", str(f), "-o", "json"])
    return list(json.loads(capsys.readouterr().out)["errors"])


async def reason(path: Any, store: Any, b: dict[str, Any]) -> str | None:
    try:
        v = await path(store, b)
    except (webhook.Invalid, common.Invalid) as e:
        return str(e)
    # past the validator, this store has no ledger yet: the webhook then refuses with 429 (fail
    # closed, issue 29) rather than allowing; either way the validator found nothing
    assert getattr(v, "allowed", True) or (v.code == 429 and "not rebuilt its ledger" in v.message), v
    return None


async def test_one_table_through_plan_the_webhook_and_the_operator(
        cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for cm in CONFIGMAPS:
        await cluster.core.create_namespaced_config_map("tenant-a", cm)
    store = Store(Options())  # not rebuilt: its books are not ready
    store.api = cluster.api
    errors = plan_errors(tmp_path, capsys)
    paths = {"webhook": lambda s, b: webhook.review(s, b, None, "CREATE", False), "operator": common.checked}
    for name, spec, field in TABLE:
        b = body(slug(name), spec)
        where = f"VLLMDeployment tenant-a/{slug(name)} "
        got = {p: await reason(f, store, b) for p, f in paths.items()}
        mine = [e for e in errors if e.startswith(where)]
        got["plan"] = mine[0].split(": ", 1)[1] if mine else None
        for p, message in got.items():
            if field is None:
                assert message is None, (name, p, message)
            else:
                assert message is not None, (name, p, "allowed")
                assert field in message and "\n" not in message, (name, p, message)
        if field is not None:  # one reader, one validator: the same line from every shell
            assert len(set(got.values())) == 1, (name, got)


async def test_the_running_operator_refuses_and_reads_the_config_maps(cluster: Cluster, operator: Any) -> None:
    # the real operator on KMock (webhook off): a hostile spec is Rejected with the validator's line and
    # gets no Deployment; an envFrom ConfigMap is read through the operator's own API client
    from opkit import DEPLOYMENTS, node, vd

    await cluster.create(node("gpu-a", gpus=1))
    for name, data in (("gpu-env", {"CUDA_VISIBLE_DEVICES": "0"}), ("log-env", {"VLLM_LOGGING_LEVEL": "DEBUG"})):
        await cluster.core.create_namespaced_config_map("default", {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data})
    await cluster.create(vd("run", MODEL, maxModelLen=4096, **host("/run")))
    await cluster.create(vd("gpuenv", MODEL, maxModelLen=4096, **vllm(envFrom=[{"configMapRef": {"name": "gpu-env"}}])))
    await cluster.create(vd("logs", MODEL, maxModelLen=4096, **vllm(envFrom=[{"configMapRef": {"name": "log-env"}}])))
    for name, field in (("run", "podTemplate.spec.volumes[h].hostPath.path '/run'"),
                        ("gpuenv", "podTemplate.spec.containers[vllm].envFrom[configMapRef gpu-env] CUDA_VISIBLE_DEVICES")):
        st = await cluster.phase(name, "Rejected")
        admitted = next(c for c in st["conditions"] if c["type"] == "Admitted")
        assert (admitted["status"], admitted["reason"]) == ("False", "InvalidSpec")
        assert admitted["message"].startswith(field), admitted["message"]
        assert cluster.get(DEPLOYMENTS, f"{name}-0") is None
    await cluster.phase("logs", "Admitted")
    await cluster.until(lambda: cluster.get(DEPLOYMENTS, "logs-0"), what="logs-0 written")


# --- One resolver (issue 29): the same spec resolves to the same model facts, or is refused with the
# same line, through `vllmfit plan` (ConfigMaps from its input), the webhook and the operator (the
# ConfigMap read from the API server). On the old code the three resolvers differed: plan said
# "modelConfigRef: ConfigMap ... is not in the input", never checked that the key held a JSON object,
# gave a catalog miss without its "org/name" hint and an inline config's params another source.

CUSTOM = "acme/tiny-chat"
GOOD = json.dumps(TINY)
MODEL_MAPS = [
    {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": n, "namespace": "tenant-a"}, "data": data}
    for n, data in (("tiny", {"config.json": GOOD}), ("nokey", {"other": GOOD}), ("notjson", {"config.json": "{x"}),
                    ("list", {"config.json": "[1, 2]"}), ("broken", {"config.json": json.dumps({"model_type": "llama"})}))
]


def ref(name: str) -> dict[str, Any]:
    return {"model": CUSTOM, "modelConfigRef": {"name": name, "key": "config.json"}}


# name, spec fields, the start of the one line (None: resolved), transient (the webhook allows with a warning)
MODELS: list[tuple[str, dict[str, Any], str | None, bool]] = [
    ("catalog name", {}, None, False),
    ("catalog alias", {"model": "llama-3.1-8b-instruct"}, None, False),
    ("inline config", {"model": CUSTOM, "modelConfig": TINY, "modelParams": 123456}, None, False),
    ("config map", ref("tiny"), None, False),
    ("unknown name", {"model": "llama-9000"}, "unknown model 'llama-9000'", False),
    ("broken inline config", {"model": CUSTOM, "modelConfig": {"model_type": "llama"}}, "spec.modelConfig: ", False),
    ("missing config map", ref("nope"), "spec.modelConfigRef: ConfigMap tenant-a/nope not found", True),
    ("no such key", ref("nokey"), "spec.modelConfigRef: ConfigMap tenant-a/nokey has no key 'config.json'", False),
    ("not JSON", ref("notjson"), "spec.modelConfigRef: ConfigMap tenant-a/notjson key 'config.json' is not JSON (",
     False),
    ("not an object", ref("list"), ("spec.modelConfigRef: ConfigMap tenant-a/list key 'config.json' is not a JSON "
     "object"), False),
    ("broken config", ref("broken"), "spec.modelConfigRef: ConfigMap tenant-a/broken key 'config.json': ", False),
]


def facts(model: Any) -> tuple[Any, ...]:
    return (model.name, model.params, model.params_source, model.num_layers, model.hidden_size,
            model.num_kv_heads, model.max_model_len, model.torch_dtype)


async def test_one_resolver_through_plan_the_webhook_and_the_operator(cluster: Cluster) -> None:
    from vllmfit.cli import plan as plancmd
    from vllmfit.core import placement
    from vllmfit.operator.booking import models
    from vllmfit.sources import catalog, resolve

    for cm in MODEL_MAPS:
        await cluster.core.create_namespaced_config_map("tenant-a", cm)
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-a", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "8"}}}
    bodies = {name: body(slug(name), {"maxModelLen": 1024, **spec}) for name, spec, _, _ in MODELS}
    plan = plancmd.build_plan(plancmd.read_objects([("all.yaml", yaml.safe_dump_all(
        [node, *MODEL_MAPS, *bodies.values()]))]))
    resolved: dict[str, list[Any]] = {}

    async def request_for(obj: Any) -> Any:  # the operator's Store.request_for: the one resolver
        req = placement.request_from_object(obj, await models.resolve_model(cluster.api, obj))
        resolved.setdefault(obj.metadata.name, []).append(req.model)
        return req

    ledger = placement.Ledger([placement.node_from_object(node, catalog.gpu_for_label)])
    books = SimpleNamespace(ready=SimpleNamespace(is_set=lambda: True), snapshot=ledger.snapshot)
    store = SimpleNamespace(options=Options(), api=cluster.api, books=books, workers=Workers(),
                            request_for=request_for)
    for name, _, start, transient in MODELS:
        b, key = bodies[name], f"tenant-a/{slug(name)}"
        v = await webhook.review(store, b, None, "CREATE", True)
        try:
            await store.request_for(await common.checked(store, b))  # what the operator's reconcile does
            operator = None
        except resolve.ModelResolutionError as e:
            operator = (str(e), e.transient)
        mine = [e for e in plan.errors if e.startswith(f"VLLMDeployment {key} ")]
        got = mine[0].split(": ", 1)[1] if mine else None
        if start is None:
            assert v.allowed and operator is None and got is None, (name, v, operator, mine)
            models_seen = [*resolved[slug(name)], plan.requests[key].model]
            assert len(models_seen) == 3 and len({facts(m) for m in models_seen}) == 1, (name, models_seen)
            assert len({m for m in models_seen}) == 1, name  # equal facts, not only the fields listed
            continue
        assert operator is not None and operator[0].startswith(start) and operator[1] == transient, (name, operator)
        assert got == operator[0], (name, got, operator)  # plan: the same line
        if transient:  # the webhook lets apply order settle; the operator retries
            assert v.allowed and v.warnings == (f"{operator[0]}; the operator will retry",), (name, v)
        else:
            assert (v.allowed, v.message, v.code) == (False, operator[0], 422), (name, v)
    # the inline config's parameters come from the spec, and say so, everywhere
    assert plan.requests[f"tenant-a/{slug('inline config')}"].model.params_source == "spec.modelParams"


def test_one_flag_type_from_the_sizing_to_the_status_the_pod_and_back() -> None:
    # issue 29: flags were converted memory.Flags -> api.Flags -> memory.Flags; now the status's type
    # is the memory core's, so what a decision sized is what the status, the pod and plan read back
    from vllmfit.core import memory, placement
    from vllmfit.operator.rendering import builders
    from vllmfit.sources import catalog

    assert memory.Flags is api.Flags
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-a", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.count": "1"}}}
    obj = read.deployment(body("f", {"maxNumSeqs": 8}))
    d = placement.decide(placement.Ledger([placement.node_from_object(node, catalog.gpu_for_label)]),
                         placement.request_from_object(obj, catalog.model(MODEL)))
    assert d.admitted and d.flags is not None and d.flags.kv_cache_memory_bytes
    status = api.VLLMDeploymentStatus(phase="Admitted", flags=d.flags)
    back = api.VLLMDeploymentStatus.model_validate(json.loads(status.model_dump_json(by_alias=True))).flags
    assert back == d.flags and back is not None and back.args() == d.flags.args()
    args = builders.vllm_args(obj.spec, MODEL, back)
    assert args[args.index(f"--port={builders.PORT}") + 1:][:len(d.flags.args())] == d.flags.args()
