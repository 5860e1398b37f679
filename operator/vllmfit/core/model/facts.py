"""Model architecture and GPU facts as frozen types: `ModelArch` (what the memory model needs of a
model), `Quant`, `GpuType`; the parameter count from the architecture and the TP check.
A Hugging Face config.json becomes a `ModelArch` in `vllmfit.core.model.config`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from vllmfit.core import limits
from vllmfit.core.model.hybrid import StateSpec


def hash_once(self: object) -> int:
    """`__hash__` of a frozen dataclass, computed once per instance: GPU types, models and settings
    are dict and cache keys on every ledger operation (dataclass's own hash rebuilds the tuple of
    every field each time). The same value as dataclass's (its compared fields)."""
    try:
        return self.__dict__["_hash"]  # type: ignore[no-any-return]
    except KeyError:
        names = _COMPARED.get(type(self))
        if names is None:
            names = _COMPARED[type(self)] = tuple(f.name for f in fields(self) if f.compare)  # type: ignore[arg-type]
        h = hash(tuple([getattr(self, n) for n in names]))
        object.__setattr__(self, "_hash", h)
        return h


_COMPARED: dict[type, tuple[str, ...]] = {}  # class -> the names of its compared fields (hash_once)


class once:
    """`functools.cached_property` without its lock (Python 3.11 takes an RLock on every first read:
    about 10 us, paid once per GPU slot and footprint, 80,000 slots at fleet size). The value is
    computed on first read and stored in the instance's __dict__, which later reads find first.
    Only for pure values of frozen objects (two threads computing it at once store equal values)."""

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func, self.name, self.__doc__ = func, func.__name__, func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.func(instance)
        return value


T = TypeVar("T")


def quick_init(cls: type[T]) -> type[T]:
    """A frozen dataclass whose `__init__` sets its fields in one step (the new instance's
    `__dict__`), not one `object.__setattr__` call per field as dataclasses' frozen `__init__` does:
    about 0.4 us a field on this project's CI machine (a 26-field `Settings` took 12.5 us to build,
    1.9 us unfrozen; a decision builds a `Decision`, a `ReplicaAllocation` and a `Booking` per GPU,
    and `dataclasses.replace` builds through `__init__` too). The same signature, defaults and
    result (tested against the dataclass's own `__init__`, kept in `QUICK_INIT_ORIGINAL`); refused
    at import for a class with `__post_init__`, `default_factory`, `init=False` or keyword-only fields.
    The cost: the instance keeps a dict of its own instead of CPython's compact per-class layout
    (about 170 bytes more each; a field read about a fifth slower), already the case for a class
    whose instances cache a value (`once`, `hash_once`). So it is for the classes built in every
    decision (measured: the 10,000-node plan's peak RSS 261 -> 275 MB), not for those kept by the
    tens of thousands and read all the time (`GpuSlot`, `NodeInfo`: 295 MB with them too)."""
    fs = fields(cls)  # type: ignore[arg-type]
    if hasattr(cls, "__post_init__") or any(
            not f.init or f.kw_only or f.default_factory is not MISSING for f in fs):
        raise TypeError(f"quick_init: {cls.__name__} has a field or hook it does not build")
    params = ", ".join(f.name if f.default is MISSING else f"{f.name}=_d_{f.name}" for f in fs)
    body = ", ".join(f"{f.name!r}: {f.name}" for f in fs)
    ns: dict[str, Any] = {"_set": object.__setattr__, **{f"_d_{f.name}": f.default for f in fs}}
    src = f"def __init__(self, {params}):\n    _set(self, '__dict__', {{{body}}})\n"
    exec(src, ns)  # noqa: S102 - the class's own field names, as dataclasses generates its __init__
    init = ns["__init__"]
    init.__qualname__, init.__module__ = f"{cls.__qualname__}.__init__", cls.__module__
    QUICK_INIT_ORIGINAL[cls] = cls.__init__  # type: ignore[misc]
    cls.__init__ = init  # type: ignore[misc]
    return cls


QUICK_INIT_ORIGINAL: dict[type, Callable[..., None]] = {}  # class -> the dataclass's own __init__ (tests)


def state_without_hash(self: object) -> dict[str, object]:
    """`__getstate__` of a class using `hash_once`: str hashes differ between processes, so the
    cached hash is never pickled or copied."""
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}


class ModelConfigError(ValueError):
    """A config.json that cannot describe a model vLLM can serve (message: one line, with the fix)."""


# model_type values vLLM runs with MLA when the config has kv_lora_rank (vllm/config/model.py).
# (vllm 0.33 transformers_utils/model_arch_config_convertor.py `is_deepseek_mla`)
MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_k2", "kimi_vl", "kimi_linear",
                   "glm4_moe_lite", "glm_moe_dsa", "deepseek_mtp", "longcat_flash", "pangu_ultra_moe"}

