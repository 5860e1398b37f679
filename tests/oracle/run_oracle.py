"""Run vLLM's own start-up sizing on CPU, with no GPU, and write what it decides (docs/oracle.md).

Runs inside the oracle venv (tests/oracle/build_venv.sh), never in the project's venv:

    LD_LIBRARY_PATH=$VENV $VENV/bin/python tests/oracle/run_oracle.py --out tests/data/vllm-oracle/0.33.0.json

For every config in tests/data/hf-configs/ and every case of the grid (GPU product, TP size,
max_model_len, KV dtype, KV memory) it does what `vllm serve <dir> --kv-cache-memory-bytes N`
does up to the KV plan, with vLLM's own code:
- EngineArgs(...).create_engine_config(OPENAI_API_SERVER): the resolved max_model_len, the
  scheduler defaults (max_num_seqs, max_num_batched_tokens), the block size, and every refusal
  vLLM's config checks raise;
- the model class built on the `meta` device (no weights) under that config, on a fake CUDA
  platform reporting the product's name, compute capability and total memory (vLLM picks the
  attention backend, and so the block size, from these);
- each attention layer's KVCacheSpec (as the GPU model runner collects them), the global KV
  groups, get_kv_cache_configs with available memory = N (what --kv-cache-memory-bytes gives),
  and the capacity vLLM logs ("GPU KV cache size: X tokens, Maximum concurrency ...").
Tensor parallelism: one process plays TP rank 0 (every rank has the same KV spec, and vLLM takes
the minimum over ranks): the TP group is a gloo group of one whose world size is set to the TP
size, so the model's layers are built with per-rank shapes. The tokenizer is skipped.

The worker runs one config per process (a crash loses one config, not the run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "data" / "hf-configs"
GIB = 1 << 30

# GPU products (catalog/gpus.yaml): the name NVML reports, CUDA compute capability, and the total
# cudaMemGetInfo reports (vLLM's T; catalog cuda_total_bytes or memory_mib - DRIVER_RESERVED_BYTES).
# Read from the catalog at run time so the fixture uses the same numbers vllmfit does.
GPU_PRODUCTS = ("NVIDIA-H100-80GB-HBM3", "NVIDIA-A100-SXM4-80GB", "NVIDIA-B200", "NVIDIA-L40S")

# The grid: a main sweep on H100 and single variations around it (kept small: every case builds
# the model once on the meta device).
MAIN_GPU = "NVIDIA-H100-80GB-HBM3"
TPS = (1, 2, 8)
LENS = (None, 8192)  # None: vLLM derives max_model_len from the config
KV_MEMORY = (16 * GIB, 1 * GIB)
KV_DTYPES = ("auto", "fp8")


def grid() -> list[dict]:
    cases = []
    for tp in TPS:
        for length in LENS:
            for mem in KV_MEMORY:
                cases.append({"gpu": MAIN_GPU, "tp": tp, "max_model_len": length, "kv_cache_dtype": "auto",
                              "kv_cache_memory_bytes": mem})
    cases.append({"gpu": MAIN_GPU, "tp": 1, "max_model_len": None, "kv_cache_dtype": "fp8",
                  "kv_cache_memory_bytes": 16 * GIB})
    for gpu in GPU_PRODUCTS:
        if gpu != MAIN_GPU:
            cases.append({"gpu": gpu, "tp": 1, "max_model_len": None, "kv_cache_dtype": "auto",
                          "kv_cache_memory_bytes": 16 * GIB})
    return cases


def gpu_facts() -> dict[str, dict]:
    import yaml  # vLLM depends on PyYAML

    sys.path.insert(0, str(REPO / "operator"))
    from vllmfit.core.defaults import (
        DRIVER_RESERVED_BYTES as reserved,  # the pure core: standard library only
    )
    out = {}
    for g in yaml.safe_load((REPO / "catalog" / "gpus.yaml").read_text()):
        if g["product"] not in GPU_PRODUCTS:
            continue
        total = g.get("cuda_total_bytes") or g["memory_mib"] * (1 << 20) - reserved
        major, minor = (int(x) for x in str(g["compute_capability"]).split("."))
        out[g["product"]] = {"name": g["name"], "total": int(total), "cc": [major, minor]}
    return out


# --- the worker: one config, every case, inside one process --------------------------------------


_GPU: dict = {}
"""The GPU the fake platform reports now (set per case)."""


def _install_fake_platform() -> None:
    """Before anything else of vLLM is imported (modules bind `current_platform` at import)."""
    import torch
    from vllm import platforms
    from vllm.platforms import cuda as cuda_mod
    from vllm.platforms.interface import DeviceCapability

    base = getattr(cuda_mod, "NonNvmlCudaPlatform", None) or cuda_mod.CudaPlatform

    class FakeCudaPlatform(base):  # type: ignore[misc, valid-type]
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(*_GPU["cc"])

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return _GPU["name"]

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return _GPU["total"]

        @classmethod
        def is_fully_connected(cls, physical_device_ids) -> bool:
            return True

        @classmethod
        def device_count(cls) -> int:
            return 8

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            return f"GPU-oracle-{device_id}"

    platforms._current_platform = FakeCudaPlatform()
    # FlashInfer's package is installed (build_venv.sh), its kernels are not: a real install has
    # them (flashinfer-cubin), so vLLM's backend choice must see FlashInfer as usable
    try:
        from vllm.utils import flashinfer as fi

        fi.has_flashinfer_cubin = lambda: True
    except ImportError:
        pass
    # vLLM inspects a model class in a fresh subprocess (which would not have this fake platform);
    # inspect it here instead
    from vllm.model_executor.models import registry

    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = lambda fn: fn()
    # Triton has no active driver here, so vLLM uses its placeholder module, whose Config is a
    # decorator; module-level autotune lists read Config attributes (Mamba ops on SM90)
    try:
        from vllm.triton_utils import HAS_TRITON, triton
    except ImportError:
        HAS_TRITON, triton = True, None
    if not HAS_TRITON and triton is not None:
        class _Config:
            def __init__(self, kwargs=None, num_warps=4, num_stages=1, **extra):
                self.kwargs, self.num_warps, self.num_stages = dict(kwargs or {}), num_warps, num_stages

        triton.Config = _Config
    torch.cuda.device_count = lambda: 8  # type: ignore[assignment]
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]

    class _NoStream:  # streams and events a model's __init__ creates for overlap (never used here)
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            return lambda *a, **k: None

    class _Props:  # what torch.cuda.get_device_properties reports for the fake GPU
        def __getattr__(self, name):
            return {"name": _GPU["name"], "total_memory": _GPU["total"], "major": _GPU["cc"][0],
                    "minor": _GPU["cc"][1], "multi_processor_count": 132, "L2_cache_size": 50 << 20,
                    "warp_size": 32, "gcnArchName": ""}.get(name, 0)

    torch.cuda.get_device_capability = lambda *a, **k: tuple(_GPU["cc"])  # type: ignore[assignment]
    torch.cuda.get_device_name = lambda *a, **k: _GPU["name"]  # type: ignore[assignment]
    torch.cuda.get_device_properties = lambda *a, **k: _Props()  # type: ignore[assignment]
    torch.cuda.Stream = _NoStream  # type: ignore[assignment, misc]
    torch.cuda.Event = _NoStream  # type: ignore[assignment, misc]
    torch.cuda.current_stream = lambda *a, **k: _NoStream()  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]


def _meta_mode():
    """A torch function mode that puts every new tensor on the `meta` device, including those a
    model's __init__ creates with an explicit device="cuda" (buffers, workspaces), and makes
    .cuda() / .to(cuda) no-ops: nothing is allocated and no CUDA call is made."""
    import torch
    from torch.overrides import TorchFunctionMode

    meta = torch.device("meta")

    class MetaEverywhere(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            name = getattr(func, "__name__", "")
            if name in ("cuda", "pin_memory") and args and isinstance(args[0], torch.Tensor):
                return args[0]
            if name == "to" and args and isinstance(args[0], torch.Tensor):
                args = tuple(a for a in args if not isinstance(a, (str, torch.device)))
                kwargs.pop("device", None)
                kwargs.pop("non_blocking", None)
                if len(args) == 1 and not kwargs:
                    return args[0]
                return func(*args, **kwargs)
            if "device" in kwargs or name in _FACTORIES:
                kwargs["device"] = meta
                kwargs.pop("pin_memory", None)
            return func(*args, **kwargs)

    return MetaEverywhere()


_FACTORIES = {"empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint", "tensor", "empty_strided",
              "linspace", "eye", "as_tensor"}

def _clear_vllm_caches() -> None:
    """Every functools cache of vLLM's modules (the attention backend selector, platform and
    kernel-support answers) holds answers for the previous fake GPU: drop them."""
    import functools

    wrapper = functools._lru_cache_wrapper
    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm") or mod is None:
            continue
        for attr in list(vars(mod).values()):
            if isinstance(attr, wrapper):
                attr.cache_clear()
            elif isinstance(attr, type) and attr.__module__ == name:
                for member in list(vars(attr).values()):
                    fn = getattr(member, "__func__", member)
                    if isinstance(fn, wrapper):
                        fn.cache_clear()


_DIST = {"init": False}
_BUILT: dict = {}
"""(gpu, tp, kv dtype) -> the static forward context (attention layers) of the last model built."""


def _init_dist(tp: int, fresh: bool) -> None:
    """`fresh`: a new model: the parallel groups are made again (MoE models need the EP group,
    which vLLM creates only when the current config has experts)."""
    from vllm.distributed import parallel_state as ps

    if _DIST["init"] and fresh:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1)
    if not _DIST["init"]:
        try:  # the GPU model runner's workspace (sparse-MLA layers take buffers from it), on meta
            import torch
            from vllm.v1.worker.workspace import init_workspace_manager

            init_workspace_manager(torch.device("meta"))
        except Exception:  # noqa: BLE001, S110 (versions without it, or a signature of their own)
            pass
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                        local_rank=0, backend="gloo")
        ps.ensure_model_parallel_initialized(1, 1)
        _DIST["init"] = True
    # TP rank 0 of a group of `tp`: layers take their per-rank shapes from this world size
    for name in ("_TP",):
        group = getattr(ps, name)
        group.world_size = tp
        group.rank_in_group = 0
        group.ranks = list(range(tp))


def _spec_record(spec) -> dict:
    rec = {"type": type(spec).__name__, "block_size": spec.block_size, "page_size_bytes": spec.page_size_bytes}
    for attr in ("num_kv_heads", "head_size", "head_size_v", "sliding_window", "attention_chunk_size",
                 "dtype", "cache_dtype_str", "mamba_type", "shapes", "dtypes", "compress_ratio"):
        if hasattr(spec, attr):
            v = getattr(spec, attr)
            if v is None or isinstance(v, (int, float, str, bool)):
                rec[attr] = v
            else:
                rec[attr] = str(v)
    if hasattr(spec, "kv_cache_specs"):  # UniformTypeKVCacheSpecs
        rec["layers"] = len(spec.kv_cache_specs)
        inner = next(iter(spec.kv_cache_specs.values()))
        rec["inner"] = _spec_record(inner)
    return rec


def _kv_specs(vllm_config) -> dict:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    try:
        from vllm.model_executor.layers.attention import Attention
    except ImportError:
        from vllm.attention.layer import Attention  # type: ignore[no-redef]
    try:
        from vllm.v1.worker.utils import customize_attention_spec
    except ImportError:
        customize_attention_spec = None
    from vllm.v1.kv_cache_interface import AttentionSpec

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    if layers and not all(hasattr(layer, "get_kv_cache_spec") for layer in layers.values()):
        return _kv_specs_runner(vllm_config)
    specs = {}
    for name, layer in layers.items():
        if isinstance(layer, Attention) and getattr(layer, "kv_sharing_target_layer_name", None):
            continue
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is None:
            continue
        if customize_attention_spec is not None and isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        if getattr(layer, "is_draft_layer", False):
            from dataclasses import replace

            spec = replace(spec, is_draft=True)
        specs[name] = spec
    return specs


def _kv_specs_runner(vllm_config) -> dict:
    """0.11-0.15: the GPU model runner builds the specs from the attention modules itself; its
    method runs here on an object holding just the attributes it reads."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cache, model = vllm_config.cache_config, vllm_config.model_config
    if cache.cache_dtype == "auto":
        dtype = model.dtype
    else:
        from vllm.utils import STR_DTYPE_TO_TORCH_DTYPE

        dtype = STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    runner = SimpleNamespace(vllm_config=vllm_config, kv_cache_dtype=dtype, shared_kv_cache_layers={},
                             attention_chunk_size=model.attention_chunk_size,
                             speculative_config=vllm_config.speculative_config, model_config=model,
                             cache_config=cache, parallel_config=vllm_config.parallel_config)
    return GPUModelRunner.get_kv_cache_spec(runner)


