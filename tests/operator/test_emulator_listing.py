"""The emulator's listings (opkit.Emulator, issue 32): as on the API server, a listing returns
only what its labelSelector selects (KMock alone ignores the selector and lists the whole
namespace: a deletion that asked for one deployment's pods decoded every pod of the namespace),
and it reads only its own resource's objects (KMock scans every object it ever stored, Events
included, on each listing: the emulator, not the operator, set the pace of a mass delete)."""

from __future__ import annotations

from typing import Any

import kmock
import pytest
from opkit import Cluster, label_matcher


def pod(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default", "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "i"}]}}


@pytest.mark.parametrize(("selector", "names"), [
    ("", ["a", "b", "c", "d"]),
    ("app=x", ["a", "b"]),
    ("app==x,role=w", ["a"]),
    ("app!=x", ["c", "d"]),  # a pod without the label is selected by "!=" (as the API server does)
    ("role", ["a", "c"]),
    ("!role", ["b", "d"]),
    ("app=x,!role", ["b"]),
    ("app=y", []),
])
async def test_a_listing_returns_what_its_label_selector_selects(cluster: Cluster, selector: str,
                                                                 names: list[str]) -> None:
    for p in (pod("a", app="x", role="w"), pod("b", app="x"), pod("c", app="z", role="w"), pod("d")):
        await cluster.core.create_namespaced_pod("default", p)
    listed = await cluster.core.list_namespaced_pod("default", label_selector=selector or None)
    assert sorted(p.metadata.name for p in listed.items) == names


def test_a_set_based_selector_is_refused_rather_than_ignored() -> None:
    with pytest.raises(kmock.KubernetesError):
        label_matcher("app in (x,y)")


async def test_the_store_is_kept_by_resource_too(cluster: Cluster) -> None:
    """The index a listing reads (`_ByResource.groups`) holds exactly the stored objects of each
    resource and of each resource in each namespace, after creates, deletes and a removal."""
    for name in ("a", "b"):
        await cluster.core.create_namespaced_pod("default", pod(name))
    await cluster.core.create_namespaced_config_map("default", {"metadata": {"name": "m"}})
    await cluster.core.delete_namespaced_pod("a", "default")  # deleted: KMock keeps it, marked
    store = cluster.km.objects._objects
    del cluster.km.objects["v1/configmaps", "default", "m"]  # removed from the store

    await cluster.core.create_namespaced_pod("other", {**pod("c"), "metadata": {"name": "c", "namespace": "other"}})

    def grouped() -> dict[Any, set[Any]]:
        out: dict[Any, set[Any]] = {}
        for key in store:
            out.setdefault(key[0], set()).add(key)
            out.setdefault(key[:2], set()).add(key)
        return out

    assert {g: set(keys) for g, keys in store.groups.items()} == grouped()
    assert kmock.resource("v1/configmaps") not in store.groups
    assert (kmock.resource("v1/pods"), "other") in store.groups
    listed = await cluster.core.list_namespaced_pod("default")
    assert [p.metadata.name for p in listed.items] == ["b"]
    everywhere = await cluster.core.list_pod_for_all_namespaces()
    assert sorted(p.metadata.name for p in everywhere.items) == ["b", "c"]


async def test_a_listing_with_a_limit_comes_a_page_at_a_time(cluster: Cluster) -> None:
    """As the API server: `limit` items in (namespace, name) order, a continue token while more
    remain, and the next page from it; no limit: everything at once."""
    for name in "gfedcba":
        await cluster.core.create_namespaced_pod("default", pod(name))
    first = await cluster.core.list_namespaced_pod("default", limit=3)
    assert [p.metadata.name for p in first.items] == ["a", "b", "c"]
    assert first.metadata.remaining_item_count == 4
    second = await cluster.core.list_namespaced_pod("default", limit=3, _continue=first.metadata._continue)
    third = await cluster.core.list_namespaced_pod("default", limit=3, _continue=second.metadata._continue)
    assert [p.metadata.name for p in second.items] == ["d", "e", "f"]
    assert [p.metadata.name for p in third.items] == ["g"] and not third.metadata._continue
    assert len((await cluster.core.list_namespaced_pod("default")).items) == 7