# model_type values whose KV layout vllmfit's rules cover: the families of tests/data/hf-configs
# and catalog/models.yaml, compared with vLLM's own start-up sizing (docs/oracle.md). A config of
# any other type is sized with the standard-attention rules and a warning at admission.
KNOWN_MODEL_TYPES = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2", "gemma", "gemma2", "gemma3",
    "gemma3_text", "gemma4", "gemma4_text", "gpt_oss", "granite", "llama", "llama4", "llama4_text", "mistral",
    "mixtral", "mimo", "mimo_v2_flash", "minimax_m2", "nemotron_h", "nemotron-nas", "phi3", "qwen2", "qwen2_5_vl",
    "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_5",
    "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "step3p7", "xlm-roberta", "bert",
    "granitemoehybrid", "jamba", "falcon_h1", "lfm2", "lfm2_moe", "minimax_text_01", "minimax_m1",
})

# model_type values whose KV cache vLLM sizes by rules vllmfit does not have, where the standard
# rules would promise more than vLLM gives: refused (a warning would admit an over-promise).
# DeepSeek-V4 (vLLM 0.21+ models/deepseek_v4): compressed and sliding MLA layers with their own
# pages; sized as DeepSeek-V3's MLA, the KV cache is over-promised 4.7-5x (issue 23, item 6).
UNMODELLED_MODEL_TYPES = {
    "deepseek_v4": "compressed / sliding MLA (vLLM's models/deepseek_v4) is not modelled yet, and sizing it as "
                   "DeepSeek-V3's MLA would promise about 5x the KV cache vLLM gives",
}

# bytes per element of torch dtypes
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class Quant:
    """How the checkpoint's linear weights are stored."""

    method: str  # "fp8" | "int8" | "int4" | "mxfp4" | "nvfp4"
    bits: float  # bits per weight element, scales excluded
    group_size: int = 0  # elements per scale group (0 = per channel)
    experts_only: bool = False  # mxfp4 in gpt-oss: only the MoE experts are quantized
    kv_fp8: bool = False  # the checkpoint carries an fp8 KV-cache scheme
    block_n: int = 0  # fp8 block quantization: output rows per scale block (weight_block_size[0])
    scheme: str = ""  # the checkpoint's own method name where vLLM treats it apart ("modelopt_mixed")


@dataclass(frozen=True)
class ModelArch:
    """What the memory model needs to know about one model. Integers are counts, not bytes."""

    __hash__ = hash_once
    __getstate__ = state_without_hash

    name: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int  # KV head size as vLLM computes it (MLA: kv_lora_rank + qk_rope_head_dim)
    intermediate_size: int
    vocab_size: int
    max_model_len: int  # the model's maximum context as vLLM derives it
    tie_word_embeddings: bool
    torch_dtype: str
    params: int  # exact total parameter count (vision tower included)
    params_source: str  # "catalog", "safetensors-index" or "computed"
    layer_types: tuple[str, ...] = ()  # per layer: "full" or "sliding" ("" entries mean no KV)
    sliding_window: int | None = None
    kv_lora_rank: int = 0  # MLA when > 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0  # routed experts (0 = dense)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    moe_latent_size: int = 0  # latent MoE (Nemotron 3 Super): routed experts work in this width
    first_k_dense: int = 0  # leading dense layers in a MoE model
    quant: Quant | None = None
    pooling: bool = False  # embedding / reranker (vLLM pooling runner): no decode KV pool
    vision_params: int = 0
    attention_bias: bool = False
    attn_output_gate: bool = False  # q_proj also emits a gate (Qwen3-Next, Qwen3.5)
    rope_cache_elems: int = 0  # cos/sin cache vLLM keeps per rotary embedding (positions x rotary dim)
    kv_head_dim_v: int = 0  # V head size of (non-MLA) attention when it differs from head_dim (0: the same)
    full_num_kv_heads: int = 0  # full-attention layers' own KV heads / head size (Gemma 4: global_*; 0: the same)
    full_head_dim: int = 0
    swa_num_kv_heads: int = 0  # sliding-window layers' own KV heads / head sizes (MiMo-V2: swa_*; 0: the same)
    swa_head_dim: int = 0
    swa_head_dim_v: int = 0
    revision: str = ""  # the Hub commit its config was read at (pinned in the pod: --revision); "" catalog/inline
    swa_attention_sinks: bool = False  # sliding layers carry attention sinks (MiMo-V2 add_swa_attention_sink_bias)
    min_batched_tokens: int = 0  # vLLM raises a defaulted max_num_batched_tokens to this (Gemma 4 multimodal)
    indexer_head_dim: int = 0  # sparse MLA (DeepSeek-V3.2, GLM-5): the indexer's key cache per layer (index_head_dim)
    state: StateSpec | None = None  # recurrent state of Mamba / short-conv / GDN / linear-attention layers
    state_layers: tuple[bool, ...] = ()  # per layer: carries a recurrent state
    mlp_kinds: tuple[str, ...] = ()  # per layer: "dense" | "moe" | "" (none); () = first_k_dense rule
    gated_mlp: bool = True  # gate + up + down (False: up + down, e.g. relu2 in Nemotron-H)
    warnings: tuple[str, ...] = ()  # what the config left unmodelled (unknown layer types), one line each
    source: str = ""
    aliases: tuple[str, ...] = field(default=(), compare=False)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_sparse_mla(self) -> bool:
        """DeepSeek sparse attention: MLA with a lightning indexer (64-token blocks, indexer KV)."""
        return self.is_mla and self.indexer_head_dim > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_state_layers(self) -> int:
        return sum(self.state_layers)

    @property
    def is_hybrid_state(self) -> bool:
        """Has recurrent-state layers (Mamba, short conv, GDN, linear attention)."""
        return self.state is not None and self.num_state_layers > 0

    @property
    def moe_layers(self) -> int:
        if self.mlp_kinds:
            return sum(1 for k in self.mlp_kinds if k == "moe")
        return self.num_layers - self.first_k_dense if self.is_moe else 0

    @property
    def expert_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def embedding_params(self) -> int:
        """Input embedding (vocab x hidden); the lm_head is as large again unless tied."""
        return self.vocab_size * self.hidden_size

    @property
    def expert_params(self) -> int:
        """Parameters in routed experts (the part mxfp4 quantizes, EP/TP shards)."""
        width = self.moe_latent_size or self.hidden_size
        return self.moe_layers * self.num_experts * self.expert_matrices * width * self.moe_intermediate_size