def _plan(vllm_config, specs: dict, mem: int) -> dict:
    """get_kv_cache_configs as EngineCore._initialize_kv_caches calls it, and the capacity."""
    from vllm.v1.core import kv_cache_utils as ku

    try:
        from vllm.v1.core import kv_cache_planning as kp
    except ImportError:
        kp = ku
    try:
        from vllm.v1.core.kv_cache_utils import register_all_kvcache_specs

        register_all_kvcache_specs(vllm_config)
    except ImportError:
        pass
    try:  # 0.33: the engine core resolves one KV layout before planning
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    except ImportError:
        resolve_kv_cache_layout = None
    if resolve_kv_cache_layout is not None:
        names = [x.name for x in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))]
        resolve_kv_cache_layout(vllm_config, [names], list(specs.values()))
    out: dict = {"max_model_len": vllm_config.model_config.max_model_len}
    if hasattr(kp, "get_global_kv_cache_groups"):
        groups = kp.get_global_kv_cache_groups(vllm_config, [specs])
        out["groups"] = [{"layers": len(g.layer_names), **_spec_record(g.kv_cache_spec)} for g in groups]
        try:
            configs = kp.get_kv_cache_configs(vllm_config, [specs], [mem], groups)
        except ValueError as e:
            out["refused"] = {"stage": "kv", "message": _short(e)}
            return out
    else:
        try:
            configs = kp.get_kv_cache_configs(vllm_config, [specs], [mem])
        except ValueError as e:
            groups = kp.get_kv_cache_groups(vllm_config, specs) if hasattr(kp, "get_kv_cache_groups") else []
            out["groups"] = [{"layers": len(g.layer_names), **_spec_record(g.kv_cache_spec)} for g in groups]
            out["refused"] = {"stage": "kv", "message": _short(e)}
            return out
    sched = ku.generate_scheduler_kv_cache_config(configs)
    out["num_blocks"] = sched.num_blocks
    out["max_model_len"] = vllm_config.model_config.max_model_len
    groups_out = []
    for g in sched.kv_cache_groups:
        groups_out.append({"layers": len(g.layer_names), **_spec_record(g.kv_cache_spec)})
    out["groups"] = groups_out
    if hasattr(kp, "_pool_bytes_per_block_from_builder"):  # 0.33: P_blk as the planner computes it
        from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

        out["block_bytes"] = kp._pool_bytes_per_block_from_builder(
            get_kv_cache_config_builder(vllm_config), vllm_config, configs[0].kv_cache_groups)
    elif sched.num_blocks:  # before: one tensor per layer slot, num_blocks pages each
        out["block_bytes"] = sum(t.size for t in getattr(configs[0], "kv_cache_tensors", [])) // sched.num_blocks
    if sched.kv_cache_groups:
        if hasattr(ku, "get_kv_cache_capacity"):
            tokens, conc = ku.get_kv_cache_capacity(vllm_config, sched)
        else:
            conc = ku.get_max_concurrency_for_kv_cache_config(vllm_config, sched)
            tokens = int(conc * vllm_config.model_config.max_model_len)
            if not _at_least(vllm_config, 21):
                # 0.11-0.19 log num_blocks // groups x min block size (x DCP)
                min_bs = min(g.kv_cache_spec.block_size for g in sched.kv_cache_groups)
                tokens = sched.num_blocks // len(sched.kv_cache_groups) * min_bs
        out["kv_tokens"] = int(tokens)
        out["concurrency"] = round(float(conc), 6)
    return out


