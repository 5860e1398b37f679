"""Offline subcommands: `estimate`, `models`, `gpus` (here), and `plan`, `status`, `crd` (registered
from their own modules). Thin: parse arguments, call vllmfit.core.memory, print."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from vllmfit.cli import calibration
from vllmfit.cli.inputs import hub_argument, read_input
from vllmfit.cli.output import console, hub_words, write_then
from vllmfit.cli.policy import add_budget_args, budget_from_args
from vllmfit.core import choices, defaults, limits, memory
from vllmfit.core.errors import UserError
from vllmfit.core.model.config import params_from_index, parse_hf_config
from vllmfit.core.model.facts import GpuType, ModelArch, ModelConfigError
from vllmfit.sources import catalog, resolve


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="Does one deployment fit a GPU, and with which vLLM flags?",
        description="Per-GPU memory of one vLLM deployment on empty GPUs, the flags to pass, and fixes.",
        epilog="Exit code: 0 it fits; 1 it does not fit; 2 an input error.",
    )
    configuration_args(p)
    p.add_argument("--output", "-o", default="table", choices=["table", "json"])
    calibration.add_argument(p)
    hub_argument(p)
    p.set_defaults(func=run_estimate)

    ls = sub.add_parser("models", help="List the catalog's models")
    ls.add_argument("--output", "-o", default="table", choices=["table", "wide", "json"],
                    help="table, wide (every column, like kubectl -o wide) or json")
    ls.set_defaults(func=run_models)
    lg = sub.add_parser("gpus", help="List the catalog's GPUs")
    lg.add_argument("--output", "-o", default="table", choices=["table", "wide", "json"],
                    help="table, wide (every column, like kubectl -o wide) or json")
    lg.set_defaults(func=run_gpus)

    for mod in ("vllmfit.cli.plan", "vllmfit.cli.status", "vllmfit.cli.crdgen", "vllmfit.cli.fromlog"):
        try:
            __import__(mod, fromlist=["add_parser"]).add_parser(sub)
        except ImportError:
            pass


def configuration_args(p: argparse.ArgumentParser) -> None:
    """The flags that say which deployment on which GPU (estimate; calibration --from-log)."""
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", help="catalog name, alias, or Hugging Face repo id")
    m.add_argument("--model-config", metavar="PATH",
                   help="a Hugging Face config.json, or a directory holding it (and model.safetensors.index.json)")
    p.add_argument("--params", type=int, help="exact parameter count (with --model-config and no safetensors index)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu", default="NVIDIA-H100-80GB-HBM3", help="GPU product or alias (default: %(default)s)")
    g.add_argument("--gpu-memory-gib", type=float, metavar="X", help="any GPU with X GiB visible to CUDA")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    p.add_argument("--gpus-per-node", type=int, default=defaults.GPUS_PER_NODE, metavar="N",
                   help="GPUs of this type one node has (default %(default)s); tp x pp beyond N spans several "
                        "nodes, one pod of N GPUs (or fewer, whole TP groups) per node, as plan places it")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--quantization", default=None,
                   choices=["fp8", "int8", "w8a8", "awq", "gptq", "w4a16", "mxfp4", "compressed-tensors", "bitsandbytes"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--max-model-len", default="auto", help="context length, or auto (default)")
    p.add_argument("--max-num-seqs", type=int, help="the scheduler's cap on concurrent requests (default: vLLM's for the version and GPU)")
    kv = p.add_argument_group("KV cache request (one of tokens, memory, concurrency; default: --default-kv-requests "
                              "full-length requests, at most --max-num-seqs, granted up to --max-num-seqs x "
                              "--max-model-len as --default-kv-grant and --kv-tenants-per-gpu allow)")
    kv.add_argument("--kv-cache-tokens", type=int, metavar="N", help="KV capacity in tokens")
    kv.add_argument("--kv-cache-memory", metavar="QTY", help="KV capacity per GPU as a Kubernetes quantity, e.g. 20Gi")
    kv.add_argument("--kv-concurrency", type=int, metavar="N", help="requests of --typical-length held at once")
    kv.add_argument("--typical-length", type=int, metavar="N", help="a typical request's tokens (default: max-model-len)")
    kv.add_argument("--kv-grow", action="store_true", help="let the KV cache grow into the room the GPU offers")
    lo = p.add_argument_group("LoRA adapters (spec.lora; any of these turns LoRA on)")
    lo.add_argument("--lora-max-loras", type=int, metavar="N",
                    help=f"adapter slots on the GPU (--max-loras; default {defaults.LORA_MAX_LORAS})")
    lo.add_argument("--lora-max-rank", type=int, metavar="R",
                    help=f"largest adapter rank (--max-lora-rank; default {defaults.LORA_MAX_RANK})")
    lo.add_argument("--lora-dtype", choices=["auto", "float16", "bfloat16"], help="dtype of the slots (default auto)")
    p.add_argument("--cpu-offload", metavar="QTY",
                   help="weights per GPU kept in CPU memory (spec.cpuOffload, --cpu-offload-gb), e.g. 10Gi")
    add_budget_args(p)
    choices.add_kv_grant_arguments(p)
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default: vLLM's, by GPU size)")
    p.add_argument("--gpu-memory-utilization", type=float, help="use this u instead of computing it")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--vllm-version", default=defaults.DEFAULT_VLLM_VERSION, help="X.Y (default: %(default)s)")
    p.add_argument("--strict", action="store_true",
                   help="refuse a model whose config has layer types vllmfit does not model (exit 2)")
    p.add_argument("--policy", default="vllm", choices=["vllm", "adr"], help="memory model (default: %(default)s)")


# --- inputs ------------------------------------------------------------------------------------


SPEC_WORDS_AS_FLAGS = (
    ("kvCache.tokens", "--kv-cache-tokens"), ("kvCache.memory", "--kv-cache-memory"),
    ("kvCache.concurrency", "--kv-concurrency"), ("kvCache.typicalLength", "--typical-length"),
    ("typicalLength", "--typical-length"), ("lora.maxLoraRank", "--lora-max-rank"), ("lora.maxLoras", "--lora-max-loras"),
    ("lora.loraDtype", "--lora-dtype"), ("tensorParallelSize", "--tp"), ("pipelineParallelSize", "--pp"),
    ("maxModelLen", "--max-model-len"), ("maxNumSeqs", "--max-num-seqs"), ("maxNumBatchedTokens", "--max-num-batched-tokens"),
    ("gpuMemoryUtilization", "--gpu-memory-utilization"), ("kvCacheDtype", "--kv-cache-dtype"),
    ("cpuOffload", "--cpu-offload"), ("vllmVersion", "--vllm-version"), ("enforceEager", "--enforce-eager"),
    ("spec.strict", "--strict"), ("dtype: ", "--dtype "), ("quantization: ", "--quantization "),
    ("kvCache gives both", "the KV flags give both"),
)
"""The spec's words in the memory model's messages -> the flags `estimate` takes (the webhook and
the operator keep the spec's words)."""


def cli_error(message: str) -> str:
    """A refusal in the CLI's words: 'kvCache.tokens 4000000 ...' -> '--kv-cache-tokens 4000000 ...'."""
    import re

    for word, flag in SPEC_WORDS_AS_FLAGS:
        message = re.sub(rf"(?<![\w.-]){re.escape(word)}(?![\w])" if word[-1].isalnum() else re.escape(word), flag,
                         message)
    return message


def cli_words(fix: str) -> str:
    """A fix in the CLI's flags: 'budget policy counted (...)' -> '--budget-policy counted (...)',
    'budget policy utilization 0.93 (...)' -> '--budget-utilization 0.93 (...)', 'kvCache: {tokens: N}'
    -> '--kv-cache-tokens N' (instead of the other --kv-* flags), 'kvCache.concurrency: N' ->
    '--kv-concurrency N'; the spec's other fields become flags when printed (render.layout.as_flags)."""
    import re

    fix = re.sub(r"kvCache: \{tokens: (\d+)\}", r"--kv-cache-tokens \1", fix)
    fix = re.sub(r"kvCache\.concurrency: (\d+)", r"--kv-concurrency \1", fix)
    if fix.startswith("budget policy utilization "):
        return "--budget-utilization " + fix.removeprefix("budget policy utilization ")
    if fix.startswith("budget policy "):
        return "--budget-policy " + fix.removeprefix("budget policy ")
    return fix


def _positive(name: str, value: float | None, limit: float | None = None) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"--{name} must be a positive number, got {value}")
    if limit is not None and value > limit:
        raise UserError(f"--{name} {value:g} is more than any real value ({limit:g} at most)")


