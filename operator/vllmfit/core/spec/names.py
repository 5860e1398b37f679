"""Names checked before they are used (pure): Hugging Face repo ids and Kubernetes object names.

`model_name_problem` mirrors huggingface_hub's `validate_repo_id` (utils/_validators.py:
REPO_ID_REGEX with re.ASCII, at most one '/', no '--' or '..', no '.git' suffix), so a name the
Hub client would refuse is refused at once, with the reason, instead of failing later inside a
handler. The catalog's names and aliases all satisfy it (tests/test_names.py).

The Kubernetes rules are apimachinery's (k8s.io/apimachinery/pkg/util/validation):
IsDNS1035Label (Service names), IsDNS1123Label (63), IsDNS1123Subdomain (253) and IsConfigMapKey.
"""

from __future__ import annotations

import re

from vllmfit.core import limits

# huggingface_hub.utils._validators.REPO_ID_REGEX (ASCII-only word characters).
_PART = r"\b[\w\-.]{1," + str(limits.MAX_REPO_ID) + r"}\b"
_REPO_ID = re.compile(f"({_PART}/)?{_PART}", re.ASCII)
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
CONFIGMAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")
DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253


def _show(name: str) -> str:
    text = ascii(name)
    return text if len(text) <= 60 else text[:57] + "..."


def model_name_problem(name: str) -> str | None:
    """Why the Hugging Face Hub would refuse `name` as a repo id, or None."""
    if not isinstance(name, str) or not name:
        return "model name is empty"
    shown = _show(name)
    if name.count("/") > 1:
        return f"model {shown} is not a Hugging Face repo id: use 'name' or 'org/name' (one '/' at most)"
    if not _REPO_ID.fullmatch(name):
        return (f"model {shown} is not a Hugging Face repo id: use ASCII letters, digits, '-', '_' or '.', "
                f"not starting or ending with '-' or '.', at most {limits.MAX_REPO_ID} characters per part")
    if "--" in name or ".." in name:
        return f"model {shown} is not a Hugging Face repo id: it must not contain '--' or '..'"
    if name.endswith(".git"):
        return f"model {shown} is not a Hugging Face repo id: it must not end in '.git'"
    return None


def deployment_name_problem(name: str) -> str | None:
    """A VLLMDeployment's metadata.name names its Service (IsDNS1035Label: starts with a letter)
    and its per-replica Deployments `<name>-<replica>`."""
    if len(name) > limits.MAX_DEPLOYMENT_NAME or not DNS1035_LABEL.fullmatch(name):
        return (f"metadata.name {name!r} must be a DNS label (lowercase letters, digits, '-', starting with a "
                f"letter) of at most {limits.MAX_DEPLOYMENT_NAME} characters: it names the Service and the "
                "Deployment of each replica")
    return None


def dns_label_problem(what: str, name: str, max_len: int = DNS1123_LABEL_MAX) -> str | None:
    if len(name) > max_len or not DNS1123_LABEL.fullmatch(name):
        return (f"{what} {_show(name)} must be a DNS label: lowercase letters, digits and '-', starting and "
                f"ending with a letter or digit, at most {max_len} characters")
    return None


def dns_subdomain_problem(what: str, name: str) -> str | None:
    if len(name) > DNS1123_SUBDOMAIN_MAX or not DNS1123_SUBDOMAIN.fullmatch(name):
        return (f"{what} {_show(name)} must be a DNS subdomain: lowercase letters, digits, '-' and '.', "
                f"at most {DNS1123_SUBDOMAIN_MAX} characters")
    return None


def configmap_key_problem(what: str, key: str) -> str | None:
    if len(key) > DNS1123_SUBDOMAIN_MAX or not CONFIGMAP_KEY.fullmatch(key) or key in (".", ".."):
        return f"{what} {_show(key)} must be a ConfigMap key: letters, digits, '-', '_' or '.'"
    return None