def _at_least(vllm_config, minor: int) -> bool:
    import vllm

    parts = vllm.__version__.split(".")
    return (int(parts[0]), int(parts[1])) >= (0, minor)


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:600]}"


def run_case(model_dir: str, case: dict, gpus: dict) -> dict:
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    if _GPU and _GPU.get("product") != case["gpu"]:
        _clear_vllm_caches()  # vLLM caches answers that depend on the device (attention backend, ...)
    _GPU.clear()
    _GPU.update(gpus[case["gpu"]], product=case["gpu"])
    result: dict = {}
    kwargs = {"model": model_dir, "skip_tokenizer_init": True, "tensor_parallel_size": case["tp"],
              "kv_cache_dtype": case["kv_cache_dtype"], "kv_cache_memory_bytes": case["kv_cache_memory_bytes"],
              "load_format": "dummy", "enforce_eager": True, "distributed_executor_backend": "mp"}
    if case["max_model_len"] is not None:
        kwargs["max_model_len"] = case["max_model_len"]
    if "swap_space" in getattr(EngineArgs, "__dataclass_fields__", {}):
        kwargs["swap_space"] = 0  # <= 0.19 checks a CPU swap space (4 GiB x TP) against this machine's RAM
    try:
        cfg = EngineArgs(**kwargs).create_engine_config(UsageContext.OPENAI_API_SERVER)
    except Exception as e:  # vLLM refuses these flags before loading anything  # noqa: BLE001 (the harness records every failure)
        return {"refused": {"stage": "config", "message": _short(e)}, "trace": traceback.format_exc(limit=-3)[-1500:]}
    sc, cc, mc = cfg.scheduler_config, cfg.cache_config, cfg.model_config
    result["resolved"] = {"max_model_len": mc.max_model_len, "max_num_seqs": sc.max_num_seqs,
                          "max_num_batched_tokens": sc.max_num_batched_tokens, "block_size": cc.block_size,
                          "cache_dtype": str(cc.cache_dtype), "dtype": str(mc.dtype).replace("torch.", ""),
                          "quantization": mc.quantization}
    from vllm.config import set_current_vllm_config

    key = (case["gpu"], case["tp"], case["kv_cache_dtype"])
    with set_current_vllm_config(cfg):
        _init_dist(case["tp"], fresh=key not in _BUILT)
    from vllm.model_executor.model_loader.utils import initialize_model

    try:
        from vllm.utils.torch_utils import set_default_torch_dtype
    except ImportError:  # 0.11
        from vllm.model_executor.model_loader.utils import set_default_torch_dtype
    try:

        if key in _BUILT:  # same layers: reuse them (only the length and the memory differ)
            cfg.compilation_config.static_forward_context = _BUILT[key]
        else:
            with set_current_vllm_config(cfg), set_default_torch_dtype(mc.dtype), torch.device("meta"), \
                    _meta_mode():
                initialize_model(vllm_config=cfg)
            _BUILT.clear()
            _BUILT[key] = cfg.compilation_config.static_forward_context
        # the executor does this after load_model: the backends' block size, and for hybrid models
        # the attention block size that makes a page hold a Mamba state (_align_hybrid_block_size)
        from vllm.platforms import current_platform

        update = getattr(current_platform, "update_block_size_for_backend", None)
        if callable(update):  # 0.11-0.19 aligned the block size in the config checks instead
            with set_current_vllm_config(cfg):
                update(cfg)
        result["resolved"]["block_size"] = cfg.cache_config.block_size
        specs = _kv_specs(cfg)
    except Exception as e:  # noqa: BLE001 (the harness records every failure)
        result["refused"] = {"stage": "model", "message": _short(e)}
        result["trace"] = traceback.format_exc(limit=-3)[-1500:]
        return result
    try:
        with set_current_vllm_config(cfg):
            plan = _plan(cfg, specs, case["kv_cache_memory_bytes"])
    except Exception as e:  # noqa: BLE001 (the harness records every failure)
        result["refused"] = {"stage": "oracle", "message": _short(e)}
        result["trace"] = traceback.format_exc(limit=-3)[-1500:]
        return result
    if "refused" in plan:
        result["refused"] = plan.pop("refused")
    result["plan"] = plan
    return result


