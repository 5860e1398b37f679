"""The base of every VLLMDeployment API model: camelCase field names as Kubernetes users write them,
unknown fields refused, values frozen."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

Phase = Literal["Pending", "Admitted", "Running", "Rejected", "Unschedulable", "Failed"]


class ApiModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)
