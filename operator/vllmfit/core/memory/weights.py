"""Weight bytes on the fullest GPU of a group: quantization, TP and PP sharding, the padded
vocabulary and the RoPE cache (vllm policy); ADR-0002's formula (adr policy)."""

from __future__ import annotations

import math

from vllmfit.core import defaults
from vllmfit.core.memory import split
from vllmfit.core.memory.types import Settings
from vllmfit.core.model.facts import DTYPE_BYTES, GpuType, ModelArch, ceil_div

# --- Weights -----------------------------------------------------------------------------------


def activation_dtype_bytes(model: ModelArch, s: Settings) -> int:
    if s.dtype != "auto":
        return DTYPE_BYTES[s.dtype]
    # vLLM runs float32 checkpoints in bfloat16 unless asked otherwise
    return 2 if model.torch_dtype in ("float32", "float") else DTYPE_BYTES[model.torch_dtype]


def _quant_bytes_per_param(method: str, group: int) -> float:
    """Bytes per quantized weight, scales included."""
    if method in ("fp8", "int8", "w8a8"):
        return 1.0
    if method == "mxfp4":
        return 0.5 + 1 / 32  # 4-bit values + one e8m0 scale per 32
    # int4 (awq / gptq / w4a16): 4 bits + an fp16 scale and a 4-bit zero point per group
    return 0.5 + (2 + 0.5) / (group or 128)


def weights_bytes(model: ModelArch, s: Settings) -> int:
    """Weights on the fullest GPU of the group (vllm policy): the largest of its stages'."""
    if s.pp == 1:
        return stage_weights_bytes(model, s, None)
    return max(stage_weights_bytes(model, s, st) for st in split.stages(model, s.pp))


def stage_weights_bytes(model: ModelArch, s: Settings, stage: split.Stage | None) -> int:
    """Weights on one GPU of pipeline stage `stage` (None: the whole model, pp 1), as vLLM splits
    the layers (`split`): the stage's share of the attention and other per-layer weights, its own
    dense-MLP and MoE layers (a MoE model's leading dense layers sit on the first stage), the
    embedding on the first stage and the LM head on the last."""
    dt = activation_dtype_bytes(model, s)
    emb = model.embedding_params
    lm_head = 0 if model.tie_word_embeddings else emb
    experts = model.expert_params if model.is_moe else 0
    # A quantized checkpoint keeps its vision tower in the activation dtype: vLLM quantizes only the
    # layers the checkpoint stores quantized (AWQ's maybe_update_config turns every layer whose
    # safetensors dtype is fp16/bf16/fp32 into modules_to_not_convert; compressed-tensors and
    # modelopt list their targets / ignore), and AutoAWQ, llm-compressor and modelopt leave the
    # vision encoder out. Online quantization (--quantization fp8) does quantize its linear layers.
    vision = model.vision_params if model.quant else 0
    other = max(model.params - emb - lm_head - experts - vision, 0)

    method: str | None = None
    group = 0
    experts_only = False
    if model.quant:
        method, group, experts_only = model.quant.method, model.quant.group_size, model.quant.experts_only
    if s.quantization in ("fp8", "int8", "w8a8") and not model.quant:
        method = "fp8"
    elif s.quantization == "bitsandbytes" and not model.quant:
        method, group = "int4", 64

    def linear_bytes(n: float, quantized: bool) -> float:
        return n * (_quant_bytes_per_param(method, group) if (method and quantized) else dt)

    vocab_bytes = math.ceil(model.vocab_size / (64 * s.tp)) * 64 * model.hidden_size * dt  # padded to 64 x tp
    rope = model.rope_cache_elems * dt  # replicated on every rank
    # TP shards every linear layer and the vocabulary; PP splits the layers into stages.
    if stage is None:
        layer_bytes = linear_bytes(other, not experts_only) + linear_bytes(experts, True) + vision * dt
        return int(layer_bytes / s.tp + vocab_bytes * (2 if lm_head else 1) + rope)
    # a MoE model's dense-MLP layers are counted where they sit; the rest of `other` (attention,
    # shared experts, norms) is the same in every layer
    dense_mlp = model.expert_matrices * model.hidden_size * model.intermediate_size if model.is_moe else 0
    n_dense = model.num_layers - model.moe_layers if model.is_moe else 0
    rest = max(other - dense_mlp * n_dense, 0)
    on_stage = (linear_bytes(rest * stage.layers / model.num_layers + dense_mlp * stage.dense, not experts_only)
                + linear_bytes(experts * stage.moe / model.moe_layers if model.moe_layers else 0, True)
                + vision * dt * stage.layers / model.num_layers) / s.tp
    return int(on_stage + (vocab_bytes if stage.first else 0) + (vocab_bytes if stage.last and lm_head else 0) + rope)