def worker(configs: str, cases_json: str, out_dir: str) -> None:
    """Every config of `configs` (comma-separated paths) in this one process (vLLM's imports and
    first model build cost a minute; later cases take a second), one result file per config."""
    logging.disable(logging.WARNING)
    gpus = gpu_facts()
    _install_fake_platform()
    cases = json.loads(cases_json)
    for config_path in configs.split(","):
        src = json.loads(Path(config_path).read_text())
        _BUILT.clear()
        with tempfile.TemporaryDirectory(prefix="vllmfit-oracle-") as d:
            (Path(d) / "config.json").write_text(json.dumps(src))
            results = []
            for case in cases:
                t0 = time.time()
                try:
                    r = run_case(d, case, gpus)
                except Exception as e:  # anything else: recorded, never fatal  # noqa: BLE001 (the harness records every failure)
                    r = {"refused": {"stage": "oracle", "message": _short(e)},
                         "trace": traceback.format_exc(limit=-3)[-1500:]}
                r["seconds"] = round(time.time() - t0, 2)
                results.append({**case, **r})
        (Path(out_dir) / f"{Path(config_path).stem}.json").write_text(json.dumps(results))
        print(f"{Path(config_path).stem}: {sum(r['seconds'] for r in results):.0f}s", file=sys.stderr, flush=True)


