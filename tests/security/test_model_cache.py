"""A model cache the tenant can write is verified before vLLM starts (vllmfit.verify, rendered by
vllmfit.operator.rendering.verifier): a cache holding a Llama-3.1-8B whose config.json triples
`intermediate_size` (about 42 GiB against a 20.6 GiB booking) fails the pod, with the reason in its
Ready condition; the ordinary PVC cache (examples/model-cache.yaml) stays admitted and is verified.
On the old code nothing checked the cache: the pod had no init container and vLLM loaded it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllmfit import verify
from vllmfit.core.model.config import parse_hf_config, sizing_digest
from vllmfit.core.spec import api, read
from vllmfit.operator.booking import pods
from vllmfit.operator.rendering import builders, verifier
from vllmfit.sources import catalog

pytestmark = pytest.mark.looptime

ROOT = Path(__file__).resolve().parents[2]
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
REV = "0e9e39f249a16976918f6564b8830bc894c89659"


def catalog_config(name: str) -> dict[str, Any]:
    entries = yaml.safe_load((ROOT / "catalog" / "models.yaml").read_text())
    return dict(next(e for e in entries if e["name"] == name)["config"])


def cached(root: Path, config: dict[str, Any], *, rev: str = REV, index_params: int | None = None,
           shard_bytes: int = 0) -> Path:
    """A Hugging Face hub cache under `root` holding one snapshot of Llama 3.1 8B, as huggingface_hub lays it out."""
    snap = root / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({**config, "transformers_version": "4.43.0"}))
    if index_params is not None:
        (snap / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": 2 * index_params}, "weight_map": {}}))
    if shard_bytes:
        with open(snap / "model-00001-of-00001.safetensors", "wb") as f:
            f.truncate(shard_bytes)  # sparse: its size is what counts
    return snap


ARCH = catalog.model(LLAMA)


def run(tmp_path: Path, env: dict[str, str], *extra: str) -> tuple[int, str]:
    log = tmp_path / "termination-log"
    rc = verify.main(["--model", LLAMA, "--config-digest", sizing_digest(ARCH), "--params", str(ARCH.params),
                      "--termination-log", str(log), *extra], env)
    return rc, log.read_text() if log.exists() else ""


def test_the_digest_of_the_real_config_is_the_catalogs() -> None:
    assert sizing_digest(parse_hf_config({**catalog_config(LLAMA), "bos_token_id": 1}, name=LLAMA)) == sizing_digest(ARCH)


def test_the_real_cache_passes(tmp_path: Path) -> None:
    cached(tmp_path / "hf" / "hub", catalog_config(LLAMA), index_params=ARCH.params, shard_bytes=2 * ARCH.params)
    assert run(tmp_path, {"HF_HOME": str(tmp_path / "hf")}) == (0, "")


def test_an_empty_cache_passes(tmp_path: Path) -> None:
    assert run(tmp_path, {"HF_HUB_CACHE": str(tmp_path / "nothing")}) == (0, "")


@pytest.mark.parametrize("change", [{"intermediate_size": 3 * 14336}, {"num_hidden_layers": 96},
                                    {"torch_dtype": "float32"}, {"vocab_size": 1 << 20}])
def test_a_substituted_config_fails_the_pod_with_why(tmp_path: Path, change: dict[str, Any]) -> None:
    cached(tmp_path / "hub", {**catalog_config(LLAMA), **change})
    rc, why = run(tmp_path, {"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert rc == 1 and "is not the config.json vllmfit sized for meta-llama/Llama-3.1-8B-Instruct" in why, why


def test_more_parameters_or_bytes_than_sized_fail(tmp_path: Path) -> None:
    cached(tmp_path / "a", catalog_config(LLAMA), index_params=3 * ARCH.params)
    rc, why = run(tmp_path, {"HF_HUB_CACHE": str(tmp_path / "a")})
    assert rc == 1 and f"more than the {ARCH.params} vllmfit sized" in why
    cached(tmp_path / "b", catalog_config(LLAMA), shard_bytes=5 * ARCH.params)
    rc, why = run(tmp_path, {}, "--download-dir", str(tmp_path / "b"))  # vLLM's --download-dir is the cache
    assert rc == 1 and "bytes of safetensors" in why


def test_a_pinned_revision_checks_that_snapshot(tmp_path: Path) -> None:
    cached(tmp_path / "hub", {**catalog_config(LLAMA), "intermediate_size": 3 * 14336}, rev="f" * 40)
    cached(tmp_path / "hub", catalog_config(LLAMA))
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    assert run(tmp_path, env, "--revision", REV)[0] == 0
    assert run(tmp_path, env)[0] == 1  # unpinned: vLLM may load any of them


# --- Rendering: the ordinary PVC cache gets the verifier; a plain spec does not


def example_cache_spec() -> api.VLLMDeployment:
    docs = list(yaml.safe_load_all((ROOT / "examples" / "model-cache.yaml").read_text()))
    body = next(d for d in docs if d["kind"] == "VLLMDeployment")
    return read.checked(read.deployment(body), catalog_model=True)


def render(obj: api.VLLMDeployment, image: str = "ghcr.io/vllmfit/vllmfit:test") -> dict[str, Any]:
    p = api.ReplicaPlacement(replica=0, node="gpu-a", gpus=[api.GpuRef(index=0, uuid="GPU-0", product="H100")])
    flags = api.Flags(max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.5)
    return builders.deployment(obj, p, flags, LLAMA, exclusive=False,
                               verify=verifier.check_for(obj.spec, ARCH, image))["spec"]["template"]["spec"]


def test_the_pvc_cache_example_is_admitted_and_verified_before_vllm_starts() -> None:
    obj = example_cache_spec()
    pod = render(obj)
    last = pod["initContainers"][-1]
    assert last["name"] == "vllmfit-verify" and last["image"] == "ghcr.io/vllmfit/vllmfit:test"
    assert last["command"] == ["python", "-m", "vllmfit.verify"]
    assert last["args"][last["args"].index("--config-digest") + 1] == sizing_digest(ARCH)
    assert last["volumeMounts"] == [{"name": "model-cache", "mountPath": "/cache/huggingface", "readOnly": True}]
    assert {"name": "HF_HOME", "value": "/cache/huggingface"} in last["env"]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in last["env"]
    assert "resources" in last and "nvidia.com/gpu" not in str(last["resources"])


def test_download_dir_or_a_cache_variable_alone_get_the_verifier_and_a_plain_spec_none() -> None:
    def obj(**spec: Any) -> api.VLLMDeployment:
        return read.checked(read.deployment({"metadata": {"name": "x", "namespace": "t"},
                                             "spec": {"model": LLAMA, **spec}}), catalog_model=True)
    assert "initContainers" not in render(obj())
    pod = render(obj(extraArgs=["--download-dir", "/models", "--revision", REV]))
    args = pod["initContainers"][-1]["args"]
    assert args[-4:] == ["--revision", REV, "--download-dir", "/models"]
    assert render(obj(env=[{"name": "HF_HUB_CACHE", "value": "/x"}]))["initContainers"][-1]["name"] == "vllmfit-verify"


def test_a_branch_revision_is_refused() -> None:
    with pytest.raises(read.SpecError, match="only a commit"):
        read.checked(read.deployment({"metadata": {"name": "x", "namespace": "t"},
                                      "spec": {"model": LLAMA, "extraArgs": ["--revision", "main"]}}), catalog_model=True)


def test_a_failed_verification_fails_the_replica_with_its_message() -> None:
    pod = {"metadata": {}, "status": {"phase": "Pending", "initContainerStatuses": [{
        "name": "vllmfit-verify", "state": {"terminated": {"exitCode": 1, "message": "model cache refused: x"}}}]}}
    h = pods.pod_health(pod)
    assert (h.ready, h.reason, h.failed, h.message) == (False, "ModelCacheRefused", True, "model cache refused: x")


# --- The running operator (KMock): the example is admitted, its pods verify, a refusal is reported

async def test_the_operator_renders_the_verifier_and_reports_a_refused_cache(cluster: Any, operator: Any) -> None:
    import uuid as uuidlib

    from opkit import DEPLOYMENTS, node

    from vllmfit.core import defaults

    await cluster.create(node("gpu-a", gpus=1))
    docs = list(yaml.safe_load_all((ROOT / "examples" / "model-cache.yaml").read_text()))
    body = next(d for d in docs if d["kind"] == "VLLMDeployment")
    body["metadata"].update({"uid": str(uuidlib.uuid4()), "resourceVersion": "1", "generation": 1,
                             "creationTimestamp": "2030-01-01T00:00:00Z"})
    body["spec"] = {**body["spec"], "replicas": 1}
    await cluster.create(body)
    name = body["metadata"]["name"]
    await cluster.phase(name, "Admitted")
    dep = await cluster.until(lambda: cluster.get(DEPLOYMENTS, f"{name}-0"), what="the Deployment")
    assert dep["spec"]["template"]["spec"]["initContainers"][-1]["name"] == "vllmfit-verify"
    uid = str(uuidlib.uuid4())
    await cluster.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{name}-0-abcde", "namespace": "default", "uid": uid, "resourceVersion": "1",
        "labels": {defaults.DEPLOYMENT_LABEL: name, "vllmfit.dev/replica": "0",
                   defaults.MANAGED_BY_LABEL: defaults.MANAGED_BY}},
        "status": {"phase": "Pending", "initContainerStatuses": [{
            "name": "vllmfit-verify", "ready": False, "restartCount": 0, "image": "i", "imageID": "",
            "state": {"terminated": {"exitCode": 1, "message": "model cache refused: config.json is not it"}}}],
            "containerStatuses": [{"name": "vllm", "ready": False, "restartCount": 0, "image": "i", "imageID": "",
                                   "state": {"waiting": {"reason": "PodInitializing"}}}]}})
    ready = await cluster.until(lambda: next((c for c in cluster.status(name).get("conditions") or []
                                              if c["type"] == "Ready" and c["reason"] == "ModelCacheRefused"), None),
                                what="the Ready condition")
    assert ready["message"] == "model cache refused: config.json is not it"
    await cluster.until(lambda: any(e.get("reason") == "ModelCacheRefused" for e in cluster.events(name)),
                        what="the ModelCacheRefused Event")
