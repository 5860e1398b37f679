"""The one reader of a VLLMDeployment: an object as the API server, Kopf or a YAML file gives it
(a mapping) -> the API types, checked by the one validator. `vllmfit plan`, the webhook and the
operator all call it, so a spec is refused with the same line wherever it is refused.

- `deployment`: the metadata and spec through the pydantic types (and the status, when asked for:
  `vllmfit plan` restores what a status booked; the webhook reads an UPDATE's old flags); a spec the
  types refuse is a `SpecError` whose message is `message`'s one line.
- `checked`: the one validator (`validate.problems`) on a read object; its problems, joined by "; ",
  are a `SpecError`. What it returns has the vllm container's envFrom ConfigMaps copied into
  spec.env (`with_env_copied`): the values checked are the values the pod gets, and a later edit
  of the ConfigMap cannot reach the container.

Pure: the shells read the ConfigMaps an envFrom names (`validate.sources_needed`) and know the
catalog; they pass what they found."""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from vllmfit.core.errors import UserError
from vllmfit.core.spec import api, validate

GENERATED = "(generated)"
"""The name that stands in for a CREATE with generateName (the API server makes the real one)."""


class SpecError(UserError, ValueError):
    """A VLLMDeployment the API types or the validator refuse; the message is one line naming the
    field (the CLI prints it, the webhook denies with it, the operator's condition says it)."""


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The API type whose field `loc` names (('spec', 'kvCache', 'tokn') -> KvCache), or None."""
    model: type[BaseModel] = api.VLLMDeployment
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return None
        inner = [t for t in (field.annotation, *_args(field.annotation))
                 if isinstance(t, type) and issubclass(t, BaseModel)]
        if not inner:
            return None
        model = inner[0]
    return model


def _args(t: Any) -> list[Any]:
    """The types inside a type (`X | None`, `list[X]`, `dict[str, X]`), depth first."""
    out: list[Any] = []
    for a in typing.get_args(t):
        out += [a, *_args(a)]
    return out


def near_field(loc: tuple[Any, ...]) -> str | None:
    """The field of the API type at `loc` closest in spelling to its last part (difflib), if any:
    ('spec', 'maxModelLength') -> 'maxModelLen'."""
    model = _model_at(loc)
    if model is None or not loc or not isinstance(loc[-1], str):
        return None
    names = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    if not close:
        lowered = {n.lower(): n for n in names}
        close = [lowered[c] for c in difflib.get_close_matches(loc[-1].lower(), list(lowered), n=1, cutoff=0.6)]
    return close[0] if close else None


def message(e: ValidationError) -> str:
    """One line: the first error's field path, what is wrong, what was given, and how many more. A
    field the type does not have is named as unknown, with the nearest field ("did you mean")."""
    errors = e.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"]) or "object"
    if first["type"] == "extra_forbidden":
        near = near_field(tuple(first["loc"]))
        msg = f"{where}: unknown field" + (f"; did you mean {near}?" if near else "")
    else:
        msg = f"{where}: {first['msg']}"
    if first["type"] not in ("missing", "extra_forbidden") and "input" in first \
            and not isinstance(first["input"], dict | list):
        msg += f" (got {_short(first['input'])})"
    if len(errors) > 1:
        others = ", ".join(".".join(str(p) for p in err["loc"]) for err in errors[1:4])
        msg += f"; {len(errors) - 1} more: {others}" + (", ..." if len(errors) > 4 else "")
    return msg


def deployment(body: Mapping[str, Any], *, status: bool = False) -> api.VLLMDeployment:
    """The object's metadata and spec (and status, with `status`) as the API types read them; its
    apiVersion and kind are the caller's to have checked (the API server, `vllmfit plan`'s reader).
    A CREATE with generateName has no name yet: GENERATED stands in (the name only matters for the
    deployment's own bookings). Raises SpecError."""
    meta = body.get("metadata")
    if isinstance(meta, Mapping) and not meta.get("name") and meta.get("generateName"):
        meta = {**meta, "name": f"{meta.get('generateName')}{GENERATED}"}
    raw: dict[str, Any] = {"metadata": meta or {}, "spec": body.get("spec") or {}}
    if status and body.get("status") is not None:
        raw["status"] = body["status"]
    try:
        return api.VLLMDeployment.model_validate(raw)
    except ValidationError as e:
        raise SpecError(message(e)) from None


def checked(obj: api.VLLMDeployment, *, catalog_model: bool, policy: validate.Policy = validate.DEFAULT_POLICY,
            sources: validate.Sources | None = None, named: bool = True) -> api.VLLMDeployment:
    """`obj` if the one validator finds nothing (see validate.problems for the arguments), else a
    SpecError naming every problem."""
    problems = validate.problems(obj, catalog_model=catalog_model, policy=policy, sources=sources, named=named)
    if problems:
        raise SpecError("; ".join(problems))
    return with_env_copied(obj, sources or {})


def with_env_copied(obj: api.VLLMDeployment, sources: validate.Sources) -> api.VLLMDeployment:
    """`obj` with the vllm container's envFrom ConfigMaps replaced by explicit spec.env values, as
    they were when they were checked. Kubernetes' order is kept: a later envFrom source wins over an
    earlier one, and spec.env over every envFrom. A source whose values were not read (keys only)
    stays an envFrom reference (`vllmfit plan` renders no pod)."""
    tpl = obj.spec.pod_template
    pod = (tpl.spec if tpl else None) or {}
    containers = pod.get("containers") if isinstance(pod, Mapping) else None
    if not containers:
        return obj
    copied: dict[str, str] = {}
    new_containers = []
    for c in containers:
        if not isinstance(c, Mapping) or c.get("name") != validate.CONTAINER or not c.get("envFrom"):
            new_containers.append(c)
            continue
        kept = []
        for src in c["envFrom"]:
            ref = src.get("configMapRef") if isinstance(src, Mapping) else None
            data = sources.get(("ConfigMap", str(ref.get("name")))) if isinstance(ref, Mapping) else None
            if not isinstance(data, Mapping):
                kept.append(src)
                continue
            copied.update({(src.get("prefix") or "") + k: str(v) for k, v in sorted(data.items())})
        new_containers.append({**{k: v for k, v in c.items() if k != "envFrom"}, **({"envFrom": kept} if kept else {})})
    if not copied and new_containers == containers:
        return obj
    own = {e.get("name") for e in obj.spec.env}
    env = [*({"name": k, "value": v} for k, v in copied.items() if k not in own), *obj.spec.env]
    new_tpl = tpl.model_copy(update={"spec": {**pod, "containers": new_containers}})  # type: ignore[union-attr]
    return obj.model_copy(update={"spec": obj.spec.model_copy(update={"env": env, "pod_template": new_tpl})})