def dump(out: dict) -> str:
    """The fixture: one case per line, traces and timings left out (they belong to the run's log)."""
    lines = ["{"]
    for key in sorted(k for k in out if k != "models"):
        lines.append(f"  {json.dumps(key)}: {json.dumps(out[key], sort_keys=True)},")
    lines.append('  "models": {')
    stems = sorted(out["models"])
    for i, stem in enumerate(stems):
        cases = out["models"][stem]
        end = "," if i < len(stems) - 1 else ""
        if not isinstance(cases, list):
            lines.append(f"    {json.dumps(stem)}: {json.dumps(cases, sort_keys=True)}{end}")
            continue
        lines.append(f"    {json.dumps(stem)}: [")
        for j, case in enumerate(cases):
            case = {k: v for k, v in case.items() if k not in ("trace", "seconds")}
            if case.get("plan", {}).get("groups"):  # identical groups once, with their count
                merged: list[dict] = []
                for g in case["plan"]["groups"]:
                    n = g.get("count", 1)
                    g = {k: v for k, v in g.items() if k != "count"}
                    if merged and {k: v for k, v in merged[-1].items() if k != "count"} == g:
                        merged[-1]["count"] += n
                    else:
                        merged.append({**g, "count": n})
                case = {**case, "plan": {**case["plan"], "groups": merged}}
            if "refused" in case:  # the temporary config directory's name would make runs differ
                message = re.sub(r"/\S*vllmfit-oracle-[\w]+", "<config dir>", case["refused"]["message"])
                case["refused"] = {**case["refused"], "message": message[:240]}
            lines.append(f"      {json.dumps(case, sort_keys=True, separators=(',', ':'))}"
                         f"{',' if j < len(cases) - 1 else ''}")
        lines.append(f"    ]{end}")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --- the driver --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--only", default="", help="comma-separated config stems (default: every config)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 0))
    ap.add_argument("--resume", default="", help="a folder of per-config results of an interrupted run (same grid)")
    ap.add_argument("--worker", nargs=3, metavar=("CONFIG", "CASES", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    import vllm

    paths = sorted(CONFIGS.glob("*.json"))
    if args.only:
        keep = set(args.only.split(","))
        paths = [p for p in paths if p.stem in keep]
    cases = grid()
    t0 = time.time()
    out: dict = {"vllm_version": vllm.__version__, "generator": "tests/oracle/run_oracle.py",
                 "gpus": gpu_facts(), "models": {}}
    with tempfile.TemporaryDirectory(prefix="vllmfit-oracle-out-") as tmp:
        if args.resume:
            for p in paths:
                if (Path(args.resume) / f"{p.stem}.json").exists():
                    (Path(tmp) / f"{p.stem}.json").write_text((Path(args.resume) / f"{p.stem}.json").read_text())
        pending = [p for p in paths if not (Path(tmp) / f"{p.stem}.json").exists()]
        while pending:
            # a worker per job, each taking every jobs-th config; a crash loses the config it was on
            # (recorded), and the rest of its share runs again in a new worker
            shares = [pending[i::args.jobs] for i in range(args.jobs)]
            procs = [subprocess.Popen([sys.executable, __file__, "--worker", ",".join(map(str, share)),
                                       json.dumps(cases), tmp], stderr=subprocess.PIPE, text=True)
                     for share in shares if share]
            errors = []
            for proc in procs:
                _, err = proc.communicate()
                sys.stderr.write(err if proc.returncode == 0 else err[-3000:])
                errors.append(err)
            done = {p.stem for p in Path(tmp).glob("*.json")}
            left = [p for p in pending if p.stem not in done]
            for share, err in zip([s for s in shares if s], errors):
                missing = [p for p in share if p.stem not in done]
                if missing:  # the first missing config crashed its worker
                    out["models"][missing[0].stem] = {"error": (err.strip().splitlines() or ["crashed"])[-1]}
                    left.remove(missing[0])
            pending = left
        for p in Path(tmp).glob("*.json"):
            out["models"][p.stem] = json.loads(p.read_text())
    out["seconds"] = round(time.time() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(dump(out))
    print(f"wrote {args.out}: {len(out['models'])} configs x {len(cases)} cases in {out['seconds']}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
