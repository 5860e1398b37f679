"""The parts of a VLLMDeployment's spec: the value types, the references to Secrets and
ConfigMaps, placement, the pod template, the KV cache request and LoRA adapters. `vllmfit.core.spec.api`
puts them together into the spec (and re-exports them); `vllmfit crd` generates the CRD from there."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from vllmfit.core import defaults, limits
from vllmfit.core.quantity import QUANTITY_PATTERN, parse_bytes
from vllmfit.core.spec import names
from vllmfit.core.spec.base import ApiModel as _Model

Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Quantization = Literal["fp8", "int8", "w8a8", "awq", "gptq", "w4a16", "mxfp4", "compressed-tensors", "bitsandbytes"]
KvCacheDtype = Literal["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
PlacementPolicy = Literal["bestFit", "spread"]
MaxLoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]  # vllm/config/lora.py MaxLoRARanks (0.12-0.33)
LoraDtype = Literal["auto", "float16", "bfloat16"]  # vllm/config/lora.py LoRADType


def _raise(problem: str | None) -> None:
    if problem:
        raise ValueError(problem)


class _KeyRef(_Model):
    """A key in an object of the deployment's namespace: the name and the key are checked the way
    the API server checks them (`KIND` names the object in messages)."""

    KIND: ClassVar[str]

    @field_validator("name", check_fields=False)
    @classmethod
    def _name(cls, v: str) -> str:
        _raise(names.dns_subdomain_problem(f"{cls.KIND} name", v))
        return v

    @field_validator("key", check_fields=False)
    @classmethod
    def _key(cls, v: str) -> str:
        _raise(names.configmap_key_problem(f"{cls.KIND} key", v))
        return v


class SecretKeyRef(_KeyRef):
    """A key in a Secret of the deployment's namespace."""

    KIND: ClassVar[str] = "Secret"
    name: str = Field(description="Name of the Secret.", min_length=1)
    key: str = Field(default="token", description="Key in the Secret that holds the value.")


class ConfigMapKeyRef(_KeyRef):
    """A key in a ConfigMap of the deployment's namespace."""

    KIND: ClassVar[str] = "ConfigMap"
    name: str = Field(description="Name of the ConfigMap.", min_length=1)
    key: str = Field(default="config.json", description="Key in the ConfigMap that holds a Hugging Face config.json.")


