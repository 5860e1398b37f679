"""Model facts from the Hugging Face Hub, for models neither in the catalog nor given inline.

Fetches `config.json` and, when the repo has one, `model.safetensors.index.json` (whose
metadata gives the exact parameter count) with `huggingface_hub.hf_hub_download`: files land in
the HF cache (HF_HOME / HF_HUB_CACHE) and are served from it when the Hub is unreachable;
`HF_ENDPOINT` (a mirror) is read on every call; the metadata request times out after
VLLMFIT_HUB_TIMEOUT seconds (10). Every failure is a `HubError` with a one-line message;
`transient` says whether trying again later may help (network) or not (no such repo, gated).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import httpx2
from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from vllmfit.core import limits
from vllmfit.core.errors import one_line
from vllmfit.core.model.config import params_from_index, parse_hf_config
from vllmfit.core.model.facts import ModelArch, ModelConfigError

DEFAULT_TIMEOUT_S = 10.0
_cache: OrderedDict[tuple[str, str, str], ModelArch] = OrderedDict()  # bounded: limits.MAX_HUB_MODELS, least recent first
_cache_lock = threading.Lock()  # resolve_model runs in threads


class HubError(Exception):
    """The model could not be resolved from the Hub (message: one line)."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _download(repo: str, filename: str, token: str | None, revision: str | None = None) -> str:
    timeout = float(os.environ.get("VLLMFIT_HUB_TIMEOUT") or DEFAULT_TIMEOUT_S)
    where = endpoint()
    try:
        try:  # one HEAD without retries first: hf_hub_download retries a failing Hub for minutes
            get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision, endpoint=where), token=token or None,
                                 timeout=timeout,
                                 endpoint=where)
        except (httpx2.TimeoutException, httpx2.NetworkError, httpx2.RemoteProtocolError):
            return hf_hub_download(repo, filename, revision=revision, token=token or None, endpoint=where,
                                   local_files_only=True)
        return hf_hub_download(repo, filename, revision=revision, token=token or None, endpoint=where,
                               etag_timeout=timeout)
    except GatedRepoError:
        hint = "the operator's token has no access to it" if token or os.environ.get("HF_TOKEN") else \
            "give the operator a token (HF_TOKEN)"
        raise HubError(f"{repo} is a gated model on the Hugging Face Hub: accept its license and {hint}, "
                       "or set spec.modelConfig") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise HubError(f"{repo}: no such model on the Hugging Face Hub ({where}), or it is private; "
                       "check spec.model or set spec.modelConfig") from None
    except RemoteEntryNotFoundError:
        raise
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, httpx2.HTTPError, OSError) as e:
        if isinstance(e, HfHubHTTPError) and e.response is not None and e.response.status_code < 500:
            raise HubError(f"{repo}: the Hugging Face Hub answered {e.response.status_code} for {filename}: "
                           f"{one_line(e)}") from None
        cause = e.__cause__ or e.__context__ or e
        raise HubError(f"cannot reach the Hugging Face Hub at {where} for {repo} ({one_line(cause)}); "
                       "will retry; set spec.modelConfig to avoid the Hub", transient=True) from None


def _read_json(path: str, repo: str, filename: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise HubError(f"{repo}: {filename} from the Hub is not valid JSON ({one_line(e)})") from None
    if not isinstance(data, dict):
        raise HubError(f"{repo}: {filename} from the Hub is not a JSON object")
    return data


def _commit(path: str) -> str | None:
    """The commit of a file in huggingface_hub's cache (.../snapshots/<commit>/<file>), or None."""
    commit = os.path.basename(os.path.dirname(path))
    return commit if len(commit) == 40 and all(c in "0123456789abcdef" for c in commit) else None


def resolve_model(name: str, token: str | None = None, revision: str | None = None) -> ModelArch:
    """The ModelArch of Hugging Face repo `name` ("org/model") at `revision` (a commit; None: the
    default branch, whose commit the ModelArch then names: `revision`). Blocking (call it in a thread
    from async code); the last limits.MAX_HUB_MODELS successes are remembered."""
    key = (name, endpoint(), revision or "")
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    try:
        path = _download(name, "config.json", token, revision)
        config = _read_json(path, name, "config.json")
    except EntryNotFoundError:
        raise HubError(f"{name} has no config.json on the Hugging Face Hub; set spec.modelConfig") from None
    params = None
    try:
        index = _read_json(_download(name, "model.safetensors.index.json", token, revision or _commit(path)),
                           name, "index")
        params = params_from_index(index, config)
    except EntryNotFoundError:  # a single-file checkpoint: count the parameters from the config
        pass
    try:
        arch = parse_hf_config(config, name=name, params=params,
                               params_source="safetensors-index" if params else "computed")
    except ModelConfigError as e:
        raise HubError(f"{name}: {e}") from None
    if commit := _commit(path):
        arch = replace(arch, revision=commit)  # what the pod loads is what was read: --revision=<commit>
    with _cache_lock:
        _cache[key] = arch
        while len(_cache) > limits.MAX_HUB_MODELS:
            _cache.popitem(last=False)
    return arch
