"""LoRA adapters (spec.lora -> --enable-lora --max-loras N --max-lora-rank R): the GPU memory vLLM
allocates for N adapter slots of rank R, as it allocates it (read in vLLM 0.11.0, 0.12.0, 0.15.0,
0.17.0, 0.19.0, 0.21.0 and 0.33.0; nothing was measured on a GPU).

Where the bytes come from (paths inside the vLLM repo):

- `vllm/lora/model_manager.py` (`vllm/lora/models.py` in 0.11) `LoRAModelManager._create_lora_modules`
  wraps every module whose name ends in a supported suffix (`vllm/lora/utils.py`
  `get_supported_lora_modules`: every `LinearBase`, plus the model class's `embedding_modules`),
  whether or not an adapter targets it; `fully_sharded_loras` is off by default.
- Each wrapper's `create_lora_weights` allocates zeroed stacks of `max_loras` slots in `lora_dtype`
  (`vllm/config/lora.py` `LoRAConfig.verify_with_model_config`: "auto" is the model's dtype):
  - `vllm/lora/layers/base_linear.py` `BaseLinearLayerWithLoRA.create_lora_weights`, per slice:
    `lora_a (N, 1, R, input_size)` and `lora_b (N, 1, output_size, R)`;
  - column-parallel layers (`column_parallel_linear.py`): input_size is the full input, the output
    is the TP shard; `MergedQKVParallelLinearWithLoRA` has 3 slices (q = heads/tp x head_dim,
    k = v = max(1, kv_heads // tp) x head_dim), `MergedColumnParallelLinearWithLoRA` 2 (gate, up:
    intermediate/tp each);
  - row-parallel layers (`row_parallel_linear.py` `RowParallelLinearWithLoRA`): input_size is the
    TP shard (o_proj: heads x head_dim / tp; down_proj: intermediate / tp), output the full hidden;
  - `vocal_parallel_embedding.py` (`vocab_parallel_embedding.py` in 0.33)
    `VocabParallelEmbeddingWithLoRA`: `lora_a (N, vocab, R)`, `lora_b (N, 1, hidden, R)`, not
    sharded; first PP stage only;
  - `logits_processor.py` `LogitsProcessorWithLoRA` (lm_head): `lora_a (N, 1, R, hidden)`,
    `lora_b (N, 1, vocab, R)`, not sharded; last PP stage only; vLLM refuses a vocabulary larger
    than 257024 (<= 0.16) / 258048 (>= 0.17).
- `vllm/lora/punica_wrapper/punica_base.py` `PunicaWrapperBase.__init__` (4 int64 tensors of
  max_num_batched_tokens, 3 of max_num_seqs) and `punica_gpu.py` `PunicaWrapperGPU.__init__`
  (two `LoRAKernelMeta.make`, `vllm/lora/ops/triton_ops/lora_kernel_metadata.py`: 2 int32 tensors of
  max_num_batched_tokens and 3 of max_loras + 1 or + 2).

vLLM counts all of it as model weights: `GPUModelRunner.load_model` (and the 0.33 V2 runner) calls
`load_lora_model` inside the `DeviceMemoryProfiler` block that logs "Model loading took".

At run time (the profile run uses dummy adapters of rank R,
`LoRAModelRunnerMixin.maybe_dummy_run_with_lora`): `PunicaWrapperGPU.add_lora_linear` allocates a
float32 shrink buffer (slices, tokens, R) per layer (the largest: qkv, 3 slices);
`add_lora_logits` one (rows, R); with TP > 1 `LogitsProcessorWithLoRA._get_logits` re-indexes the
gathered logits into a new tensor (one more copy of the logits in the model dtype).

CUDA graphs: `CompilationConfig.cudagraph_specialize_lora` (default True in every version read)
captures every graph once without and once with LoRA (`CudagraphDispatcher._get_lora_cases`);
vllmfit books the graph term twice. The pool is shared between captures, so this is an upper
bound, not a measurement.

Not derived (refused with one line): vLLM before 0.12 (0.11 adds `lora_extra_vocab_size` rows to the
embedding and lm_head weights, per model file), MoE experts (`FusedMoEWithLoRA`, different in every
version), MLA, recurrent-state hybrids, multimodal towers, pooling models, and architectures whose
vLLM model class was not read (`ARCHITECTURES`).
"""

from __future__ import annotations

from vllmfit.core import limits
from vllmfit.core.memory.types import Settings
from vllmfit.core.memory.versions import VllmVersion
from vllmfit.core.memory.weights import activation_dtype_bytes
from vllmfit.core.model.facts import DTYPE_BYTES, ModelArch, ceil_div