class PlacementSpec(_Model):
    """Where the deployment may run. Everything is optional: vllmfit places it by itself."""

    node_name: str | None = Field(default=None, description="Pin every replica to this node.")
    gpu_indices: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None,
        max_length=64,
        description="Pin to these GPU indices (as NVML numbers them) on nodeName; "
        "length must be tensorParallelSize x pipelineParallelSize.",
    )
    node_selector: dict[str, str] | None = Field(
        default=None, description="Only nodes whose labels match all of these are considered."
    )
    allow_reschedule: bool = Field(
        default=True,
        description="When the pinned node or GPUs overfit but others fit, place the deployment there "
        "(with a warning) instead of rejecting it.",
    )
    nodes: int | None = Field(
        default=None,
        ge=1,
        le=limits.MAX_NODES_PER_REPLICA,
        description="Nodes one replica spans (a LeaderWorkerSet of this many pods, one per node, "
        "tensorParallelSize x pipelineParallelSize / nodes GPUs each). Unset: one node when some node "
        "has that many GPUs of one type, else the fewest nodes that hold them.",
    )

    @field_validator("gpu_indices")
    @classmethod
    def _distinct(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("gpuIndices must not repeat a GPU")
        return v

    @field_validator("node_name")
    @classmethod
    def _node(cls, v: str | None) -> str | None:
        if v is not None:
            _raise(names.dns_subdomain_problem("nodeName", v))
        return v

    policy: PlacementPolicy = Field(
        default="bestFit",
        description="bestFit packs onto the GPUs with the least headroom left that still fit; "
        "spread prefers the GPUs with the most headroom.",
    )


class PodTemplateMetadata(_Model):
    """Labels and annotations added to the generated pods (keys vllmfit sets are refused)."""

    labels: dict[str, str] | None = Field(default=None, description="Extra pod labels.")
    annotations: dict[str, str] | None = Field(default=None, description="Extra pod annotations.")


# The shape of the PodSpec fields a template may carry, checked by pydantic (`pod_spec_problem`)
# and written into the CRD (`POD_SPEC_SCHEMA`, a structural schema the API server enforces), so
# that `affinity: "x"` is refused at the door instead of breaking the merge. Unknown fields keep
# being preserved; their types are Kubernetes' business when the Deployment is written.
def _described(schema: dict[str, Any], where: str) -> dict[str, Any]:
    """`schema` with a description on it and on every property and item below (kubectl explain)."""
    out = {"description": f"As {where} of a v1 Pod (shape checked by vllmfit).", **schema}
    if "properties" in out:
        out["properties"] = {k: _described(v, f"{where}.{k}") for k, v in out["properties"].items()}
    if "items" in out:
        out["items"] = _described(out["items"], f"an item of {where}")
    return out


_OBJ: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_STR_LIST: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
_CONTAINER: dict[str, Any] = {
    "type": "object", "x-kubernetes-preserve-unknown-fields": True, "required": ["name"],
    "properties": {
        "name": {"type": "string"}, "image": {"type": "string"}, "command": _STR_LIST, "args": _STR_LIST,
        "env": {"type": "array", "items": {**_OBJ, "required": ["name"], "properties": {"name": {"type": "string"}}}},
        "envFrom": {"type": "array", "items": _OBJ},
        "resources": _OBJ, "securityContext": _OBJ, "volumeMounts": {"type": "array", "items": _OBJ},
        "ports": {"type": "array", "items": _OBJ},
        "startupProbe": _OBJ, "readinessProbe": _OBJ, "livenessProbe": _OBJ, "lifecycle": _OBJ,
    },
}
_POD_SPEC_FIELDS: dict[str, dict[str, Any]] = {
    **{k: _OBJ for k in ("affinity", "securityContext", "dnsConfig", "nodeSelector", "overhead")},
    **{k: {"type": "array", "items": _OBJ} for k in (
        "tolerations", "volumes", "imagePullSecrets", "topologySpreadConstraints", "hostAliases", "readinessGates",
        "resourceClaims", "schedulingGates", "ephemeralContainers")},
    "containers": {"type": "array", "items": _CONTAINER},
    "initContainers": {"type": "array", "items": _CONTAINER},
    **{k: {"type": "string"} for k in (
        "serviceAccountName", "serviceAccount", "priorityClassName", "schedulerName", "restartPolicy", "dnsPolicy",
        "hostname", "subdomain", "preemptionPolicy", "runtimeClassName", "nodeName")},
    **{k: {"type": "boolean"} for k in (
        "hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace", "automountServiceAccountToken",
        "enableServiceLinks", "setHostnameAsFQDN", "hostUsers")},
    **{k: {"type": "integer"} for k in ("priority", "terminationGracePeriodSeconds", "activeDeadlineSeconds")},
}
POD_SPEC_FIELDS: dict[str, dict[str, Any]] = {k: _described(v, f"spec.{k}") for k, v in _POD_SPEC_FIELDS.items()}
POD_SPEC_SCHEMA: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True, "properties": POD_SPEC_FIELDS}
_JSON_TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
                                            "integer": (int,)}
_NAMES = {"object": "an object", "array": "a list", "string": "a string", "boolean": "true or false",
          "integer": "a whole number"}


def _shape_problem(value: Any, schema: dict[str, Any], where: str) -> str | None:
    """The first place `value` does not have the JSON type `schema` gives (None: it does)."""
    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(value, _JSON_TYPES[kind]) and not (kind == "integer" and isinstance(value, bool))
        if not ok:
            shown = type(value).__name__ if not isinstance(value, str | int | float | bool) else repr(value)[:40]
            return f"{where} must be {_NAMES[kind]} (got {shown})"
    if isinstance(value, dict):
        for req in schema.get("required", ()):
            if req not in value:
                return f"{where}.{req} is required"
        for key, sub in (schema.get("properties") or {}).items():
            if key in value and value[key] is not None and (p := _shape_problem(value[key], sub, f"{where}.{key}")):
                return p
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            label = item.get("name") if isinstance(item, dict) and isinstance(item.get("name"), str) else i
            if (p := _shape_problem(item, schema["items"], f"{where}[{label}]")) is not None:
                return p
    return None


