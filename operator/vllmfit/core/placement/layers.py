"""Layered maps: the structural sharing under Ledger.snapshot and Ledger.fork (issue 29)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

_MISSING: object = object()
_GONE: object = object()  # a key a layer removed from its base
_COMPACT = 64  # a layer's own changes beyond this (plus 2 x sqrt of its base) are merged into a new base


class Layer:
    """A map that shares a base dict nobody changes and keeps its own changes apart (`delta`; a
    removed key is _GONE there). A new layer over another copies only its changes, so a ledger
    copies O(changes), not O(GPUs), to change what it shares; reads look in the changes, then in
    the base. When the changes grow past 2 x sqrt(len(base)) they are merged into a new base
    dict (amortized O(sqrt(n)) per change, a few hundred entries at 80,000 GPUs, so a copy of the
    changes stays that small too); the old base stays as it was for whoever shares it.

    A layer that alone holds its base (`own`: made over a new dict, or after a merge, and no
    layer made `over` it since) changes the base in place: a ledger never shared (the CLI's
    plan) pays nothing for the sharing it does not use."""

    __slots__ = ("base", "delta", "own")

    def __init__(self, base: Mapping[Any, Any], delta: dict[Any, Any] | None = None, *, own: bool = False) -> None:
        self.base, self.delta, self.own = base, ({} if delta is None else delta), own

    @classmethod
    def over(cls, m: Any) -> Layer:
        """A private layer with the content of `m` (a dict or a layer), sharing its base (from now
        on neither changes that base in place)."""
        if isinstance(m, Layer):
            m.own = False
            return cls(m.base, dict(m.delta))
        return cls(m)

    def get(self, k: Any, default: Any = None) -> Any:
        v = self.delta.get(k, _MISSING)
        if v is _MISSING:
            return self.base.get(k, default)
        return default if v is _GONE else v

    def __getitem__(self, k: Any) -> Any:
        v = self.get(k, _MISSING)
        if v is _MISSING:
            raise KeyError(k)
        return v

    def __contains__(self, k: Any) -> bool:
        return self.get(k, _MISSING) is not _MISSING

    def __setitem__(self, k: Any, v: Any) -> None:
        if self.own:
            if v is _GONE:
                self.base.pop(k, None)  # type: ignore[attr-defined]
            else:
                self.base[k] = v  # type: ignore[index]
            return
        self.delta[k] = v
        if len(self.delta) > _COMPACT + 2 * math.isqrt(len(self.base)):
            merged = dict(self.base)
            for key, val in self.delta.items():
                if val is _GONE:
                    merged.pop(key, None)
                else:
                    merged[key] = val
            self.base, self.delta, self.own = merged, {}, True

    def pop(self, k: Any, default: Any = _MISSING) -> Any:
        v = self.get(k, _MISSING)
        if v is _MISSING:
            if default is _MISSING:
                raise KeyError(k)
            return default
        self[k] = _GONE
        return v

    def __iter__(self) -> Any:
        delta = self.delta
        for k in self.base:
            if k not in delta:
                yield k
        for k, v in list(delta.items()):
            if v is not _GONE:
                yield k

    def keys(self) -> Any:
        return iter(self)

    def items(self) -> Any:
        return ((k, self[k]) for k in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)
