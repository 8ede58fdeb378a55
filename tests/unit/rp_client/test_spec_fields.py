"""The SDK's JobSpec names every field the daemon's does, section by section, so a field
added to the service is typed in the torch-free client too (it would still pass through
as an extra, but untyped and unlisted)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel
from rp_client import models as client_models

from rp_service import schemas as service_schemas


def _sections(model: type[BaseModel], prefix: str = "") -> dict[str, set[str]]:
    """Dotted section name -> its field names, down through nested sections."""
    out = {prefix or "JobSpec": set(model.model_fields)}
    for name, field in model.model_fields.items():
        for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                out.update(_sections(arg, f"{prefix}{name}."))
    return out


SERVICE = _sections(service_schemas.JobSpec)
CLIENT = _sections(client_models.JobSpec)


def test_every_section_is_typed_in_the_client() -> None:
    assert SERVICE.keys() <= CLIENT.keys(), SERVICE.keys() - CLIENT.keys()


@pytest.mark.parametrize("section", sorted(SERVICE))
def test_every_field_is_typed_in_the_client(section: str) -> None:
    missing = SERVICE[section] - CLIENT.get(section, set())
    assert not missing, f"{section}: the client's JobSpec lacks {sorted(missing)}"


def test_a_client_spec_with_the_new_fields_is_one_the_daemon_takes() -> None:
    body: dict[str, Any] = client_models.JobSpec.model_validate(
        {
            "model": {"preset": "qwen3"},
            "data": {"train": "synthetic", "format": "preference"},
            "train": {"steps": 2, "objective": "dpo", "method": "lora"},
            "engine": {"layers_per_group": 2},
            "dpo": {"beta": 0.2},
        }
    ).to_body()
    spec = service_schemas.JobSpec.model_validate(body)
    assert spec.engine.layers_per_group == 2
    assert spec.dpo is not None and spec.dpo.beta == 0.2
