"""`model.facts.quick_init` (issue 32): a frozen dataclass's `__init__` that sets the instance's
`__dict__` in one step builds exactly what the dataclass's own `__init__` builds, for every class
that uses it, with every argument given (positionally or by name) and with the defaults; the class
stays frozen, and `dataclasses.replace` works through it. A class it cannot build is refused."""

from __future__ import annotations

import dataclasses

import pytest

import vllmfit.core.placement  # noqa: F401 - every class using quick_init is registered at import
from vllmfit.core.model.facts import QUICK_INIT_ORIGINAL, quick_init

CLASSES = sorted(QUICK_INIT_ORIGINAL, key=lambda c: c.__qualname__)


def _both(cls: type, *args: object, **kwargs: object) -> tuple[dict, dict]:
    quick, slow = object.__new__(cls), object.__new__(cls)
    cls.__init__(quick, *args, **kwargs)
    QUICK_INIT_ORIGINAL[cls](slow, *args, **kwargs)
    return quick.__dict__, slow.__dict__


def test_the_hot_classes_use_it() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"Settings", "Footprint", "Sizing", "Booking", "ReplicaAllocation", "Decision"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__qualname__)
def test_it_builds_what_the_dataclass_builds(cls: type) -> None:
    fs = dataclasses.fields(cls)
    values = [object() for _ in fs]  # a distinct value per field: a field set from the wrong argument shows
    quick, slow = _both(cls, *values)
    assert quick == slow and list(quick) == [f.name for f in fs]
    assert _both(cls, **{f.name: v for f, v in zip(fs, values, strict=True)}) == (slow, slow)
    required = [v for f, v in zip(fs, values, strict=True) if f.default is dataclasses.MISSING]
    quick, slow = _both(cls, *required)  # every default as the dataclass fills it in
    assert quick == slow
    assert all(quick[f.name] is f.default for f in fs if f.default is not dataclasses.MISSING)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__qualname__)
def test_it_stays_frozen_and_replace_works(cls: type) -> None:
    fs = dataclasses.fields(cls)
    obj = cls(*[object() for _ in fs])
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, fs[0].name, 1)
    changed = dataclasses.replace(obj, **{fs[-1].name: "changed"})
    assert getattr(changed, fs[-1].name) == "changed"
    assert all(getattr(changed, f.name) is getattr(obj, f.name) for f in fs[:-1])


def test_a_class_it_cannot_build_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Hooked:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True)
    class Factory:
        a: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class Uninit:
        a: int = dataclasses.field(default=0, init=False)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class KeywordOnly:
        a: int

    for cls in (Hooked, Factory, Uninit, KeywordOnly):
        with pytest.raises(TypeError, match="quick_init"):
            quick_init(cls)