# --- What vLLM accepts ------------------------------------------------------------------------

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""`MaxLoRARanks` (vllm/config/lora.py, 0.12 to 0.33): any other --max-lora-rank is refused."""
LORA_DTYPES = ("auto", "float16", "bfloat16")
"""`LoRADType` (vllm/config/lora.py): "auto" is the model's dtype."""
LORA_GRAPH_CASES = 2
"""`CudagraphDispatcher._get_lora_cases` with cudagraph_specialize_lora (default True): [no LoRA, LoRA]."""
FIRST_MODELLED = 12
"""0.12 removed `lora_extra_vocab_size` (0.11 grew the embedding and lm_head weights by it)."""

ARCHITECTURES: dict[str, tuple[int, ...]] = {
    # architecture -> the vLLM minors whose model class has no `embedding_modules` (no embedding or
    # lm_head LoRA there); every other version books them (read: 0.12, 0.15, 0.17, 0.19, 0.21, 0.33;
    # an unread version books them too: never less than vLLM allocates).
    # packed_modules_mapping of all four: qkv_proj = [q, k, v], gate_up_proj = [gate, up].
    "LlamaForCausalLM": (),  # models/llama.py: embed_tokens, lm_head in every version read
    "MistralForCausalLM": (15, 17, 19, 21, 33),  # models/mistral.py (0.15+): embedding_modules = {}
    "Qwen2ForCausalLM": (12, 15, 17, 19, 21, 33),  # models/qwen2.py: no embedding_modules
    "Qwen3ForCausalLM": (12, 15),  # models/qwen3.py: embedding_modules from 0.17
}
"""Dense decoders whose vLLM model class was read in every modelled version."""


def logits_vocab_limit(version: VllmVersion) -> int:
    """LogitsProcessorWithLoRA.create_lora_weights: "vocab size must be <= 258048" from 0.17; before,
    `32000 < vocab_size > 257024` refuses anything above 257024."""
    return 258048 if version.at_least(17) else 257024


def embedding_lora(model: ModelArch, version: VllmVersion) -> bool:
    """Whether vLLM wraps embed_tokens and lm_head (the model class lists `embedding_modules`)."""
    return version.minor not in ARCHITECTURES.get(model.architecture, ())


def lora_errors(model: ModelArch, s: Settings, version: VllmVersion) -> list[str]:
    """Why spec.lora cannot be sized (or run) for this model and version; one line each."""
    if s.lora_max_loras is None:
        return []
    errors: list[str] = []
    if not 1 <= s.lora_max_loras <= limits.MAX_LORAS:
        errors.append(f"lora.maxLoras {s.lora_max_loras} must be between 1 and {limits.MAX_LORAS}")
    if s.lora_max_rank not in MAX_LORA_RANKS:
        errors.append(f"lora.maxLoraRank {s.lora_max_rank} is not one vLLM accepts "
                      f"({', '.join(map(str, MAX_LORA_RANKS))})")
    if s.lora_dtype not in LORA_DTYPES:
        errors.append(f"lora.loraDtype {s.lora_dtype!r} is not one of {', '.join(LORA_DTYPES)}")
    if s.policy != "vllm":
        errors.append("lora is sized by the vllm memory policy only; remove lora or use the vllm policy")
    elif not version.at_least(FIRST_MODELLED):
        errors.append(f"lora is modelled for vLLM 0.12 and later (vLLM {version.label} adds "
                      "lora_extra_vocab_size rows to the embeddings per model); use a newer image")
    elif reason := _not_derived(model):
        errors.append(f"lora on {model.name}: {reason}; vllmfit does not size it (remove lora)")
    elif embedding_lora(model, version) and model.vocab_size > logits_vocab_limit(version):
        errors.append(f"lora on {model.name}: vLLM {version.label} refuses LoRA for a vocabulary of "
                      f"{model.vocab_size} (at most {logits_vocab_limit(version)})")
    return errors


def _not_derived(model: ModelArch) -> str | None:
    if model.pooling:
        return "pooling models are not modelled with LoRA"
    if model.is_mla:
        return "LoRA on MLA attention is not modelled"
    if model.is_moe:
        return "LoRA on MoE experts (FusedMoEWithLoRA) is not modelled"
    if model.is_hybrid_state:
        return "LoRA on recurrent-state layers is not modelled"
    if model.vision_params:
        return "LoRA on multimodal models is not modelled"
    if model.architecture not in ARCHITECTURES:
        return (f"the LoRA layers of {model.architecture} were not read in vLLM's code (modelled: "
                f"{', '.join(sorted(ARCHITECTURES))})")
    return None


# --- Bytes --------------------------------------------------------------------------------------


