"""The one model resolver: a VLLMDeployment spec -> its model facts (`ModelArch`), for `vllmfit plan`,
the webhook and the operator alike, with one set of messages (`ModelResolutionError`).

In order: the inline `spec.modelConfig`; the `spec.modelConfigRef` ConfigMap's key; the catalog (names
and aliases); the Hugging Face Hub for an "org/name" the catalog does not know. The shells differ only
in where a ConfigMap comes from (the operator reads it from the API, `plan` from its input files):
they read the ConfigMap `config_map_wanted` names and pass its data in, or None when it is not there.
Only the Hub step does I/O and may block (`needs_hub`: async shells call `resolve` in a thread then).
`vllmfit estimate --model NAME` resolves a name the same way (`by_name`).

The Hub's own messages are written for the operator (it retries, it holds the token); the CLI puts
them in its words at its edge (`vllmfit.cli.output.hub_words`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vllmfit.core.errors import UserError
from vllmfit.core.model.config import parse_hf_config
from vllmfit.core.model.facts import ModelArch, ModelConfigError
from vllmfit.core.spec import extraargs
from vllmfit.core.spec.api import ConfigMapKeyRef, VLLMDeploymentSpec
from vllmfit.sources import catalog


class ModelResolutionError(UserError, LookupError):
    """The model of a spec cannot be resolved (message: one user-facing line). `transient`: it may
    resolve later (the Hub unreachable, the ConfigMap not created yet: apply order)."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def config_map_wanted(spec: VLLMDeploymentSpec) -> ConfigMapKeyRef | None:
    """The ConfigMap (in the deployment's namespace) whose data `resolve` needs, if any."""
    return spec.model_config_ref if spec.model_config_inline is None else None


def needs_hub(spec: VLLMDeploymentSpec) -> bool:
    """Whether `resolve` will ask the Hugging Face Hub (blocking I/O) for this spec."""
    return (spec.model_config_inline is None and spec.model_config_ref is None and "/" in spec.model
            and not catalog.knows(spec.model))


def _where(namespace: str, ref: ConfigMapKeyRef) -> str:
    return f"spec.modelConfigRef: ConfigMap {namespace}/{ref.name}"


def unreadable(namespace: str, ref: ConfigMapKeyRef, why: str) -> ModelResolutionError:
    """The error for a ConfigMap the shell could not read (an API error: tried again later)."""
    return ModelResolutionError(f"spec.modelConfigRef: cannot read ConfigMap {namespace}/{ref.name}: {why}",
                                transient=True)


def _facts(config: Mapping[str, Any], spec: VLLMDeploymentSpec, where: str) -> ModelArch:
    try:
        return parse_hf_config(dict(config), name=spec.model, params=spec.model_params,
                               params_source="spec.modelParams" if spec.model_params else "computed")
    except ModelConfigError as e:
        raise ModelResolutionError(f"{where}: {e}") from None


OFFLINE = "; the Hugging Face Hub was not asked (offline): pass --hub to ask it, or set spec.modelConfig"
"""What an "org/name" outside the catalog is told when the shell keeps off the network (`hub=False`:
`vllmfit plan` and `estimate` without --hub)."""


def by_name(name: str, revision: str | None = None, *, hub: bool = True) -> ModelArch:
    """A model by name: the catalog (names and aliases), then, with `hub`, the Hugging Face Hub for
    an "org/name" it does not know (at the commit `revision` when given). Blocking when it asks the Hub. Raises ModelResolutionError: the
    catalog's line (the closest names), and for an "org/name" what the Hub said after it (or, without
    `hub`, that it was not asked)."""
    try:
        return catalog.model(name)
    except catalog.CatalogError as e:
        if "/" not in name:
            raise ModelResolutionError(str(e)) from None
        if not hub:
            raise ModelResolutionError(f"{e}{OFFLINE}") from None
        unknown = str(e)
    try:
        from vllmfit.sources import hub  # huggingface_hub is slow to import: only when it is needed
    except ImportError:  # an install without the Hub's client: the catalog's answer
        raise ModelResolutionError(unknown) from None
    try:
        return hub.resolve_model(name, revision=revision) if revision else hub.resolve_model(name)
    except hub.HubError as e:
        raise ModelResolutionError(f"{unknown}; Hugging Face Hub: {e}", transient=e.transient) from None


def resolve(spec: VLLMDeploymentSpec, namespace: str = "default",
            config_map: Mapping[str, Any] | None = None, *, hub: bool = True) -> ModelArch:
    """The model facts of `spec` (module docstring). `config_map`: the data of the ConfigMap
    `config_map_wanted` names, as the shell read it; None when there is no such ConfigMap. `hub`:
    whether an "org/name" outside the catalog may be fetched from the Hugging Face Hub (the operator
    does; `vllmfit plan` only with --hub). Raises ModelResolutionError."""
    if spec.model_config_inline is not None:
        return _facts(spec.model_config_inline, spec, "spec.modelConfig")
    ref = spec.model_config_ref
    if ref is not None:
        where = _where(namespace, ref)
        if config_map is None:
            raise ModelResolutionError(f"{where} not found", transient=True)
        text = config_map.get(ref.key)
        if text is None:
            raise ModelResolutionError(f"{where} has no key {ref.key!r}")
        try:
            config = json.loads(text) if isinstance(text, str | bytes) else None
        except ValueError as e:
            raise ModelResolutionError(f"{where} key {ref.key!r} is not JSON ({e})") from None
        if not isinstance(config, dict):
            raise ModelResolutionError(f"{where} key {ref.key!r} is not a JSON object")
        return _facts(config, spec, f"{where} key {ref.key!r}")
    pinned = extraargs.values_of(spec.extra_args, "--revision")  # the Hub's config at the commit the pod loads
    try:
        return by_name(spec.model, pinned[-1][1].strip() if pinned else None, hub=hub)
    except ModelResolutionError as e:
        if "/" in spec.model:
            raise
        raise ModelResolutionError(f"{e}; or give a Hugging Face repo id (org/name) or spec.modelConfig") from None
