"""What a record keeps of its VLLMDeployment is what the operator reads again, once: at 5,000
deployments the operator held each object's whole body (its status and Kopf's copy of its spec
included), two parsed specs (one per event that found it decided already) and two copies of the
status it last wrote (the patch and its pruned form)."""

from __future__ import annotations

from typing import Any

import pytest
from bookkit import node
from kubernetes_asyncio import client
from opkit import Cluster, km_url, vd

from vllmfit.core.spec import api
from vllmfit.operator.booking.record import DIFFBASE, kept_body, pruned, shows
from vllmfit.operator.booking.state import Store
from vllmfit.operator.handlers.vllmdeployments import reconcile


def test_a_record_keeps_the_body_without_its_status_and_kopfs_copy() -> None:
    body = vd("a", "Qwen/Qwen2.5-0.5B-Instruct", maxModelLen=4096)
    body["metadata"].update(uid="u1", generation=2, labels={"team": "x"}, resourceVersion="7",
                            annotations={DIFFBASE: '{"spec": "..."}', "note": "kept"},
                            managedFields=[{"manager": "kubectl"}])
    body["status"] = {"phase": "Admitted", "memory": [{"node": "n", "index": 0}]}
    store = Store()
    rec = store.cache.upsert(body)
    assert "status" not in rec.body and "managedFields" not in rec.body["metadata"]
    assert rec.body["metadata"]["annotations"] == {"note": "kept"}
    assert rec.body["spec"] is body["spec"] and rec.body["metadata"]["labels"] == {"team": "x"}
    assert rec.body["metadata"]["uid"] == "u1" and rec.body["kind"] == "VLLMDeployment"
    rec.body = {**body, "spec": {**body["spec"], "replicas": 3}}  # a later event: trimmed the same way
    assert "status" not in rec.body and rec.body["spec"]["replicas"] == 3
    assert kept_body(rec.body) == rec.body  # trimming what is trimmed changes nothing


def test_the_status_kept_is_the_one_the_api_shows_and_shown_equal_without_a_copy() -> None:
    written = {"phase": "Admitted", "placement": [{"replica": 0, "node": "n", "gpus": [{"index": 0}]}],
               "kvCache": {"tokens": 4}}
    store = Store()
    rec = store.cache.upsert(vd("a", "Qwen/Qwen2.5-0.5B-Instruct"))
    rec.written = pruned({**written, "flags": None})
    assert shows(rec, written)
    assert rec._pruned[1] is rec.written  # already pruned: no second copy
    listed = {**written, "placement": [{"replica": 0, "node": "n", "gpus": [{"index": 0, "uuid": None}]}]}
    assert shows(rec, listed)  # a null inside a list, as a merge patch leaves it: still the same status


@pytest.mark.looptime
async def test_one_parsed_spec_per_deployment(km: Any) -> None:
    """A reconcile that finds its deployment decided already (the create handler after the event
    handler decided it, a resume) keeps the spec the decision parsed: the record holds one."""
    cluster = Cluster(km)
    obj = vd("a", "Qwen/Qwen2.5-0.5B-Instruct", maxModelLen=4096, maxNumSeqs=16)
    await cluster.create(obj)
    store = Store()
    store.api = client.ApiClient(client.Configuration(host=km_url(km)))
    store.rebuild([node("gpu-a", 1)], [])
    store.leading = True
    store.cache.runtime_classes = {"nvidia"}
    try:
        await reconcile(store, obj, force=False)
        rec = store.cache.records["default/a"]
        assert rec.admitted and rec.request is rec.admitted_request
        first = rec.request
        await reconcile(store, obj, force=False)  # decided already: parsed again, then the held one kept
        assert rec.request is first and rec.admitted_request is first
        changed = {**obj, "spec": {**obj["spec"], "maxNumSeqs": 8}}
        changed["metadata"] = {**obj["metadata"], "generation": 2}
        await reconcile(store, changed, force=True)  # a new spec is a new request
        assert rec.request is not first and rec.request.spec == api.VLLMDeploymentSpec.model_validate(changed["spec"])
    finally:
        await store.api.close()
        await cluster.api.close()


def test_kopf_settings_are_the_named_ones() -> None:
    """How many objects Kopf processes at once and how long it keeps an idle worker come from
    core.defaults (Kopf's own: every object at once; the chart's memory limit is sized for that)."""
    import kopf

    from vllmfit.core import defaults
    from vllmfit.operator.handlers.startup import configure

    settings = kopf.OperatorSettings()
    assert settings.queueing.worker_limit is None  # Kopf's default: every object at once
    configure(settings)
    settings.queueing.worker_limit, settings.queueing.idle_timeout = 7, 0.1  # what configure sets, whatever was there
    configure(settings)
    assert settings.queueing.worker_limit == defaults.KOPF_WORKERS
    assert settings.queueing.idle_timeout == defaults.KOPF_IDLE_SECONDS