def count_params(a: ModelArch) -> int:
    """Parameter count from the architecture alone (language model; dense, MoE, MLA)."""
    h = a.hidden_size
    if a.is_mla:
        qk_head = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = (h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.num_attention_heads * qk_head) if a.q_lora_rank else (
            h * a.num_attention_heads * qk_head
        )
        kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        kv += a.kv_lora_rank * a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim)
        o = a.num_attention_heads * a.v_head_dim * h
        attn = q + kv + o
    else:
        q_out = a.num_attention_heads * a.head_dim
        kv_out = a.num_kv_heads * a.head_dim
        attn = h * q_out * (2 if a.attn_output_gate else 1) + 2 * h * kv_out + q_out * h
        if a.attention_bias:
            attn += q_out + 2 * kv_out
    m = a.expert_matrices
    dense_mlp = m * h * a.intermediate_size
    width = a.moe_latent_size or h  # latent MoE: fc1/fc2 latent projections around the experts
    moe_mlp = a.num_experts * m * width * a.moe_intermediate_size + h * a.num_experts
    moe_mlp += 2 * h * a.moe_latent_size
    moe_mlp += a.num_shared_experts * m * h * a.moe_intermediate_size
    per_layer_norms = 2 * h
    total = 0
    for i in range(a.num_layers):
        if a.mlp_kinds:
            kind = a.mlp_kinds[i] if i < len(a.mlp_kinds) else "dense"
        else:
            kind = "moe" if a.is_moe and i >= a.first_k_dense else "dense"
        mlp = {"moe": moe_mlp, "dense": dense_mlp}.get(kind, 0)
        has_attn = not a.layer_types or (i < len(a.layer_types) and a.layer_types[i] != "")
        mixer = a.state.params if a.state is not None and i < len(a.state_layers) and a.state_layers[i] else 0
        total += (attn if has_attn else 0) + mixer + mlp + per_layer_norms
    total += a.embedding_params * (1 if a.tie_word_embeddings else 2) + h
    return total



def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_tp(a: ModelArch, tp: int) -> str | None:
    """Why `tp` cannot shard this model, or None. vLLM needs heads % tp == 0, and kv heads
    divisible by tp or tp a multiple of kv heads."""
    if a.num_attention_heads % tp:
        top = min(a.num_attention_heads, limits.MAX_TP)  # never a loop over all heads
        divisors = [d for d in range(1, top + 1) if a.num_attention_heads % d == 0]
        return (
            f"tensor parallel size {tp} does not divide the {a.num_attention_heads} attention heads of {a.name}; "
            f"use one of {', '.join(map(str, divisors[:8]))}"
        )
    if not a.is_mla and a.num_kv_heads % tp and tp % a.num_kv_heads:
        return f"tensor parallel size {tp} and the {a.num_kv_heads} KV heads of {a.name} are not multiples of each other"
    return None




@dataclass(frozen=True)
class GpuType:
    """A GPU product from catalog/gpus.yaml."""

    __hash__ = hash_once
    __getstate__ = state_without_hash

    product: str  # as GPU Feature Discovery labels it (nvidia.com/gpu.product)
    name: str  # as NVML names it
    memory_bytes: int  # NVML total (GFD's nvidia.com/gpu.memory label is this in MiB)
    cuda_total_bytes: int  # what cudaMemGetInfo reports as total: vLLM's T
    aliases: tuple[str, ...] = ()
    architecture: str = ""
    source: str = ""
    compute_capability: tuple[int, int] | None = None  # CUDA (major, minor); None: unknown GPU

    @property
    def cc_label(self) -> str:
        if self.compute_capability is None:
            return "unknown"
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    @property
    def is_a100(self) -> bool:
        return "A100" in self.product