def load_model_config(path: str, params: int | None = None) -> ModelArch:
    """--model-config: a config.json, or a directory with config.json and maybe
    model.safetensors.index.json (whose metadata.total_size gives the exact parameter bytes)."""
    _positive("params", params, limits.MAX_PARAMS)
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.exists():
        raise UserError(f"{cfg_path}: no such file; pass a config.json or a directory holding one")
    try:
        cfg = json.loads(read_input(cfg_path))
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno}); pass a Hugging Face config.json") from None
    index = cfg_path.parent / "model.safetensors.index.json"
    source = "computed"
    if params is None and index.exists():
        params = params_from_index(json.loads(read_input(index)), cfg)
        source = "safetensors-index"
    name = cfg.get("_name_or_path") or cfg_path.parent.name or "custom"
    try:
        return parse_hf_config(cfg, name=str(name), params=params, params_source=source if params else "computed")
    except ModelConfigError as e:
        raise UserError(f"{cfg_path}: {e}") from None


def resolve_model(name: str, hub: bool = False) -> ModelArch:
    """--model NAME by the one resolver's name step (vllmfit.sources.resolve.by_name): the catalog
    first; a Hugging Face repo id ("org/name") not in it is fetched from the Hub with --hub only.
    Its errors in `estimate`'s words (its flags, not the spec's fields)."""
    try:
        return resolve.by_name(name, hub=hub)
    except resolve.ModelResolutionError as e:
        raise UserError(hub_words(str(e), "flags")) from None


