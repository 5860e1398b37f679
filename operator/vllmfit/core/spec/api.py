"""The VLLMDeployment API (group vllmfit.dev, version v1alpha1): the spec here (its parts in `vllmfit.core.spec.parts`),
the status in `vllmfit.core.spec.status` (both re-exported), the node inventory annotation in `vllmfit.core.observe.inventory`.

These pydantic models are the one source of truth: `vllmfit crd` generates crds/*.yaml from
them, the operator and webhook parse objects with them, and `vllmfit plan` reads exported
cluster files with them. Field names are the camelCase names Kubernetes users write.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from vllmfit.core import defaults, limits
from vllmfit.core.quantity import QUANTITY_PATTERN, parse_bytes
from vllmfit.core.spec import extraargs, names
from vllmfit.core.spec.base import ApiModel as _Model
from vllmfit.core.spec.base import Phase
from vllmfit.core.spec.parts import (
    ConfigMapKeyRef,
    Dtype,
    KvCacheDtype,
    KvCacheSpec,
    LoraDtype,
    LoraSpec,
    MaxLoraRank,
    PlacementPolicy,
    PlacementSpec,
    PodTemplate,
    PodTemplateMetadata,
    Quantization,
    SecretKeyRef,
    _raise,
)
from vllmfit.core.spec.status import (
    Condition,
    Flags,
    GpuHeadroom,
    GpuMemory,
    GpuRef,
    KvCacheStatus,
    ObservedMemory,
    PodPlacement,
    ReplicaPlacement,
    VLLMDeploymentStatus,
)

GROUP = "vllmfit.dev"
VERSION = "v1alpha1"
KIND = "VLLMDeployment"
PLURAL = "vllmdeployments"
FINALIZER = f"{GROUP}/finalizer"
"""The finalizer on every VLLMDeployment: its GPUs are released before the object goes (Kopf's
settings.persistence.finalizer). The mutating webhook sets it at creation; Kopf adds it to any
object that lacks it."""
SINGULAR = "vllmdeployment"
SHORT_NAMES = ["vllmd"]
CATEGORIES = ["vllmfit"]
"""Not "all": `kubectl get all` lists the built-in workloads, and a VLLMDeployment's pods and
Deployments already show there (the convention the Kubernetes API docs give for CRDs)."""

class VLLMDeploymentSpec(_Model):
    """What to serve, and the memory-relevant vLLM settings. Unset numbers are computed by vllmfit."""

    model: str = Field(
        description="Model to serve: a catalog name (see `vllmfit models`) or a Hugging Face repo id.",
        min_length=1,
        max_length=253,
    )
    model_config_inline: dict[str, Any] | None = Field(
        default=None,
        alias="modelConfig",
        description="Inline Hugging Face config.json of the model, for models outside the catalog.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    model_config_ref: ConfigMapKeyRef | None = Field(
        default=None, description="A ConfigMap key holding the model's Hugging Face config.json."
    )
    model_params: int | None = Field(
        default=None, ge=1, le=limits.MAX_PARAMS, description="Exact parameter count, when modelConfig is given and no safetensors index is."
    )
    image: str = Field(
        default=defaults.DEFAULT_IMAGE,
        description="vLLM container image. The vLLM version in its tag selects the memory model; "
        "an unknown tag falls back to the newest modelled version with a warning.",
    )
    vllm_version: str | None = Field(
        default=None,
        pattern=r"^v?[0-9]+\.[0-9]+(\.[0-9]+)?([.+-][0-9A-Za-z.+-]*)?$",
        description="vLLM version the image runs (e.g. 0.21.1), for images pinned by digest or with a tag that "
        "names no version: give the image's org.opencontainers.image.version label. Overrides the tag.",
    )
    strict: bool = Field(
        default=False,
        description="Refuse the model when its config has layer types vllmfit does not model (otherwise a "
        "warning and the ModelUnderstood=False condition).",
    )
    dtype: Dtype = Field(default="auto", description="Weight/activation dtype (vLLM --dtype).")
    quantization: Quantization | None = Field(
        default=None, description="Weight quantization (vLLM --quantization); unset = as the checkpoint is."
    )
    kv_cache_dtype: KvCacheDtype = Field(default="auto", description="KV cache dtype (vLLM --kv-cache-dtype).")
    tensor_parallel_size: int = Field(default=1, ge=1, le=limits.MAX_TP, description="GPUs per pipeline stage (vLLM -tp).")
    pipeline_parallel_size: int = Field(default=1, ge=1, le=limits.MAX_PP, description="Pipeline stages (vLLM -pp).")
    replicas: int = Field(default=1, ge=0, le=limits.MAX_REPLICAS, description="Independent replicas, each its own TP x PP group.")
    max_model_len: int | None = Field(
        default=None, ge=16, le=limits.MAX_CONTEXT, description="Context length (--max-model-len); computed when unset."
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=limits.MAX_NUM_SEQS,
        description="The scheduler's cap on concurrent requests (--max-num-seqs); no memory is reserved for it. "
        "Unset: vLLM's own default for the image's version and the GPU (e.g. 1024 on an H100, 256 on an A100).",
    )
    kv_cache: KvCacheSpec | None = Field(
        default=None,
        description="The KV cache this server should have: tokens, memory, or a concurrency at a typical "
        "request length. Unset: one request of maxModelLen.",
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, le=limits.MAX_BATCHED_TOKENS, description="Tokens per scheduler step (--max-num-batched-tokens); vLLM's default when unset."
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Override of the computed --gpu-memory-utilization; the fit check uses it as given.",
    )
    enforce_eager: bool = Field(default=False, description="Disable CUDA graphs (saves their memory).")
    lora: LoraSpec | None = Field(
        default=None,
        description="Serve LoRA adapters: the adapter slots vLLM allocates are booked on every GPU "
        "(--enable-lora --max-loras --max-lora-rank). Load adapters with extraArgs --lora-modules.",
    )
    cpu_offload: Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v)] | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="Weights per GPU vLLM keeps in pinned CPU memory instead (--cpu-offload-gb), as a Kubernetes "
        "quantity (e.g. 10Gi); the GPU books that much less weight. The container's memory must hold it.",
    )
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="Placement constraints.")
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None, description="Secret key holding the Hugging Face token (for gated models)."
    )
    env: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Extra environment variables of the vLLM container (Kubernetes EnvVar objects), from an "
        "allow-list: Hugging Face tokens and caches, proxies and CAs, vLLM logging and timeouts, locale "
        "(docs/webhook.md, \"What a tenant may write\").",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    resources: dict[str, Any] | None = Field(
        default=None,
        description="CPU/memory requests and limits of the vLLM container; GPU limits are set by vllmfit.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra `vllm serve` arguments, from the options vllmfit classifies as unable to change GPU "
        "memory (docs/webhook.md, \"Every vLLM argument\"). Flags vllmfit computes, and flags that change GPU "
        "memory in ways vllmfit does not model (speculative decoding, LoRA, CPU/KV offload, CUDA-graph settings) "
        "or import code, are refused in any spelling vLLM accepts (prefixes, --flag=value, underscores, aliases).",
    )
    pod_template: PodTemplate | None = Field(
        default=None,
        description="Pod settings merged into the generated pods: tolerations, volumes (a model cache), "
        "imagePullSecrets, serviceAccountName, priorityClassName, labels, annotations, node affinity, "
        "securityContext, extra containers, startup probe timing.",
    )

    @field_validator("model")
    @classmethod
    def _model_name(cls, v: str) -> str:
        _raise(names.model_name_problem(v))
        return v

    @field_validator("extra_args")
    @classmethod
    def _extra_args(cls, v: list[str]) -> list[str]:
        _raise("; ".join(extraargs.messages(v)))
        return v

    @field_validator("cpu_offload")
    @classmethod
    def _offload_quantity(cls, v: str | None) -> str | None:
        if v is not None:
            n = parse_bytes(v, "cpuOffload")
            if not 0 <= n <= limits.MAX_CPU_OFFLOAD_BYTES:
                raise ValueError(f"cpuOffload {v} must be between 0 and {limits.MAX_CPU_OFFLOAD_BYTES >> 50} PiB")
        return v

    @property
    def cpu_offload_bytes(self) -> int:
        return 0 if self.cpu_offload is None else parse_bytes(self.cpu_offload, "cpuOffload")

    @model_validator(mode="after")
    def _batch_holds_seqs(self) -> VLLMDeploymentSpec:
        # maxNumSeqs unset: vLLM's default is min(S_default, B), never above B
        b, s = self.max_num_batched_tokens, self.max_num_seqs
        if b is not None and s is not None and b < s:
            raise ValueError(
                f"maxNumBatchedTokens {b} is less than maxNumSeqs {s}; vLLM refuses to start "
                "(max_num_batched_tokens must be greater than or equal to max_num_seqs)"
            )
        return self


class ObjectMeta(BaseModel):
    """The part of Kubernetes metadata vllmfit reads."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    creation_timestamp: str | None = Field(default=None, alias="creationTimestamp")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class VLLMDeployment(BaseModel):
    """A whole VLLMDeployment object, as read from the API or a file."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    api_version: str = Field(default=f"{GROUP}/{VERSION}", alias="apiVersion")
    kind: Literal["VLLMDeployment"] = "VLLMDeployment"
    metadata: ObjectMeta
    spec: VLLMDeploymentSpec
    status: VLLMDeploymentStatus | None = None

    @property
    def key(self) -> str:
        """namespace/name"""
        return f"{self.metadata.namespace}/{self.metadata.name}"


# --- The node inventory annotation (written by `vllmfit agent`, read by placement) -----------
#
# Forward-compatible: fields are only ever added (schemaVersion counts the additions); a reader
# ignores fields it does not know, so an operator older than its agents (a rolling upgrade) still
# reads every GPU. The values are checked against physical limits in core.placement.nodes.


__all__ = [  # the status types and the spec's parts are part of this API's surface
    "Condition",
    "ConfigMapKeyRef",
    "Dtype",
    "Flags",
    "GpuHeadroom",
    "GpuMemory",
    "GpuRef",
    "KvCacheDtype",
    "KvCacheSpec",
    "KvCacheStatus",
    "LoraDtype",
    "LoraSpec",
    "MaxLoraRank",
    "ObservedMemory",
    "Phase",
    "PlacementPolicy",
    "PlacementSpec",
    "PodPlacement",
    "PodTemplate",
    "PodTemplateMetadata",
    "Quantization",
    "ReplicaPlacement",
    "SecretKeyRef",
    "VLLMDeployment",
    "VLLMDeploymentSpec",
    "VLLMDeploymentStatus",
]