def pod_spec_problem(spec: Any) -> str | None:
    """Why a podTemplate.spec fragment is malformed (a field of the wrong JSON type), else None."""
    return _shape_problem(spec, {"type": "object", "properties": POD_SPEC_FIELDS}, "podTemplate.spec")


class PodTemplate(_Model):
    """What the generated pods get on top of what vllmfit writes (docs/operator.md, "Pod template").

    `spec` is a v1 PodSpec fragment merged into each replica's pod: tolerations, volumes,
    imagePullSecrets, init and extra containers are appended; securityContext is merged over
    vllmfit's restricted defaults; serviceAccountName, priorityClassName, affinity and the other
    allowed fields are set; a container named `vllm` is merged into vLLM's own container
    (volumeMounts appended; securityContext merged; imagePullPolicy, envFrom, probe timings set).
    What a template may set is an allow-list (docs/webhook.md, "What a tenant may write"); fields
    vllmfit owns (the vLLM arguments, the GPU binding, its labels) are refused with the spec field
    to use instead.
    """

    metadata: PodTemplateMetadata | None = Field(default=None, description="Pod labels and annotations.")
    spec: dict[str, Any] | None = Field(
        default=None,
        description="A v1 PodSpec fragment merged into the generated pods.",
        json_schema_extra=POD_SPEC_SCHEMA,
    )

    @field_validator("spec")
    @classmethod
    def _spec_shape(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            _raise(pod_spec_problem(v))
        return v


class KvCacheSpec(_Model):
    """The KV capacity a server asks for: at most one of tokens, memory and concurrency.
    Unset: one request of the full maxModelLen (vLLM refuses to start with less)."""

    tokens: int | None = Field(default=None, ge=1, le=limits.MAX_KV_TOKENS,
                               description="KV capacity in tokens (over all requests in flight).")
    memory: Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v)] | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="KV capacity per GPU as a Kubernetes quantity (e.g. 20Gi), passed as --kv-cache-memory-bytes.",
    )
    concurrency: int | None = Field(
        default=None, ge=1, le=limits.MAX_NUM_SEQS, description="Requests of typicalLength tokens the KV cache holds at once."
    )
    typical_length: int | None = Field(
        default=None,
        ge=1,
        le=limits.MAX_CONTEXT,
        description="A typical request's tokens (prompt + output): with concurrency it sizes the KV cache; "
        "status reports the concurrency at this length. Unset: maxModelLen.",
    )
    grow: bool = Field(
        default=False,
        description="Let the KV cache grow into the room its GPUs have left when it is placed "
        "(never below the request; later deployments cannot use that room).",
    )

    @field_validator("memory")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        if v is not None:
            n = parse_bytes(v, "kvCache.memory")
            if not 1 <= n <= limits.MAX_KV_BYTES:
                raise ValueError(f"kvCache.memory {v} must be between 1 byte and {limits.MAX_KV_BYTES >> 50} PiB")
        return v

    @model_validator(mode="after")
    def _one_request(self) -> KvCacheSpec:
        if self.tokens is not None and self.memory is not None:
            raise ValueError(
                f"kvCache gives both tokens ({self.tokens}) and memory ({self.memory}); keep tokens (it means the "
                "same on every GPU type and tensor-parallel size) and remove memory"
            )
        if self.concurrency is not None and (self.tokens is not None or self.memory is not None):
            raise ValueError("kvCache gives both concurrency and tokens/memory; keep one")
        return self

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else parse_bytes(self.memory, "kvCache.memory")


class LoraSpec(_Model):
    """LoRA adapters: vllmfit injects --enable-lora --max-loras --max-lora-rank (and --lora-dtype) and
    books the adapter slots vLLM allocates on every GPU (docs/memory-model.md, "LoRA adapters")."""

    max_loras: int = Field(default=defaults.LORA_MAX_LORAS, ge=1, le=limits.MAX_LORAS,
                           description="Adapters served in one batch: GPU slots allocated at start-up (--max-loras).")
    max_lora_rank: MaxLoraRank = Field(default=defaults.LORA_MAX_RANK, description="Largest adapter rank (--max-lora-rank); "
                                       "every slot is allocated at this rank.")
    lora_dtype: LoraDtype = Field(default="auto", description="dtype of the adapter slots (--lora-dtype); "
                                  "auto: the model's dtype.")
