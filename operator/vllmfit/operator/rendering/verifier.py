"""The init container that verifies a model cache the tenant can write, before vLLM starts (pure).

When the vllm container could load the model from something the tenant writes -- a volume mounted
into it (a PersistentVolumeClaim cache), a Hugging Face cache variable (`CACHE_ENV`) or
`--download-dir` -- its pod gets a last init container, `vllmfit-verify`: the operator's own image
(vllmfit is in it), no GPU (`NVIDIA_VISIBLE_DEVICES=void`), the restricted security context, the
vllm container's cache variables and the template's volumes mounted read-only. It runs
`python -m vllmfit.verify` (vllmfit.verify) against the digest of the config vllmfit sized and
its parameter count; a cache holding another model fails the pod before vLLM loads anything, and
the operator's Ready condition and Event quote why (vllmfit.operator.booking.pods).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllmfit.core.model.config import sizing_digest
from vllmfit.core.model.facts import ModelArch
from vllmfit.core.spec import api, extraargs, validate

NAME = "vllmfit-verify"
RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}


@dataclass(frozen=True)
class Check:
    """What the init container checks the cache against (a children cache key: hashable)."""

    model: str
    digest: str
    params: int
    image: str
    revision: str | None = None
    download_dir: str | None = None


def tenant_mounts(spec: api.VLLMDeploymentSpec) -> list[dict[str, Any]]:
    """The volumeMounts the podTemplate adds to the vllm container."""
    pod = (spec.pod_template.spec if spec.pod_template else None) or {}
    for c in pod.get("containers") or [] if isinstance(pod, Mapping) else []:
        if isinstance(c, Mapping) and c.get("name") == validate.CONTAINER:
            return [dict(m) for m in c.get("volumeMounts") or [] if isinstance(m, Mapping)]
    return []


def _arg(spec: api.VLLMDeploymentSpec, option: str) -> str | None:
    found = extraargs.values_of(spec.extra_args, option)
    return found[-1][1].strip() if found else None


def check_for(spec: api.VLLMDeploymentSpec, model: ModelArch, image: str) -> Check | None:
    """The check a replica's pod needs (None: the vllm container loads nothing the tenant wrote)."""
    download_dir = _arg(spec, "--download-dir")
    cache_env = any(e.get("name") in validate.CACHE_ENV for e in spec.env)
    if not (tenant_mounts(spec) or cache_env or download_dir):
        return None
    return Check(model.name, sizing_digest(model), model.params, image, _arg(spec, "--revision") or model.revision or None,
                 download_dir)


def init_container(check: Check, spec: api.VLLMDeploymentSpec, env: list[dict[str, Any]]) -> dict[str, Any]:
    """The init container of `check`; `env`: the vllm container's env (its cache variables are copied)."""
    args = ["--model", check.model, "--config-digest", check.digest, "--params", str(check.params)]
    if check.revision:
        args += ["--revision", check.revision]
    if check.download_dir:
        args += ["--download-dir", check.download_dir]
    return {
        "name": NAME,
        "image": check.image,
        "command": ["python", "-m", "vllmfit.verify"],
        "args": args,
        "env": [*(dict(e) for e in env if e.get("name") in validate.CACHE_ENV),
                {"name": "NVIDIA_VISIBLE_DEVICES", "value": validate.VOID}],
        "volumeMounts": [{**m, "readOnly": True} for m in tenant_mounts(spec)],
        "resources": RESOURCES,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "readOnlyRootFilesystem": True},
    }
