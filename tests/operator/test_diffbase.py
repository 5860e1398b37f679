"""The operator's Kopf diff-base storage (handlers.startup.DiffBase) builds the essence Kopf's own
AnnotationsDiffBaseStorage builds, for any object, without deep-copying the status (issue 32)."""

from __future__ import annotations

import copy
from typing import Any

import kopf
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllmfit.core.spec import api
from vllmfit.operator.handlers.startup import DiffBase

KEY = "last-handled-configuration"
names = st.sampled_from(["a", "b", "x.y", "kopf.zalando.org/z", f"{api.GROUP}/{KEY}", f"{api.GROUP}/kopf-managed",
                         "kubectl.kubernetes.io/last-applied-configuration", "other.io/kopf-managed",
                         "other.io/admit", "app"])
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                           max_leaves=10)
metadata = st.fixed_dictionaries({"name": st.text(min_size=1, max_size=8)}, optional={
    "namespace": st.text(max_size=5), "uid": st.text(max_size=5), "resourceVersion": st.text(max_size=5),
    "generation": st.integers(0, 9), "finalizers": st.lists(st.text(max_size=5), max_size=2),
    "labels": st.dictionaries(names, st.text(max_size=5), max_size=3),
    "annotations": st.dictionaries(names, st.text(max_size=20), max_size=4),
    "ownerReferences": st.lists(st.fixed_dictionaries({"kind": st.sampled_from(["Deployment", "VLLMDeployment"]),
                                                       "name": st.text(max_size=4)}), max_size=2),
    "managedFields": st.lists(json_values, max_size=2)})
objects = st.fixed_dictionaries({"metadata": metadata}, optional={
    "apiVersion": st.sampled_from(["vllmfit.dev/v1alpha1", "apps/v1"]),
    "kind": st.sampled_from(["VLLMDeployment", "ReplicaSet"]), "spec": st.dictionaries(st.text(max_size=4), json_values, max_size=4),
    "status": st.dictionaries(st.text(max_size=4), json_values, max_size=4), "data": json_values})


def kopfs() -> kopf.AnnotationsDiffBaseStorage:
    return kopf.AnnotationsDiffBaseStorage(prefix=api.GROUP, key=KEY)


def ours() -> DiffBase:
    return DiffBase(prefix=api.GROUP, key=KEY)


@settings(max_examples=300, deadline=None)
@given(objects)
@example({"kind": "ReplicaSet", "spec": {}, "metadata": {  # Kopf's key for a Deployment's ReplicaSet: "...-ofDRS"
    "name": "r", "ownerReferences": [{"kind": "Deployment", "name": "d"}], "annotations": {f"{api.GROUP}/{KEY}": "{}"}}})
def test_the_essence_is_kopfs(raw: dict[str, Any]) -> None:
    before = copy.deepcopy(raw)
    assert ours().build(body=kopf.Body(raw)) == kopfs().build(body=kopf.Body(raw))
    assert raw == before  # neither changes the object


@settings(max_examples=200, deadline=None)
@given(objects, st.sampled_from([[("spec",)], [("spec", "model")], [("data",)], [("status",)],
                                 [("metadata", "name")], [("spec",), ("status", "phase")], ["status.phase"],
                                 ["spec.model"]]))
@example({"metadata": {"name": "a"}, "spec": {"model": "m"}, "status": {"phase": "Admitted"}}, ["status.phase"])
@example({"metadata": {"name": "a"}, "spec": {"model": "m"}, "status": {"phase": "Admitted"}}, [("status", "phase")])
def test_with_the_fields_a_handler_watches(raw: dict[str, Any], extra: list[Any]) -> None:
    """`field="spec"` (the update handler) makes Kopf pass ("spec",) on every event: the light
    path; a field in the status or the metadata takes Kopf's own."""
    assert ours().build(body=kopf.Body(raw), extra_fields=extra) == kopfs().build(body=kopf.Body(raw), extra_fields=extra)


class Uncopyable(dict):  # type: ignore[type-arg]
    def __deepcopy__(self, memo: Any) -> Any:
        raise AssertionError("the status was deep-copied")


def test_the_status_is_not_copied() -> None:
    raw = {"apiVersion": "vllmfit.dev/v1alpha1", "kind": "VLLMDeployment", "metadata": {"name": "a"},
           "spec": {"model": "m"}, "status": Uncopyable(phase="Admitted")}
    assert ours().build(body=kopf.Body(raw)) == {"spec": {"model": "m"}}
    assert ours().build(body=kopf.Body(raw), extra_fields={("spec",)}) == {"spec": {"model": "m"}}
    try:
        kopfs().build(body=kopf.Body(raw))
    except AssertionError as e:  # Kopf's own copies it: what the test would catch
        assert "deep-copied" in str(e)
    else:
        raise AssertionError("Kopf's storage no longer copies the status: DiffBase may be unneeded")