MARLIN_MXFP4_ALIGN = (256, 128)
"""(hidden, intermediate per TP rank) alignment of MXFP4 experts under the Marlin MoE kernel, which
vLLM picks for MXFP4 below SM90 in 0.11, 0.21 and 0.33 (mxfp4.py create_weights /
mxfp4_round_up_hidden_size_and_intermediate_size: "the moe marlin kernel requires n % 256 == 0 and
k % 128 == 0"; 0.21/0.33's Triton MoE needs SM90+). The padded weights are allocated as such."""


def mxfp4_padding_bytes(model: ModelArch, s: Settings, gpu: GpuType) -> int:
    """Bytes the padding of MXFP4 experts adds per GPU (issue 23). Below SM90 (Marlin): hidden to a
    multiple of 256, the TP rank's intermediate to 128 (gpt-oss: 2880 -> 3072 x 2944, +9%).
    SM90 and newer pick Triton / FlashInfer kernels whose padding changes by version: not modelled
    (docs/memory-model.md gives the bound)."""
    if not (model.quant and model.quant.method == "mxfp4" and model.is_moe and not model.moe_latent_size):
        return 0
    if gpu.compute_capability is None or gpu.compute_capability >= (9, 0):
        return 0
    h, i = model.hidden_size, ceil_div(model.moe_intermediate_size, s.tp)
    h_pad = ceil_div(h, MARLIN_MXFP4_ALIGN[0]) * MARLIN_MXFP4_ALIGN[0]
    i_pad = ceil_div(i, MARLIN_MXFP4_ALIGN[1]) * MARLIN_MXFP4_ALIGN[1]
    matrices = model.moe_layers * model.num_experts * model.expert_matrices
    layers_on_stage = ceil_div(model.moe_layers, s.pp) / model.moe_layers
    return int(matrices * (h_pad * i_pad - h * i) * _quant_bytes_per_param("mxfp4", 32) * layers_on_stage)


def cpu_offloaded_bytes(model: ModelArch, s: Settings) -> int:
    """Weight bytes of the fullest rank that vLLM keeps in CPU memory with --cpu-offload-gb.

    vllm/model_executor/models/utils.py `make_layers` passes each decoder layer of the rank's stage,
    in order, through `maybe_offload_to_cpu` (0.11-0.15; from 0.17 `UVAOffloader._maybe_offload_to_cpu`,
    vllm/model_executor/offloader/uva.py), which moves parameter after parameter to pinned CPU memory
    (a UVA view stays on the GPU's address space, no GPU bytes) while the bytes moved so far are below
    the limit. So at least min(limit, the decoder layers' bytes) leaves the GPU, and at most one
    parameter more: booking weights - that is a slight over-reserve, never an under-reserve. The
    embeddings, lm_head, final norm and a vision tower are not offloaded here (not built by
    make_layers; counted as never offloaded)."""
    if s.cpu_offload_bytes <= 0:
        return 0
    full = weights_bytes(model, s)
    dt = activation_dtype_bytes(model, s)
    emb = model.embedding_params
    lm_head = 0 if model.tie_word_embeddings else emb
    vocab = math.ceil(model.vocab_size / (64 * s.tp)) * 64 * model.hidden_size * dt
    stage_vocab = vocab * ((2 if lm_head else 1) if s.pp == 1 else 1)
    # what is not a decoder layer: the vocabulary on this stage, the RoPE cache, the final norm, a vision tower
    layers = full - stage_vocab - model.rope_cache_elems * dt - model.hidden_size * dt - model.vision_params * dt
    return max(min(s.cpu_offload_bytes, layers), 0)


def cpu_offload_arg(nbytes: int) -> str:
    """--cpu-offload-gb takes GiB as a float (vllm/config/offload.py `UVAOffloadConfig.cpu_offload_gb`;
    `CacheConfig.cpu_offload_gb` before 0.17) and vLLM multiplies it back: int(gb * 1024**3). A byte
    count divided by 2**30 is exact in a float (below 2**53), and repr gives the shortest text that
    reads back as the same float, so vLLM gets exactly these bytes."""
    return f"--cpu-offload-gb={nbytes / 2**30!r}"


def adr_weights_bytes(model: ModelArch, s: Settings) -> int:
    """ADR-0002: params x bytesPerParam(weightDtype) / tp x (1 + replicationOverheadPct)."""
    return int(model.params * adr_bytes_per_param(model, s) / s.tp * (1 + defaults.REPLICATION_OVERHEAD))


def adr_bytes_per_param(model: ModelArch, s: Settings) -> float:
    method = s.quantization or (model.quant.method if model.quant else None)
    if method in ("fp8", "int8", "w8a8"):
        return 1.0  # q8
    if method in ("awq", "gptq", "w4a16", "int4", "mxfp4", "bitsandbytes"):
        return 0.5  # q4
    return float(DTYPE_BYTES[s.dtype] if s.dtype != "auto" else DTYPE_BYTES.get(model.torch_dtype, 2))
