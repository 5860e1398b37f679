"""The VLLMDeployment API (group vllmfit.dev, version v1alpha1): the spec here, the status in
`vllmfit.core.status` (re-exported), the node inventory annotation in `vllmfit.core.inventory`.

These pydantic models are the one source of truth: `vllmfit crd` generates crds/*.yaml from
them, the operator and webhook parse objects with them, and `vllmfit plan` reads exported
cluster files with them. Field names are the camelCase names Kubernetes users write.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from vllmfit.core import defaults, extraargs, limits, names
from vllmfit.core.apimodel import ApiModel as _Model
from vllmfit.core.apimodel import Phase
from vllmfit.core.quantity import QUANTITY_PATTERN, parse_bytes
from vllmfit.core.status import (
    Condition,
    Flags,
    GpuHeadroom,
    GpuMemory,
    GpuRef,
    KvCacheStatus,
    ObservedMemory,
    ReplicaPlacement,
    VLLMDeploymentStatus,
)

GROUP = "vllmfit.dev"
VERSION = "v1alpha1"
KIND = "VLLMDeployment"
PLURAL = "vllmdeployments"
SINGULAR = "vllmdeployment"
SHORT_NAMES = ["vllmd"]
CATEGORIES = ["vllmfit"]
"""Not "all": `kubectl get all` lists the built-in workloads, and a VLLMDeployment's pods and
Deployments already show there (the convention the Kubernetes API docs give for CRDs)."""

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


class PodTemplate(_Model):
    """What the generated pods get on top of what vllmfit writes (docs/operator.md, "Pod template").

    `spec` is a v1 PodSpec fragment merged into each replica's pod: tolerations, volumes,
    imagePullSecrets, init and extra containers are appended; serviceAccountName,
    priorityClassName, securityContext, affinity and any other field are set; a container named
    `vllm` is merged into vLLM's own container (volumeMounts appended; securityContext,
    imagePullPolicy, probe timings set). Fields vllmfit owns (the vLLM arguments, the GPU
    binding, its labels) are refused with the spec field to use instead.
    """

    metadata: PodTemplateMetadata | None = Field(default=None, description="Pod labels and annotations.")
    spec: dict[str, Any] | None = Field(
        default=None,
        description="A v1 PodSpec fragment merged into the generated pods.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


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
        description="Extra environment variables of the vLLM container (Kubernetes EnvVar objects).",
        json_schema_extra={"items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
    )
    resources: dict[str, Any] | None = Field(
        default=None,
        description="CPU/memory requests and limits of the vLLM container; GPU limits are set by vllmfit.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra `vllm serve` arguments. Flags vllmfit computes, and flags that change GPU memory in "
        "ways vllmfit does not model (speculative decoding, LoRA, CPU/KV offload, CUDA-graph settings), are "
        "refused in any spelling vLLM accepts (prefixes, --flag=value, underscores, aliases).",
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


__all__ = [  # the status types are part of this API's surface
    "Condition",
    "Flags",
    "GpuHeadroom",
    "GpuMemory",
    "GpuRef",
    "KvCacheStatus",
    "LoraSpec",
    "ObservedMemory",
    "Phase",
    "ReplicaPlacement",
    "VLLMDeployment",
    "VLLMDeploymentSpec",
    "VLLMDeploymentStatus",
]
