"""The emulator's resourceVersions (opkit.Emulator, issue 32): as on the API server, every write
gives its object a new resourceVersion, which the write's answer, the stored object and the
watch event all carry; a listing says the version it was taken at, and a watch started from a
version begins with what changed since (KMock alone: the version never changes and every watch
replays every object, so Kopf could not tell its own patches' echoes from news and handled
stale states again)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from opkit import VD, Cluster, km_url, vd

from vllmfit.core.spec import api

MERGE = "application/merge-patch+json"


async def watch_from(km: Any, version: str, count: int) -> list[dict[str, Any]]:
    """The first `count` events of a watch of every VLLMDeployment started from `version`."""
    url = f"{km_url(km)}/apis/{api.GROUP}/{api.VERSION}/{api.PLURAL}?watch=true&resourceVersion={version}"
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        async with asyncio.timeout(10):
            while len(events) < count:
                line = (await r.content.readline()).strip()
                if line:
                    events.append(json.loads(line))
    return events


async def test_every_write_gives_a_new_resource_version_that_its_answer_and_event_carry(cluster: Cluster) -> None:
    await cluster.create(vd("a"))
    created = cluster.get(VD, "a")["metadata"]["resourceVersion"]
    assert created != "1"  # vd() sends "1"; the server sets its own
    listed = await cluster.custom.list_cluster_custom_object(api.GROUP, api.VERSION, api.PLURAL)
    assert listed["metadata"]["resourceVersion"] == created  # the listing's version: the last write's
    watching = asyncio.create_task(watch_from(cluster.km, created, 2))
    answer = await cluster.custom.patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, "default", api.PLURAL, "a", {"status": {"phase": "Pending"}}, _content_type=MERGE)
    patched = answer["metadata"]["resourceVersion"]
    assert int(patched) > int(created)
    assert cluster.get(VD, "a")["metadata"]["resourceVersion"] == patched
    await cluster.create(vd("b"))
    b = cluster.get(VD, "b")["metadata"]["resourceVersion"]
    assert int(b) > int(patched)  # one counter for every object
    events = await watching  # started from `created`: neither the object as created, nor twice
    assert [(e["type"], e["object"]["metadata"]["name"], e["object"]["metadata"]["resourceVersion"])
            for e in events] == [("MODIFIED", "a", patched), ("ADDED", "b", b)]
    assert events[0]["object"]["status"] == {"phase": "Pending"}


async def test_a_watch_from_a_version_starts_with_what_changed_since(cluster: Cluster) -> None:
    for name in ("a", "b", "c"):
        await cluster.create(vd(name))
    since = cluster.get(VD, "b")["metadata"]["resourceVersion"]
    await cluster.patch_spec("a", {"maxNumSeqs": 4})
    await cluster.delete("c")
    events = await watch_from(cluster.km, since, 2)  # b is as it was at `since`: not sent again
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("MODIFIED", "a"), ("DELETED", "c")]
    assert events[0]["object"]["spec"]["maxNumSeqs"] == 4