def lora_dtype_bytes(model: ModelArch, s: Settings) -> int:
    """lora_dtype: "auto" is the dtype the model runs in."""
    return DTYPE_BYTES[s.lora_dtype] if s.lora_dtype in DTYPE_BYTES else activation_dtype_bytes(model, s)


def layer_elements(model: ModelArch, tp: int, rank: int) -> int:
    """Elements of one adapter slot in one decoder layer on one TP rank (fully_sharded_loras off)."""
    h, d = model.hidden_size, model.head_dim
    q = model.num_attention_heads // tp * d  # QKVParallelLinear.num_heads x head_size
    kv = max(1, model.num_kv_heads // tp) * d  # kv heads replicated when tp > kv heads
    i = model.intermediate_size // tp
    qkv = 3 * rank * h + rank * (q + 2 * kv)  # MergedQKVParallelLinearWithLoRA: 3 x A (R, h), B (q|k|v, R)
    o = rank * (model.num_attention_heads * d // tp) + h * rank  # RowParallelLinearWithLoRA: A (R, in/tp), B (h, R)
    gate_up = 2 * rank * h + 2 * i * rank  # MergedColumnParallelLinearWithLoRA: 2 x A (R, h), 2 x B (I/tp, R)
    down = rank * i + h * rank  # RowParallelLinearWithLoRA
    return qkv + o + gate_up + down


def embedding_elements(model: ModelArch, rank: int) -> int:
    """VocabParallelEmbeddingWithLoRA (A (vocab, R), B (h, R)) or LogitsProcessorWithLoRA (A (R, h),
    B (vocab, R)): the same count, not sharded by TP."""
    return model.vocab_size * rank + model.hidden_size * rank


def punica_bytes(batched_tokens: int, max_num_seqs: int, max_loras: int) -> int:
    """PunicaWrapperBase + PunicaWrapperGPU metadata tensors (max_num_batched_tokens rounded up to 8
    as LoRAModelManager does)."""
    b = ceil_div(batched_tokens, 8) * 8
    base = 4 * b * 8 + 3 * max_num_seqs * 8  # int64: token/sampler/sampler-padded/embedding indices; 3 per-batch
    meta = 2 * b * 4 + ((max_loras + 1) * 2 + (max_loras + 2)) * 4  # LoRAKernelMeta.make, int32
    return base + 2 * meta  # token_mapping_meta and prompt_mapping_meta


def lora_bytes(model: ModelArch, s: Settings, version: VllmVersion, batched_tokens: int, max_num_seqs: int) -> int:
    """GPU bytes of the adapter slots and punica metadata on the fullest rank (0 without spec.lora)."""
    if s.lora_max_loras is None:
        return 0
    n, r = s.lora_max_loras, s.lora_max_rank
    layers = ceil_div(model.num_layers, s.pp)
    per_slot = layers * layer_elements(model, s.tp, r)
    if embedding_lora(model, version):  # embed_tokens on the first stage, lm_head on the last
        # tied embeddings: where lm_head *is* embed_tokens (qwen2/qwen3.py before 0.33: lm_head =
        # model.embed_tokens), named_modules(remove_duplicate=False) reaches it twice and vLLM wraps it
        # in a second VocabParallelEmbeddingWithLoRA next to the logits LoRA; booked for every tied model
        last = 2 if model.tie_word_embeddings else 1
        per_slot += embedding_elements(model, r) * (1 + last if s.pp == 1 else last)
    return n * per_slot * lora_dtype_bytes(model, s) + punica_bytes(batched_tokens, max_num_seqs, n)


def lora_activation_bytes(model: ModelArch, s: Settings, version: VllmVersion, batched_tokens: int,
                          max_num_seqs: int) -> tuple[int, int]:
    """(forward, logits) bytes the profile run adds with LoRA: the float32 qkv shrink buffer
    (3, tokens, R); the logits shrink buffer (rows, R) and, with TP > 1, the re-indexed logits copy."""
    if s.lora_max_loras is None:
        return 0, 0
    r = s.lora_max_rank
    forward = 3 * batched_tokens * r * 4
    if not embedding_lora(model, version):
        return forward, 0
    rows = min(max_num_seqs, batched_tokens)
    logits = rows * r * 4
    if s.tp > 1:
        logits += rows * ceil_div(model.vocab_size, 64 * s.tp) * 64 * s.tp * activation_dtype_bytes(model, s)
    return forward, logits


def lora_args(max_loras: int, rank: int, dtype: str = "auto") -> list[str]:
    """The `vllm serve` flags for spec.lora."""
    out = ["--enable-lora", f"--max-loras={max_loras}", f"--max-lora-rank={rank}"]
    if dtype != "auto":
        out.append(f"--lora-dtype={dtype}")
    return out