def resolve_gpu(args: argparse.Namespace) -> GpuType:
    if args.gpu_memory_gib is not None:
        _positive("gpu-memory-gib", args.gpu_memory_gib, limits.MAX_GPU_MEMORY_BYTES / defaults.GIB)
        total = int(args.gpu_memory_gib * defaults.GIB)
        return GpuType(product=f"custom-{args.gpu_memory_gib:g}GiB", name="custom", memory_bytes=total,
                       cuda_total_bytes=total)
    return catalog.gpu(args.gpu)


def settings_from_args(args: argparse.Namespace) -> memory.Settings:
    length = None
    if str(args.max_model_len).lower() not in ("auto", "-1"):
        length = parse_length(str(args.max_model_len))
    bounds = {"tp": limits.MAX_TP, "pp": limits.MAX_PP, "max_num_seqs": limits.MAX_NUM_SEQS,
              "max_num_batched_tokens": limits.MAX_BATCHED_TOKENS}
    for name, limit in bounds.items():
        _positive(name.replace("_", "-"), getattr(args, name), limit)
    _positive("gpus-per-node", getattr(args, "gpus_per_node", None), limits.MAX_TP * limits.MAX_PP)
    kv_bounds = {"kv_cache_tokens": limits.MAX_KV_TOKENS, "kv_concurrency": limits.MAX_NUM_SEQS,
                 "typical_length": limits.MAX_CONTEXT}
    for name, limit in kv_bounds.items():
        _positive(name.replace("_", "-"), getattr(args, name), limit)
    kv_bytes = None
    if args.kv_cache_memory is not None:
        from vllmfit.core.quantity import parse_bytes

        try:
            kv_bytes = parse_bytes(args.kv_cache_memory, "--kv-cache-memory")
        except ValueError as e:
            raise UserError(str(e)) from None
    if args.kv_cache_tokens is not None and kv_bytes is not None:
        raise UserError("--kv-cache-tokens and --kv-cache-memory ask the same thing twice; keep --kv-cache-tokens "
                        "(it means the same on every GPU and TP size) and drop --kv-cache-memory")
    lora = args.lora_max_loras is not None or args.lora_max_rank is not None \
        or args.lora_dtype is not None
    _positive("lora-max-loras", args.lora_max_loras, limits.MAX_LORAS)
    offload = 0
    if args.cpu_offload is not None:
        from vllmfit.core.quantity import parse_bytes

        try:
            offload = parse_bytes(args.cpu_offload, "--cpu-offload")
        except ValueError as e:
            raise UserError(str(e)) from None
    u = args.gpu_memory_utilization
    if u is not None and not 0 < u <= 1:
        raise UserError(f"--gpu-memory-utilization {u} must be in (0, 1]; e.g. 0.45 for half of a shared GPU")
    return memory.default_grant(memory.Settings(
        tp=args.tp, pp=args.pp, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=length, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=u, enforce_eager=args.enforce_eager, vllm_version=args.vllm_version,
        policy=args.policy, strict=args.strict, kv_tokens=args.kv_cache_tokens, kv_bytes=kv_bytes,
        kv_concurrency=args.kv_concurrency, typical_len=args.typical_length, kv_grow=args.kv_grow,
        lora_max_loras=(args.lora_max_loras or defaults.LORA_MAX_LORAS) if lora else None,
        lora_max_rank=defaults.LORA_MAX_RANK if args.lora_max_rank is None else args.lora_max_rank,
        lora_dtype=args.lora_dtype or "auto", cpu_offload_bytes=offload,
    ), choices.kv_grant_from_args(args))


