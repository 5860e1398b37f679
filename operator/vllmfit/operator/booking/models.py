"""Resolving the model of a VLLMDeployment: inline modelConfig, a modelConfigRef ConfigMap, the
catalog, then the Hugging Face Hub (Store.request_for calls it)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from vllmfit.core.model.config import parse_hf_config
from vllmfit.core.model.facts import ModelArch, ModelConfigError
from vllmfit.core.spec import api, validate
from vllmfit.operator.booking.record import ModelResolutionError
from vllmfit.sources import catalog


async def resolve_model(api_client: Any, obj: api.VLLMDeployment) -> ModelArch:
    """The model of `obj`: inline modelConfig, modelConfigRef ConfigMap, the catalog, then the
    Hugging Face Hub. Raises ModelResolutionError."""
    spec = obj.spec
    try:
        if spec.model_config_inline is not None:
            return parse_hf_config(dict(spec.model_config_inline), name=spec.model, params=spec.model_params,
                                   params_source="spec" if spec.model_params else "computed")
        if spec.model_config_ref is not None:
            config = await read_config_map(api_client, obj.metadata.namespace, spec.model_config_ref)
            return parse_hf_config(config, name=spec.model, params=spec.model_params,
                                   params_source="spec" if spec.model_params else "computed")
    except ModelConfigError as e:
        raise ModelResolutionError(f"spec.modelConfig: {e}") from None
    try:
        return catalog.model(spec.model)
    except catalog.CatalogError as e:
        if "/" not in spec.model:
            raise ModelResolutionError(f"{e}; or give a Hugging Face repo id (org/name) or spec.modelConfig") from None
    from vllmfit.sources import hub

    try:
        return await asyncio.to_thread(hub.resolve_model, spec.model)
    except hub.HubError as e:
        raise ModelResolutionError(str(e), transient=e.transient) from None

async def read_config_map(api_client: Any, namespace: str, ref: api.ConfigMapKeyRef) -> dict[str, Any]:
    from kubernetes_asyncio.client import ApiException, CoreV1Api

    where = f"ConfigMap {namespace}/{ref.name}"
    try:
        cm = await CoreV1Api(api_client).read_namespaced_config_map(ref.name, namespace)
    except ApiException as e:
        if e.status == 404:
            raise ModelResolutionError(f"spec.modelConfigRef: {where} not found", transient=True) from None
        raise ModelResolutionError(f"spec.modelConfigRef: cannot read {where}: {e.status} {e.reason}",
                                   transient=True) from None
    text = (cm.data or {}).get(ref.key)
    if text is None:
        raise ModelResolutionError(f"spec.modelConfigRef: {where} has no key {ref.key!r}")
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ModelResolutionError(f"spec.modelConfigRef: {where} key {ref.key!r} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelResolutionError(f"spec.modelConfigRef: {where} key {ref.key!r} is not a JSON object")
    return config


async def env_sources(api_client: Any, obj: api.VLLMDeployment) -> dict[tuple[str, str], frozenset[str] | None]:
    """The keys of each ConfigMap the vllm container's envFrom names (vllmfit.core.spec.validate
    checks every variable they set); None for a Secret (the operator has no right to read them),
    and for a ConfigMap it cannot read (absent, forbidden, no API client): refused."""
    from kubernetes_asyncio.client import ApiException, CoreV1Api

    out: dict[tuple[str, str], frozenset[str] | None] = {}
    for kind, name in validate.sources_needed(obj.spec):
        out[(kind, name)] = None
        if kind != "ConfigMap" or api_client is None:
            continue
        try:
            cm = await CoreV1Api(api_client).read_namespaced_config_map(name, obj.metadata.namespace)
        except ApiException:
            continue
        out[(kind, name)] = frozenset(cm.data or {})
    return out
