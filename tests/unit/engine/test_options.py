"""EngineOptions: each rule between fields refuses once, naming the dotted option (or the
caller's name for it); the choices are the Literal aliases the schemas import."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, get_args

import pytest

from engine.errors import ConfigError
from engine.options import (
    AdamOptions,
    EngineOptions,
    LoraOptions,
    OptionError,
    Quantization,
    default_num_microbatch,
)

ADAM = AdamOptions(lr=1e-4)
LORA = LoraOptions(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj",))


def _options(**fields: Any) -> EngineOptions:
    return EngineOptions(**{"adam": ADAM, **fields})


@pytest.mark.parametrize(
    ("fields", "field", "code"),
    [
        (
            {"num_microbatch": 5, "batch_size": 4},
            "num_microbatch",
            "num_microbatch_above_batch_size",
        ),
        ({"quantization": "nf4"}, "quantization", "nf4_needs_lora"),
        ({"optim_memory": "compact"}, "optim_memory", "compact_needs_bfloat16"),
        ({"quantization": "int8", "lora": LORA}, "quantization", "invalid_option"),
        ({"recompute_grain": "block"}, "recompute_grain", "invalid_option"),
        ({"optim_grad_dtype": "int8"}, "optim_grad_dtype", "invalid_option"),
        ({"pin_model": "mmap"}, "pin_model", "invalid_option"),
        ({"num_microbatch": 0}, "num_microbatch", "invalid_option"),
        ({"batch_size": 2.5}, "batch_size", "invalid_option"),
        ({"layers_per_group": True}, "layers_per_group", "invalid_option"),
        ({"max_gpu_memory_gib": -1.0}, "max_gpu_memory_gib", "invalid_option"),
        ({"adam": AdamOptions(lr=0.0)}, "adam.lr", "invalid_option"),
    ],
)
def test_each_rule_refuses_naming_the_dotted_option(
    fields: dict[str, Any], field: str, code: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        _options(**fields)
    assert isinstance(refused.value, OptionError)
    assert (refused.value.field, refused.value.code) == (field, code)
    assert str(refused.value).startswith(field)


def test_the_rules_accept_their_edges() -> None:
    assert _options(num_microbatch=4, batch_size=4).num_microbatch == 4
    assert _options(quantization="nf4", lora=LORA).quantization == "nf4"
    assert _options(optim_memory="compact", model_dtype="bfloat16").optim_memory == "compact"
    assert _options(num_microbatch=9).num_microbatch == 9  # no batch size: nothing to check


def test_a_caller_names_the_options_its_own_way() -> None:
    names = {"num_microbatch": "engine.num_microbatch", "batch_size": "train.batch_size"}
    with pytest.raises(OptionError) as refused:
        _options(num_microbatch=5, batch_size=4, names=names)
    assert refused.value.field == "engine.num_microbatch"
    message = str(refused.value)
    assert message.startswith("engine.num_microbatch: 5 micro-batches")
    assert "train.batch_size 4" in message and "at most 4" in message
    # the names are not part of the value
    assert _options(names=names) == _options()


@pytest.mark.parametrize(
    ("num_microbatch", "batch_size", "devices", "want"),
    [(None, None, 3, 4), (None, 2, 3, 2), (None, 16, 1, 2), (3, 16, 7, 3)],
)
def test_num_microbatch_on_devices(
    num_microbatch: int | None, batch_size: int | None, devices: int, want: int
) -> None:
    options = _options(num_microbatch=num_microbatch, batch_size=batch_size)
    assert options.num_microbatch_on(devices) == want
    assert default_num_microbatch(devices) == devices + 1


def test_the_choices_are_declared_once() -> None:
    from engine.planning.memory_plan import RunShape
    from rp_service.schemas import ModelSection

    assert get_args(Quantization) == ("none", "nf4")
    assert RunShape.__annotations__["quantization"] == "Quantization"
    schema = ModelSection.model_json_schema()["properties"]["quantization"]
    assert tuple(schema["enum"]) == get_args(Quantization)


def test_the_module_imports_without_torch() -> None:
    code = "import sys, engine.options; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