def parse_length(text: str) -> int:
    """vLLM's parsing: 32k = 32000, 32K = 32768."""
    mult = {"k": 1000, "K": 1024, "m": 10**6, "M": 1 << 20}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if mult > 1 else text) * mult)
    except (ValueError, OverflowError):
        raise UserError(f"--max-model-len {text!r} is not a number; use e.g. 8192, 32k, 32K or auto") from None
    if not 0 < value <= limits.MAX_CONTEXT:
        raise UserError(f"--max-model-len must be in 1..{limits.MAX_CONTEXT}, got {value}")
    return value


# --- estimate ----------------------------------------------------------------------------------


def run_estimate(args: argparse.Namespace) -> int:
    try:
        return _run_estimate(args)
    except UserError as e:  # the memory model speaks the spec's fields; the CLI speaks its flags
        raise UserError(cli_error(str(e))) from None


def _run_estimate(args: argparse.Namespace) -> int:
    est = estimate_from_args(args)
    verdict = 0 if est.sizing.fits else 1
    if args.output == "json":
        return write_then(verdict, lambda: print(json.dumps(estimate_json(est), indent=2, sort_keys=True)))
    from vllmfit.cli import render

    shown = replace(est, suggestions=tuple(cli_words(x) for x in est.suggestions),
                    sizing=replace(est.sizing, reasons=tuple(cli_error(r) for r in est.sizing.reasons)))
    return write_then(verdict, lambda: render.print_estimate(console(), shown))


