"""GRPO's surfaces without a model: the prompt data format, the JobSpec's grpo section and
grader (422s naming the field), the grader check at submission."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from rp_service.data.formats import DataFormatError, validate_jsonl
from rp_service.errors import InvalidRequest
from rp_service.jobs.resolve import check_grader
from rp_service.schemas import DEFAULT_LR, JobSpec

GRADER = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def _spec(**sections: Any) -> dict[str, Any]:
    train = {"objective": "grpo", **sections.pop("train", {})}
    return {"model": {"preset": "qwen3"}, "data": {"train": "x"}, "train": train, **sections}


@pytest.mark.parametrize(
    "row",
    [
        {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},
        {"prompt": "2+2=", "answer": "4"},
        {"prompt": [{"role": "user", "content": "hi"}]},
    ],
)
def test_prompt_rows_are_detected(row: dict[str, Any]) -> None:
    assert validate_jsonl([json.dumps(row)]) == (1, "prompt")


def test_chat_and_prompt_completion_rows_keep_their_formats() -> None:
    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert validate_jsonl([json.dumps(chat)]) == (1, "chat")
    assert (
        validate_jsonl([json.dumps({"prompt": "a", "completion": "b"})])[1] == "prompt_completion"
    )


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "ends with an assistant turn",
        ),
        ({"prompt": "  "}, "empty"),
        ({"prompt": 3}, '"prompt" must be a string'),
    ],
)
def test_bad_prompt_rows_name_the_line(row: dict[str, Any], needle: str) -> None:
    with pytest.raises(DataFormatError) as info:
        validate_jsonl(['{"prompt": "ok"}', json.dumps(row)], "prompt")
    assert info.value.line == 2 and needle in info.value.message


def test_a_grpo_spec_fills_its_defaults_and_takes_the_fine_tune_rate() -> None:
    spec = JobSpec.model_validate(_spec(grader=GRADER, train={"method": "lora"}))
    assert spec.grpo is not None and spec.grpo.group_size == 8 and spec.grpo.loss_type == "dapo"
    assert spec.train.lr == DEFAULT_LR["lora"]
    assert spec.grader is not None and spec.grader.type == "string_check"
    assert spec.grpo.generation == "auto"


@pytest.mark.parametrize("generation", ["auto", "streamed", "engine"])
def test_every_generation_is_taken(generation: str) -> None:
    spec = JobSpec.model_validate(_spec(grader=GRADER, grpo={"generation": generation}))
    assert spec.grpo is not None and spec.grpo.generation == generation


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        (_spec(), "grader", "needs a grader"),
        ({**_spec(grader=GRADER), "train": {"objective": "sft"}}, "grader", "objective"),
        ({**_spec(grpo={}), "train": {"objective": "dpo"}}, "grpo", "objective"),
        (_spec(grader={**GRADER, "operation": "startswith"}), "grader", "operation"),
        (_spec(grader=GRADER, grpo={"num_iterations": 0}), "grpo", "num_iterations"),
        (_spec(grader=GRADER, grpo={"generation": "vllm"}), "grpo", "generation"),
    ],
)
def test_bad_grpo_specs_are_422s_naming_the_field(
    body: dict[str, Any], field: str, needle: str
) -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(body)
    error = info.value.errors()[0]
    assert error["loc"][0] == field and needle in str(error), error


def test_a_python_grader_is_refused_at_submission_unless_the_operator_allows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RP_ALLOW_PYTHON_GRADERS", raising=False)
    source = "def grade(sample, item):\n    return 1.0\n"
    spec = JobSpec.model_validate(_spec(grader={"type": "python", "name": "p", "source": source}))
    with pytest.raises(InvalidRequest) as info:
        check_grader(spec)
    assert info.value.param == "grader.type" and "RP_ALLOW_PYTHON_GRADERS" in info.value.message
    formula = {"type": "multi", "name": "m", "graders": {"a": GRADER}, "calculate_output": "a +"}
    with pytest.raises(InvalidRequest) as info:
        check_grader(JobSpec.model_validate(_spec(grader=formula)))
    assert info.value.param == "grader.calculate_output"
    check_grader(JobSpec.model_validate(_spec(grader=GRADER)))  # a runnable one passes


def test_a_batch_lasts_num_iterations_steps_and_epochs_count_batches() -> None:
    from rp_service.data.datasets import BatchOrder

    once = BatchOrder(10, 4, seed=3)
    twice = BatchOrder(10, 4, seed=3, repeat=2)
    for step in range(6):
        assert twice.indices(2 * step).equal(once.indices(step))
        assert twice.indices(2 * step + 1).equal(once.indices(step))
    assert twice.steps_for_epochs(2.0) == 2 * once.steps_for_epochs(2.0) == 10
    # a batch counts as taken at its first step
    assert twice.position(3) == once.position(2) == {"epoch": 0, "offset": 8, "samples": 8}
    assert twice.epoch(4) == once.epoch(2) == 0.8


def test_the_training_batch_is_padded_to_a_width_multiple_within_the_positions() -> None:
    """A width that changed every step would compile the GPU's decoder layers again every
    step: it is rounded up to a multiple of 64 tokens (the padding has no targets)."""
    from rp_service.worker.objectives.grpo_job import _sequences
    from rp_service.worker.sampling import Sample as Completion

    prompts = [[5, 6, 7], [8]]
    completions = [
        Completion(ids=[1, 2], finish_reason="stop", stop_id=9),
        Completion(ids=[3], finish_reason="length"),
    ]
    ids, targets = _sequences(prompts, completions, pad_id=0)
    assert ids.shape == targets.shape == (2, 64)
    assert ids[0, :6].tolist() == [5, 6, 7, 1, 2, 9] and ids[0, 6:].eq(0).all()
    assert targets[0, 2:5].tolist() == [1, 2, 9] and int((targets != -100).sum()) == 4
    assert targets[1, 0] == 3
    assert _sequences(prompts, completions, pad_id=0, max_positions=40)[0].shape == (2, 40)
    assert _sequences(prompts, completions, pad_id=0, max_positions=4)[0].shape == (2, 6)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_kl_term_is_taken_for_lora_and_for_a_full_fine_tune(method: str) -> None:
    spec = JobSpec.model_validate(
        _spec(grader=GRADER, train={"method": method}, grpo={"kl_coef": 0.1})
    )
    assert spec.grpo is not None and spec.grpo.kl_coef == 0.1
