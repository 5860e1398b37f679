"""The operator's Kopf diff-base storage (handlers.startup.DiffBase): the operator does not use
Kopf's change detection (VLLMDeployments are queued from their events and reconciled by
generation), so the storage gives every object the same empty essence, copies nothing of it, and
never writes one into the object (Kopf's own deep-copied each object on every event and patched
its `last-handled-configuration` annotation after every handled change)."""

from __future__ import annotations

import copy
from typing import Any

import kopf
from hypothesis import given, settings
from hypothesis import strategies as st

from vllmfit.core.spec import api
from vllmfit.operator.handlers.startup import DiffBase

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                           max_leaves=10)
objects = st.fixed_dictionaries({"metadata": st.fixed_dictionaries({"name": st.text(min_size=1, max_size=8)}, optional={
    "generation": st.integers(0, 9), "annotations": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)})},
    optional={"spec": st.dictionaries(st.text(max_size=4), json_values, max_size=4),
              "status": st.dictionaries(st.text(max_size=4), json_values, max_size=4)})


class Uncopyable(dict):  # type: ignore[type-arg]
    def __deepcopy__(self, memo: Any) -> Any:
        raise AssertionError("the object was deep-copied")


@settings(max_examples=200, deadline=None)
@given(objects, objects)
def test_every_object_has_the_same_essence_and_none_is_stored(raw: dict[str, Any], other: dict[str, Any]) -> None:
    before = copy.deepcopy(raw)
    storage, body = DiffBase(), kopf.Body(raw)
    assert storage.build(body=body) == storage.fetch(body=body) == storage.build(body=kopf.Body(other)) == {}
    assert storage.build(body=body, extra_fields=[("spec",)]) == {}
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence={"spec": raw.get("spec")})
    assert not patch  # nothing written into the object
    assert raw == before


def test_kopfs_own_storage_copies_and_writes_what_ours_does_not() -> None:
    """The assertions above can fail: Kopf's storage copies the object and patches an annotation."""
    raw = {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment", "metadata": {"name": "a"},
           "spec": Uncopyable(model="m")}
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix=api.GROUP, key="last-handled-configuration")
    try:
        kopfs.build(body=kopf.Body(raw))
    except AssertionError as e:
        assert "deep-copied" in str(e)
    else:
        raise AssertionError("Kopf's storage no longer copies the object")
    patch = kopf.Patch()
    kopfs.store(body=kopf.Body(raw), patch=patch, essence={"spec": {"model": "m"}})
    assert patch["metadata"]["annotations"]
    assert DiffBase().build(body=kopf.Body(raw)) == {}  # ours: no copy