def estimate_from_args(args: argparse.Namespace) -> memory.Estimate:
    """The estimate the flags describe (with --calibration's records, where given). Raises UserError."""
    model = load_model_config(args.model_config, args.params) if args.model_config else resolve_model(args.model, args.hub)
    gpu = resolve_gpu(args)
    s = settings_from_args(args)
    if getattr(args, "calibration", None):
        s = replace(s, learned=memory.learned.for_model(calibration.read(args.calibration), model.name))
    policy = budget_from_args(args)
    errors = memory.validate(model, s)
    bad = policy.error(gpu.cuda_total_bytes)
    if bad:
        errors.append(bad.replace("budget reserve", "--budget-reserve"))
    if errors:
        raise UserError(errors[0])
    gpus = (gpu, *catalog.gpus().values())
    too_large = memory.kv_request_too_large(model, s, gpus, policy)
    if too_large:
        raise UserError(too_large)
    try:
        est = memory.estimate(model, s, gpu, other_gpus=tuple(catalog.gpus().values()), policy=policy,
                              gpus_per_node=args.gpus_per_node, grant=choices.kv_grant_from_args(args))
    except memory.SpecError as e:
        raise UserError(str(e)) from None
    return est


def estimate_json(est: memory.Estimate) -> dict[str, Any]:
    """The `vllmfit estimate --output json` contract (README)."""
    z = est.sizing
    fp = z.footprint
    f = z.flags
    return {
        "model": est.model.name,
        "gpu": est.gpu.product,
        "policy": est.settings.policy,
        "vllm_version": est.version.label,
        "tensor_parallel_size": est.settings.tp,
        "pipeline_parallel_size": est.settings.pp,
        "per_gpu": {
            "weights_bytes": fp.weights,
            "kv_cache_bytes": fp.kv_cache,
            "activation_bytes": fp.activation,
            "overhead_bytes": fp.overhead,
            "cuda_context_bytes": fp.cuda_context,
            "non_torch_bytes": fp.non_torch,
            "cuda_graph_bytes": fp.cuda_graphs,
            "margin_bytes": fp.margin,
            **({"lora_bytes": fp.lora} if est.settings.lora_max_loras is not None else {}),
            **({"cpu_offload_bytes": fp.cpu_offloaded} if est.settings.cpu_offload_bytes else {}),
            "reserve_bytes": est.reserve_bytes,
            "total_bytes": fp.total,
            **({"predicted_bytes": fp.total - fp.learned, "learned_bytes": fp.learned} if fp.learned else {}),
            "capacity_bytes": est.capacity_bytes,
            "budget_bytes": est.budget_bytes,
            "headroom_bytes": est.headroom_bytes,
        },
        "kv_cache_range_bytes": list(fp.kv_range) if est.settings.policy == "vllm" else None,
        "kv_bytes_per_token": z.kv_bytes_per_token,
        "recurrent_state": _state_json(est),
        "kv_cache_tokens": z.kv_cache_tokens,
        "max_concurrency": round(z.max_concurrency, 2),
        "kv_cache": memory.kv_json(z),
        "budget_policy": _policy_json(est),
        "flags": None if f is None else f.to_json(),
        "fits": z.fits,
        "reasons": list(z.reasons),
        "suggestions": list(est.suggestions),
        "warnings": list(est.warnings),
        "vllm": None if est.vllm is None else asdict(est.vllm),
        **({"nodes": est.nodes,  # pp > 1 or several nodes: the nodes a replica spans, each stage's GPUs
            "stages": [{"stage": k, "weights_bytes": sf.weights, "kv_cache_bytes": sf.kv_cache,
                        "total_bytes": sf.total} for k, sf in enumerate(est.stages)]}
           if est.stages or est.nodes > 1 else {}),
    }


def _state_json(est: memory.Estimate) -> dict[str, Any] | None:
    """A hybrid model's recurrent state as vLLM lays it out (None for attention-only models)."""
    m = est.model
    if not m.is_hybrid_state or m.state is None or est.settings.policy != "vllm":
        return None
    lay = memory.kv_layout(m, est.settings, est.version)
    return {
        "kind": m.state.kind,
        "layers": m.num_state_layers,
        "state_page_bytes": lay.state_page_bytes,
        "block_size": lay.block_size,
        "attention_groups": lay.full_groups + lay.sliding_groups,
        "state_groups": lay.state_groups,
        "state_blocks_per_request": lay.state_blocks,
        "state_bytes_per_request": lay.state_bytes_per_request,
    }


