"""spec.extraArgs checked the way `vllm serve` parses them (pure).

vLLM's `FlexibleArgumentParser` (vllm/utils/argparse_utils.py; researched in
/work/stage/vllm-flags.md section 1) is an argparse parser with `allow_abbrev` on, after a
normalisation pass. So one flag has many spellings, and every one of them must be caught:

- `--flag=value` and `--flag value`;
- underscores in a long option's name become dashes (`--max_model_len`), up to the first `.`;
- dotted JSON keys (`--hf-overrides.num_hidden_layers 2`, `-cc.mode=3`) set the base option;
- any unique prefix of a long option is that option (`--gpu-memory-util=0.99`, `--kv-cache-memory=80G`);
  an ambiguous prefix is an error in vLLM, and is refused here when a refused option is among
  its candidates;
- a single-dash alias takes prefixes too, and its first two characters may carry the value
  (`-t 2` is `-tp 2`, `-qfp8` is `-q fp8`); `-O3` / `-O 3` / `-Odecode` set the compilation or
  optimization level;
- boolean options have `--no-X` forms (and `--enable-X` / `--disable-X` pairs in 0.33).

A flag is refused when vllmfit sets it itself (use the spec field instead: LoRA is spec.lora, CPU
weight offload spec.cpuOffload), when it would stop the pod from serving where vllmfit expects (port,
host, a config file that can set anything), or when it changes GPU memory in a way vllmfit does not
model (speculative decoding: a draft model is a second model to size; KV offload, CUDA-graph and
compilation settings, hf-overrides...). `--lora-modules` and `--max-cpu-loras` (adapters to load,
host memory) are allowed; `--swap-space` too: host memory only (vLLM 0.11-0.17; gone from 0.19). The option table is
the union of vLLM 0.11 to 0.33, so a prefix refused in one version is refused in all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Refused long options -> why (the text after "extraArgs X ").
_SET = "is set by vllmfit; use {} instead"
_FIXED = "is set by vllmfit; remove it"
_MEMORY = "changes GPU memory ({}) in a way vllmfit does not model; remove it"
_LOADS = "loads {}; use spec.model (and spec.modelConfig for a model that is not on the Hub) instead"
_IMPORTS = "imports code into the server, where it can take GPU memory vllmfit did not book; remove it"
_DRAFT = "a draft model's weights, KV cache and CUDA graphs: a second model vllmfit does not size"

REFUSED: dict[str, str] = {
    "--model": _SET.format("spec.model"),
    "--max-model-len": _SET.format("spec.maxModelLen"),
    "--max-num-seqs": _SET.format("spec.maxNumSeqs"),
    "--gpu-memory-utilization": _SET.format("spec.gpuMemoryUtilization"),
    "--device-memory-utilization": _SET.format("spec.gpuMemoryUtilization"),
    "--kv-cache-memory-bytes": _SET.format("spec.kvCache (tokens, memory or concurrency: the KV cache is sized from it)"),
    "--max-num-batched-tokens": _SET.format("spec.maxNumBatchedTokens"),
    "--tensor-parallel-size": _SET.format("spec.tensorParallelSize"),
    "--pipeline-parallel-size": _SET.format("spec.pipelineParallelSize"),
    "--data-parallel-size": _SET.format("spec.replicas"),
    "--dtype": _SET.format("spec.dtype"),
    "--quantization": _SET.format("spec.quantization"),
    "--kv-cache-dtype": _SET.format("spec.kvCacheDtype"),
    "--enforce-eager": _SET.format("spec.enforceEager"),
    "--port": _FIXED + " (the Service and probes use port 8000)",
    "--host": _FIXED + " (the Service and probes use port 8000)",
    "--config": "loads a file that can set any flag; put its flags in the spec or extraArgs",
    "--block-size": _FIXED + " (the KV cache is sized with vLLM's default block size)",
    "--num-gpu-blocks-override": _MEMORY.format("the KV cache size, ignoring the profile"),
    # Data, context and expert parallelism and multi-node: a different layout per GPU.
    "--data-parallel-size-local": _SET.format("spec.replicas"),
    "--data-parallel-rank": _SET.format("spec.replicas"),
    "--data-parallel-start-rank": _SET.format("spec.replicas"),
    "--data-parallel-address": _SET.format("spec.replicas"),
    "--data-parallel-rpc-port": _SET.format("spec.replicas"),
    "--data-parallel-backend": _SET.format("spec.replicas"),
    "--data-parallel-hybrid-lb": _SET.format("spec.replicas"),
    "--data-parallel-external-lb": _SET.format("spec.replicas"),
    "--data-parallel-multi-port-external-lb": _SET.format("spec.replicas"),
    "--decode-context-parallel-size": _MEMORY.format("the KV cache layout"),
    "--prefill-context-parallel-size": _MEMORY.format("the KV cache layout"),
    "--enable-expert-parallel": _MEMORY.format("expert weights per GPU"),
    "--nnodes": _MEMORY.format("a multi-node layout"),
    "--node-rank": _MEMORY.format("a multi-node layout"),
    # Memory vllmfit does not model.
    # Speculative decoding: a draft model is a second model (its own config, weights, KV cache and
    # graphs) that vllmfit would have to resolve and size next to the target; not modelled.
    "--speculative-config": _MEMORY.format(_DRAFT),
    "--spec-method": _MEMORY.format(_DRAFT),
    "--spec-model": _MEMORY.format(_DRAFT),
    "--spec-tokens": _MEMORY.format(_DRAFT),
    # LoRA and CPU offload are modelled: spec.lora and spec.cpuOffload set these flags.
    "--enable-lora": _SET.format("spec.lora (maxLoras, maxLoraRank, loraDtype: the adapter slots are sized from it)"),
    "--max-loras": _SET.format("spec.lora.maxLoras"),
    "--max-lora-rank": _SET.format("spec.lora.maxLoraRank"),
    "--lora-dtype": _SET.format("spec.lora.loraDtype"),
    "--lora-extra-vocab-size": _MEMORY.format("extra vocabulary rows per LoRA slot (vLLM 0.11)"),
    "--fully-sharded-loras": _MEMORY.format("LoRA slot shapes sharded by TP"),
    "--enable-tower-connector-lora": _MEMORY.format("LoRA slots on the multimodal encoder"),
    "--specialize-active-lora": _MEMORY.format("CUDA graphs per number of active LoRAs"),
    "--cpu-offload-gb": _SET.format("spec.cpuOffload (a quantity per GPU, e.g. 10Gi)"),
    "--cpu-offload-params": _MEMORY.format("which weights go to CPU; spec.cpuOffload offloads any"),
    "--offload-backend": _MEMORY.format("the weight offloader; use spec.cpuOffload"),
    "--offload-group-size": _MEMORY.format("prefetch offloading of weights; use spec.cpuOffload"),
    "--offload-num-in-group": _MEMORY.format("prefetch offloading of weights; use spec.cpuOffload"),
    "--offload-prefetch-step": _MEMORY.format("prefetch offloading of weights; use spec.cpuOffload"),
    "--offload-params": _MEMORY.format("prefetch offloading of weights; use spec.cpuOffload"),
    "--kv-offloading-size": _MEMORY.format("KV offload staging buffers"),
    "--kv-offloading-backend": _MEMORY.format("KV offload staging buffers"),
    "--kv-transfer-config": _MEMORY.format("KV connector buffers"),
    "--hf-overrides": _MEMORY.format("the model's architecture"),
    "--compilation-config": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--optimization-level": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--cudagraph-capture-sizes": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--max-cudagraph-capture-size": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--cuda-graph-sizes": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--max-seq-len-to-capture": _MEMORY.format("CUDA graphs; use spec.enforceEager to turn them off"),
    "--limit-mm-per-prompt": _MEMORY.format("the multimodal encoder profile"),
    "--skip-mm-profiling": _MEMORY.format("the multimodal encoder profile"),
    "--mm-encoder-tp-mode": _MEMORY.format("the multimodal encoder weights"),
    "--mm-ipc-gpu-memory-gb": _MEMORY.format("the KV cache"),
    "--mamba-cache-dtype": _MEMORY.format("Mamba state"),
    "--mamba-ssm-cache-dtype": _MEMORY.format("Mamba state"),
    "--mamba-block-size": _MEMORY.format("Mamba state"),
    "--disable-hybrid-kv-cache-manager": _MEMORY.format("KV cache per request"),
    "--disable-sliding-window": _MEMORY.format("the context length"),
    "--kv-sharing-fast-prefill": _MEMORY.format("the KV cache"),
    "--calculate-kv-scales": _MEMORY.format("the KV cache"),
    "--performance-mode": _MEMORY.format("the batch defaults"),
    "--enable-chunked-prefill": _MEMORY.format("the batch defaults"),
    "--max-num-partial-prefills": _MEMORY.format("the batch defaults"),
    "--enable-sleep-mode": _MEMORY.format("the allocator"),
    "--enable-dbo": _MEMORY.format("micro-batch workspaces"),
    "--all2all-backend": _MEMORY.format("all2all workspaces"),
    # What is loaded must be what vllmfit sized (issue 21 item 4): another revision of the
    # weights or of the model's code, a config from elsewhere, or extra loader settings.
    "--revision": _LOADS.format("another revision of the weights and config.json than the one sized"),
    "--code-revision": _LOADS.format("another revision of the model's code than the one sized"),
    "--hf-config-path": _LOADS.format("a config.json from another place than the one sized"),
    "--model-loader-extra-config": _LOADS.format("loader settings (tensorizer, sharded state) that change what "
                                                 "is loaded"),
    # Code imported into the server by name: it runs next to the model on a shared GPU and can
    # allocate memory there that nothing books.
    "--worker-cls": _IMPORTS,
    "--worker-extension-cls": _IMPORTS,
    "--logits-processors": _IMPORTS,
    "--logits-processor-pattern": _IMPORTS + " (requests name the processors to import)",
    "--scheduler-cls": _IMPORTS,
    "--middleware": _IMPORTS,
    "--tool-parser-plugin": _IMPORTS,
    "--reasoning-parser-plugin": _IMPORTS,
    "--io-processor-plugin": _IMPORTS,
    "--additional-config": "passes settings to platform plugins vllmfit does not know; remove it",
}

# Single-dash aliases of vLLM 0.11-0.33 (vllm-flags.md, "Short aliases") -> their long option.
ALIASES: dict[str, str] = {
    "-q": "--quantization",
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpl": "--data-parallel-size-local",
    "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size",
    "-ep": "--enable-expert-parallel",
    "-cc": "--compilation-config",
    "-O": "--optimization-level",
    "-sc": "--speculative-config",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-dpn": "--data-parallel-rank",
    "-dpr": "--data-parallel-start-rank",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-dpb": "--data-parallel-backend",
    "-dph": "--data-parallel-hybrid-lb",
    "-dpe": "--data-parallel-external-lb",
    "-dpm": "--data-parallel-multi-port-external-lb",
    "-asc": "--api-server-count",
    "-ac": "--attention-config",
    "-dc": "--diffusion-config",
}

# Allowed options that are prefixes of refused ones (`--reasoning-parser` of `--reasoning-parser-plugin`).
ALLOWED_EXACT = frozenset({"--reasoning-parser"})

# Options allowed with some values only -> (allowed values, why the others are refused).
VALUE_RULES: dict[str, tuple[frozenset[str], str]] = {
    # vLLM's LoadFormat (0.11-0.33): these read the checkpoint vllmfit sized, as it is. dummy
    # (random weights), tensorizer, sharded_state, gguf, bitsandbytes and mistral load
    # something else, or quantize while loading.
    "--load-format": (frozenset({"auto", "pt", "safetensors", "npcache", "fastsafetensors", "runai_streamer"}),
                      ("loads other weights than the checkpoint vllmfit sized (or quantizes them while loading); "
                      "use auto, safetensors, pt, npcache, fastsafetensors or runai_streamer")),
    # mistral reads params.json, not the config.json vllmfit sized.
    "--config-format": (frozenset({"auto", "hf"}), ("reads another config than the config.json vllmfit sized; use "
                        "auto or hf")),
    # A dotted value is a class vLLM imports; ray needs a Ray cluster vllmfit does not place.
    "--distributed-executor-backend": (frozenset({"mp", "uni"}),
                                       "only mp and uni run the replica on the GPUs vllmfit booked for it"),
}


def _value_option(name: str) -> str | None:
    """The value-checked option a long option token resolves to (exactly or as a prefix)."""
    hits = [o for o in VALUE_RULES if o == name] or [o for o in VALUE_RULES if o.startswith(name) and len(name) > 3]
    return hits[0] if len(hits) == 1 else None


def _spellings(option: str) -> list[str]:
    """Every option string argparse registers for a refused option: itself, --no-X (booleans
    use BooleanOptionalAction), and the --enable-X / --disable-X twin (0.33)."""
    name = option[2:]
    out = [option, f"--no-{name}"]
    for a, b in (("enable-", "disable-"), ("disable-", "enable-")):
        if name.startswith(a):
            twin = b + name[len(a):]
            out += [f"--{twin}", f"--no-{twin}"]
    return out


_REFUSED_SPELLINGS: dict[str, str] = {s: opt for opt in REFUSED for s in _spellings(opt)}


@dataclass(frozen=True)
class Problem:
    arg: str  # the extraArgs entry as written
    option: str  # the vLLM option it resolves to
    message: str


def _resolve_long(name: str) -> list[str]:
    """The refused options a long option token can resolve to (argparse: exact, else prefixes)."""
    if name in _REFUSED_SPELLINGS:
        return [_REFUSED_SPELLINGS[name]]
    if name in ALLOWED_EXACT:
        return []  # argparse takes an exact match over longer options it is a prefix of
    return sorted({opt for s, opt in _REFUSED_SPELLINGS.items() if s.startswith(name)})


def _resolve_short(token: str) -> list[str]:
    """A single-dash token: an alias exactly, a prefix of aliases, or an alias in its first two
    characters with the value glued on (argparse's _get_option_tuples)."""
    name = token.split("=", 1)[0].split(".", 1)[0]
    if name.startswith("-O"):  # -O3, -O 3, -O=3, -Odecode (vLLM rewrites them before argparse)
        return ["--optimization-level"]
    if name in ALIASES:
        target = ALIASES[name]
        return [target] if target in REFUSED else []
    cands = {ALIASES[a] for a in ALIASES if a.startswith(name) or a == name[:2]}
    return sorted(c for c in cands if c in REFUSED)


def problems(args: Sequence[str]) -> list[Problem]:
    """Every extraArgs entry that sets a refused option, however it is spelled."""
    out: list[Problem] = []
    args = [str(a) for a in args]
    for n, arg in enumerate(args):
        token = str(arg).strip()
        if not token.startswith("-") or token in ("-", "--"):
            continue  # a value, or the end of options
        if token.startswith("--"):
            head = token.split("=", 1)[0]
            base, _, _ = head.partition(".")  # dotted JSON keys set their base option
            base = base.replace("_", "-").lower()  # vLLM: underscores -> dashes before the first '.'
            hits = _resolve_long(base)
            if (checked := _value_option(base)) is not None:
                value = token.split("=", 1)[1] if "=" in token else (args[n + 1] if n + 1 < len(args) else "")
                allowed, why = VALUE_RULES[checked]
                if value.strip() not in allowed:
                    alias = "" if head == checked else f"(= {checked}) "
                    out.append(Problem(arg, checked, f"extraArgs {head} {alias}{value.strip()[:60]!r} {why}"))
        else:
            if _is_number(token):
                continue  # a negative number is a value
            hits = _resolve_short(token)
        flag = token.split("=", 1)[0]
        for opt in hits:
            alias = "" if flag.split(".", 1)[0] == opt else f"(= {opt}) "
            out.append(Problem(arg, opt, f"extraArgs {flag} {alias}{REFUSED[opt]}"))
    return out


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def messages(args: Sequence[str]) -> list[str]:
    """One line per refused entry (deduplicated, in order)."""
    seen: dict[str, None] = {}
    for p in problems(args):
        seen.setdefault(p.message, None)
    return list(seen)
