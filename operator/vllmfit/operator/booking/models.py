"""What the operator reads from the cluster for a VLLMDeployment's spec: its model through the one
resolver (vllmfit.sources.resolve: inline modelConfig, a modelConfigRef ConfigMap, the catalog, then
the Hugging Face Hub; Store.request_for calls it), with the ConfigMap read from the API, and the
keys of the ConfigMaps its envFrom names (for the one validator)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from vllmfit.core.model.facts import ModelArch
from vllmfit.core.spec import api, read, validate
from vllmfit.sources import catalog, resolve

T = TypeVar("T")


async def _here(make: Callable[[], Awaitable[T]]) -> T:
    return await make()


async def checked(api_client: Any, body: Mapping[str, Any], policy: validate.Policy, *,
                  named: bool = True, io: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]] = _here
                  ) -> api.VLLMDeployment:
    """The object by the one reader and validator (vllmfit.core.spec.read), with the envFrom
    ConfigMaps read from the cluster (`env_sources`): what the webhook and the operator call.
    `named=False`: a CREATE with generateName. `io` runs the read where `api_client` lives (the
    webhook's loop is not the operator's: vllmfit.operator.admission.ownloop.at_home). Raises read.SpecError."""
    obj = read.deployment(body)
    sources = await io(lambda: env_sources(api_client, obj)) if validate.sources_needed(obj.spec) else None
    return read.checked(obj, catalog_model=catalog.knows(obj.spec.model), policy=policy, sources=sources,
                        named=named)


async def resolve_model(api_client: Any, obj: api.VLLMDeployment) -> ModelArch:
    """The model of `obj` by the one resolver (vllmfit.sources.resolve), with its modelConfigRef
    ConfigMap read from the API; the Hub step in a thread. Raises ModelResolutionError."""
    spec, namespace = obj.spec, obj.metadata.namespace
    ref = resolve.config_map_wanted(spec)
    data = await read_config_map(api_client, namespace, ref) if ref is not None else None
    if resolve.needs_hub(spec):
        return await asyncio.to_thread(resolve.resolve, spec, namespace, data)
    return resolve.resolve(spec, namespace, data)


async def read_config_map(api_client: Any, namespace: str, ref: api.ConfigMapKeyRef) -> dict[str, str] | None:
    """The data of ConfigMap `ref` in `namespace`; None when it is not there (404)."""
    from kubernetes_asyncio.client import ApiException, CoreV1Api

    try:
        cm = await CoreV1Api(api_client).read_namespaced_config_map(ref.name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise resolve.unreadable(namespace, ref, f"{e.status} {e.reason}") from None
    return dict(cm.data or {})


async def env_sources(api_client: Any, obj: api.VLLMDeployment) -> dict[tuple[str, str], dict[str, str] | None]:
    """The data of each ConfigMap the vllm container's envFrom names (vllmfit.core.spec.validate
    checks every variable they set); None for a Secret (the operator has no right to read them),
    and for a ConfigMap it cannot read (absent, forbidden, no API client): refused."""
    from kubernetes_asyncio.client import ApiException, CoreV1Api

    out: dict[tuple[str, str], dict[str, str] | None] = {}
    for kind, name in validate.sources_needed(obj.spec):
        out[(kind, name)] = None
        if kind != "ConfigMap" or api_client is None:
            continue
        try:
            cm = await CoreV1Api(api_client).read_namespaced_config_map(name, obj.metadata.namespace)
        except ApiException:
            continue
        out[(kind, name)] = dict(cm.data or {})  # copied into the pod as it is now (read.with_env_copied)
    return out