def _policy_json(est: memory.Estimate) -> dict[str, Any]:
    p = est.policy if isinstance(est.policy, memory.BudgetPolicy) else memory.DEFAULT_POLICY
    return {"name": p.name, "utilization": p.utilization, "reserve_bytes": p.reserve_bytes, "source": p.source,
            "context_bytes": p.context_bytes, "held_back_bytes": p.held_back(est.capacity_bytes)}


# --- listings ----------------------------------------------------------------------------------


def run_models(args: argparse.Namespace) -> int:
    if args.output == "json":
        rows = [
            {"name": m.name, "params": m.params, "layers": m.num_layers, "kv_heads": m.num_kv_heads,
             "max_model_len": m.max_model_len, "moe": m.is_moe, "mla": m.is_mla, "pooling": m.pooling,
             "quantization": m.quant.method if m.quant else None, "aliases": list(m.aliases)}
            for m in catalog.models().values()
        ]
        return _print_json(rows)
    wide = args.output == "wide"
    rows = []
    for m in catalog.models().values():
        row: dict[str, Any] = {"NAME": m.name, "PARAMS": f"{m.params / 1e9:.2f}B", "LAYERS": m.num_layers,
                               "KV-HEADS": m.num_kv_heads, "MAX-LEN": m.max_model_len,
                               "QUANT": m.quant.method if m.quant else None}
        if wide:
            row |= {"MOE": m.is_moe, "MLA": m.is_mla, "POOLING": m.pooling, "ALIASES": list(m.aliases)}
        rows.append(row)
    return _print_table(rows)


def run_gpus(args: argparse.Namespace) -> int:
    if args.output == "json":
        return _print_json([
            {"product": g.product, "name": g.name, "memory_bytes": g.memory_bytes, "cuda_total_bytes": g.cuda_total_bytes,
             "aliases": list(g.aliases)} for g in catalog.gpus().values()])
    wide = args.output == "wide"
    rows = []
    for g in catalog.gpus().values():
        row: dict[str, Any] = {"PRODUCT": g.product, "MEMORY (NVML)": memory.fmt_gib(g.memory_bytes),
                               "VISIBLE TO CUDA": memory.fmt_gib(g.cuda_total_bytes)}
        if wide:
            row |= {"NAME": g.name, "ALIASES": list(g.aliases)}
        rows.append(row)
    return _print_table(rows)


def _print_json(rows: list[dict[str, Any]]) -> int:
    json.dump(rows, sys.stdout, indent=2)
    print()
    return 0


def _print_table(rows: list[dict[str, Any]], out: Any = None) -> int:
    """A kubectl-style table: no borders, upper-case headers, a short default set (`-o wide` adds
    the rest). No cell is cut or wrapped: a table wider than the terminal is printed whole, one line
    a row, at its natural width (the terminal wraps the lines, as with kubectl -o wide)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for i, key in enumerate(rows[0] if rows else ()):
        cells = [r[key] for r in rows]
        longest = max([len(key)] + [len(_cell(v)) for v in cells])
        # names, numbers and short words stay whole; lists (aliases) wrap between items
        width = len(key) if i and any(isinstance(v, list) for v in cells) else longest
        table.add_column(key, overflow="fold", min_width=width)
    for r in rows:
        table.add_row(*(_cell(v) for v in r.values()))
    out = out or console()
    # never crop: where the natural layout is wider than the terminal, print it whole (the terminal
    # wraps the lines, as with kubectl) instead of letting rich squeeze and cut the last columns
    need = Console(width=1 << 16).measure(table).maximum
    if need > out.width:
        out = Console(file=out.file, width=need, color_system=out.color_system)
    out.print(table)
    return 0


def _cell(v: Any) -> str:
    if isinstance(v, list):
        return ", ".join(map(str, v))
    return "" if v is None else str(v)
