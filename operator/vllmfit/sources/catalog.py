"""Loads catalog/models.yaml and catalog/gpus.yaml into frozen core types (the only reader of them).

The catalog ships inside the package as package data (`vllmfit/catalog/*.yaml`, found through
importlib.resources). In the source tree `operator/vllmfit/catalog` is a symbolic link to the
top-level `catalog/`, the single source, and setuptools copies the files it points to into the
wheel (pyproject.toml, [tool.setuptools.package-data]). VLLMFIT_CATALOG, when set, overrides it
with another directory.
"""

from __future__ import annotations

import difflib
import functools
import os
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from vllmfit.core.defaults import DRIVER_RESERVED_BYTES, MIB
from vllmfit.core.model.config import parse_hf_config
from vllmfit.core.model.facts import GpuType, ModelArch, ModelConfigError


class CatalogError(LookupError):
    """Unknown model or GPU (message: one line naming the closest matches)."""


def catalog_dir() -> Path | Traversable:
    """VLLMFIT_CATALOG if set, else the package data `vllmfit/catalog`."""
    env = os.environ.get("VLLMFIT_CATALOG")
    return Path(env) if env else resources.files("vllmfit") / "catalog"


def _load_yaml(name: str) -> list[dict[str, Any]]:
    path = catalog_dir() / name
    with path.open() as f:
        data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    if not isinstance(data, list):
        raise CatalogError(f"{path}: expected a list of entries")
    return data


def _norm(s: str) -> str:
    return s.lower().replace("_", "-").replace(" ", "-")


@functools.cache
def models() -> dict[str, ModelArch]:
    """Every catalog model, by its name (the Hugging Face repo id)."""
    out: dict[str, ModelArch] = {}
    for entry in _load_yaml("models.yaml"):
        out[entry["name"]] = model_from_entry(entry)
    return out


def model_from_entry(entry: dict[str, Any]) -> ModelArch:
    return parse_hf_config(
        entry["config"],
        name=entry["name"],
        params=int(entry["params"]),
        params_source="catalog",
        task=entry.get("task"),
        source=entry.get("source", ""),
        aliases=tuple(entry.get("aliases", ())),
    )


@functools.cache
def gpus() -> dict[str, GpuType]:
    """Every catalog GPU, by its GFD product label."""
    out: dict[str, GpuType] = {}
    for e in _load_yaml("gpus.yaml"):
        mem = int(e["memory_mib"]) * MIB
        out[e["product"]] = GpuType(
            product=e["product"],
            name=e.get("name", e["product"]),
            memory_bytes=mem,
            cuda_total_bytes=int(e.get("cuda_total_bytes") or mem - DRIVER_RESERVED_BYTES),
            aliases=tuple(e.get("aliases", ())),
            architecture=e.get("architecture", ""),
            source=e.get("source", ""),
            compute_capability=_cc(e.get("compute_capability")),
        )
    return out


def _cc(text: object) -> tuple[int, int] | None:
    """'8.9' -> (8, 9)."""
    if text is None:
        return None
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


CLOSE = 0.6
"""How alike a name must be to a catalog name to be offered in its place (difflib's ratio):
'mistral-7b-instruct-v0.4' -> v0.3 and v0.1 (0.96); nothing for 'acme/NotARealModel-7B'."""


def _lookup(table: dict[str, Any], key: str, what: str, aliases: dict[str, str]) -> Any:
    if key in table:
        return table[key]
    n = _norm(key)
    if n in aliases:
        return table[aliases[n]]
    names = _closest(table, n, aliases)
    hint = f"; closest: {', '.join(names)}" if names else ""
    raise CatalogError(f"unknown {what} {key!r}{hint} (list them with `vllmfit {what}s`)")


def _closest(table: dict[str, Any], n: str, aliases: dict[str, str], most: int = 4) -> list[str]:
    """What the user probably meant by `n` (normalized): the names it is the start of, largest
    memory first for GPUs ('NVIDIA-H100' -> the 80 GB H100s before anything else; MIG slices only
    when asked for), else the names closest in spelling (difflib)."""
    started = {v for a, v in aliases.items() if a.startswith(n) and ("-mig-" in n or "-MIG-" not in v)}
    if started:
        def key(name: str) -> tuple[int, str]:
            item = table[name]
            return (-getattr(item, "memory_bytes", 0), name)

        return sorted(started, key=key)[:most]
    close = difflib.get_close_matches(n, list(aliases), n=most, cutoff=CLOSE)
    return sorted({aliases[c] for c in close})


def _aliases(table: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, item in table.items():
        out[_norm(key)] = key
        out[_norm(key.split("/")[-1])] = key
        for a in item.aliases:
            out[_norm(a)] = key
    return out


@functools.cache
def _model_aliases() -> dict[str, str]:
    return _aliases(models())


@functools.cache
def _gpu_aliases() -> dict[str, str]:
    return _aliases(gpus())


def model(name: str) -> ModelArch:
    return _lookup(models(), name, "model", _model_aliases())


def knows(name: str) -> bool:
    """Whether the catalog has model `name` (its config is then what vLLM loads, never a spec's:
    vllmfit.core.spec.validate.model_config_problem)."""
    return name in models() or _norm(name) in _model_aliases()  # model()'s hits, without its spelling hints


def gpu(name: str) -> GpuType:
    return _lookup(gpus(), name, "gpu", _gpu_aliases())


def gpu_for_label(product: str, memory_mib: int | None) -> GpuType:
    """A GPU from GFD labels: the catalog entry when known, else one built from the memory label."""
    try:
        return gpu(product.removesuffix("-SHARED"))
    except CatalogError:
        if not memory_mib:
            raise
        mem = memory_mib * MIB
        return GpuType(product=product, name=product, memory_bytes=mem, cuda_total_bytes=mem - DRIVER_RESERVED_BYTES)


__all__ = ["CatalogError", "ModelConfigError", "catalog_dir", "gpu", "gpu_for_label", "gpus", "model", "models"]
