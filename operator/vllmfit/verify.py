"""`python -m vllmfit.verify`: the model cache a tenant can write, checked before vLLM starts.

vllmfit sized a model from its config.json (the catalog's, or the one read from the Hub). When the
vllm container loads it from a volume the tenant can write (a PersistentVolumeClaim cache, HF_HOME
or HF_HUB_CACHE on a mounted volume, `--download-dir`), what sits there could be another model of
the same name: a config.json with a larger `intermediate_size` starts normally and needs twice the
memory booked. The operator renders this module as an init container of the replica's pod
(vllmfit.operator.rendering.verifier): the operator's image, no GPU, the vllm container's
environment and volumes mounted read-only. It finds the Hugging Face cache vLLM will read
(huggingface_hub's order: the download dir, HF_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub,
~/.cache/huggingface/hub), and for every snapshot of the model there (or only the pinned revision's):

- its config.json must describe the model that was sized (`sizing_digest` of the parsed config equals
  the digest the operator rendered);
- its safetensors index must count no more parameters than were sized, and its *.safetensors files
  no more bytes than that many parameters can take (at most 4 bytes each, plus their headers).

A cache that does not hold the model yet passes: vLLM downloads it (from the Hub or the admin's
mirror). Exit 0 when it passes; 1 with one line on stderr and in the pod's termination message
(the operator's Ready condition and Event quote it) when it does not; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllmfit.core.errors import UserError
from vllmfit.core.model.config import params_from_index, parse_hf_config, sizing_digest

TERMINATION_LOG = "/dev/termination-log"
MAX_JSON_BYTES = 16 << 20  # a config.json or an index larger than this is not a real one
HEADER_BYTES = 64 << 20  # a safetensors file's JSON header, at most (its tensors' names and shapes)
INDEX = "model.safetensors.index.json"


class Refused(Exception):
    """The cache holds something other than what was sized (one line)."""


def hub_cache(env: Mapping[str, str], download_dir: str | None) -> Path:
    """Where huggingface_hub (and so vLLM) looks for a downloaded model."""
    if download_dir:
        return Path(download_dir)
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "huggingface" / "hub"
    return Path(env.get("HOME") or "~").expanduser() / ".cache" / "huggingface" / "hub"


def snapshots(cache: Path, model: str, revision: str | None) -> list[Path]:
    """The snapshot directories of `model` in `cache` that vLLM may load (only `revision`'s when pinned)."""
    root = cache / ("models--" + model.replace("/", "--")) / "snapshots"
    if revision:
        return [root / revision] if (root / revision).is_dir() else []
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _json(path: Path) -> dict[str, Any]:
    if path.stat().st_size > MAX_JSON_BYTES:
        raise Refused(f"{path}: larger than {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise Refused(f"{path}: not JSON ({str(e)[:80]})") from None
    if not isinstance(data, dict):
        raise Refused(f"{path}: not a JSON object")
    return data


def check_snapshot(snap: Path, model: str, digest: str, params: int) -> None:
    """Raise Refused when the snapshot is not the model sized (module docstring)."""
    config_path = snap / "config.json"
    if not config_path.exists():
        return  # nothing of it downloaded yet: vLLM downloads it
    config = _json(config_path)
    try:
        arch = parse_hf_config(config, name=model)
    except (UserError, ValueError) as e:
        raise Refused(f"{config_path}: {e}") from None
    if sizing_digest(arch) != digest:
        raise Refused(f"{config_path} is not the config.json vllmfit sized for {model} (layers {arch.num_layers}, "
                      f"hidden {arch.hidden_size}, intermediate {arch.intermediate_size}, vocab {arch.vocab_size}, "
                      f"dtype {arch.torch_dtype}); remove it from the cache or use the model it is")
    if (snap / INDEX).exists():
        counted = params_from_index(_json(snap / INDEX), config)
        if counted is not None and counted > params:
            raise Refused(f"{snap / INDEX}: {counted} parameters, more than the {params} vllmfit sized for {model}")
    files = sorted(snap.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    if total > 4 * params + HEADER_BYTES * len(files):
        raise Refused(f"{snap}: {total} bytes of safetensors, more than {params} parameters can take")


def verify(env: Mapping[str, str], model: str, digest: str, params: int, *, revision: str | None = None,
           download_dir: str | None = None) -> str:
    """What was checked (one line); raises Refused."""
    cache = hub_cache(env, download_dir)
    found = snapshots(cache, model, revision)
    for snap in found:
        check_snapshot(snap, model, digest, params)
    return f"{model}: {len(found)} cached snapshot(s) in {cache} match what vllmfit sized"


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllmfit.verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--config-digest", required=True)
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--revision")
    p.add_argument("--download-dir")
    p.add_argument("--termination-log", default=TERMINATION_LOG)
    args = p.parse_args(argv)
    try:
        print(verify(os.environ if env is None else env, args.model, args.config_digest, args.params,
                     revision=args.revision, download_dir=args.download_dir))
    except (Refused, OSError) as e:
        line = f"model cache refused: {e}"
        print(line, file=sys.stderr)
        try:
            Path(args.termination_log).write_text(line[:4000])
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
