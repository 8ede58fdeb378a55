"""Preference pairs: the line checks at upload (422 with the line), the JobSpec's dpo
options, and the tokenised rows DPO trains on (prompt unscored, completion scored,
truncation keeps the start)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError

from rp_service.app import create_app
from rp_service.data.formats import DataFormatError, validate_jsonl
from rp_service.data.preference import build_pairs
from rp_service.data.tokenizer import load_tokenizer
from rp_service.schemas import JobSpec
from rp_service.settings import Settings

OPENAI = {
    "input": {"messages": [{"role": "user", "content": "Is it cold in Oslo?"}], "tools": []},
    "preferred_output": [{"role": "assistant", "content": "Yes, about -5 C today."}],
    "non_preferred_output": [{"role": "assistant", "content": "No idea."}],
}
PLAIN = {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}
CHAT = {
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "chosen": [{"role": "assistant", "content": "Hello!"}],
    "rejected": [{"role": "assistant", "content": "Go away."}],
}


def jsonl(*records: Any) -> bytes:
    return b"".join(
        (r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records
    )


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(data_dir=tmp_path, gpus="none", auth="none")
    with TestClient(create_app(settings), base_url="http://127.0.0.1:8321") as c:
        yield c


@pytest.mark.parametrize("record", [OPENAI, PLAIN, CHAT], ids=["openai", "plain", "chat"])
def test_the_pair_spellings_are_detected(record: dict[str, Any]) -> None:
    assert validate_jsonl([json.dumps(record)] * 3) == (3, "preference")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({**PLAIN, "rejected": " 4"}, "identical"),
        ({**OPENAI, "non_preferred_output": OPENAI["preferred_output"]}, "identical"),
        ({"prompt": "x", "chosen": "y"}, '"rejected" is missing'),
        ({**PLAIN, "chosen": ""}, '"chosen" is empty'),
        ({**PLAIN, "chosen": [{"role": "assistant", "content": "4"}]}, "must be a string"),
        ({**CHAT, "rejected": [{"role": "user", "content": "no"}]}, 'must be "assistant"'),
        ({**OPENAI, "input": {"messages": []}}, '"input.messages" must be a non-empty list'),
        ({**OPENAI, "preferred_output": "Yes"}, '"preferred_output" must be a non-empty list'),
        ({"text": "not a pair"}, "preference"),  # a later line of another format
    ],
)
def test_bad_lines_are_refused_at_upload_with_their_line(
    client: TestClient, bad: dict[str, Any], message: str
) -> None:
    body = jsonl(PLAIN, b"", PLAIN, bad, PLAIN)
    r = client.post("/v1/files", files={"file": ("pairs.jsonl", body)})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_file_format" and err["details"] == {"line": 4}
    assert "line 4" in err["message"] and message in err["message"]


def test_a_good_upload_is_stored_as_preference(client: TestClient) -> None:
    r = client.post("/v1/files", files={"file": ("pairs.jsonl", jsonl(OPENAI, OPENAI))})
    assert r.status_code == 201, r.text
    assert r.json()["format"] == "preference" and r.json()["line_count"] == 2


def test_an_upload_may_name_the_preference_format(client: TestClient) -> None:
    """`rp upload --format preference` (the CLI offers it) and the SDK's format=."""
    body = jsonl(PLAIN, CHAT)
    r = client.post("/v1/files", files={"file": ("p.jsonl", body)}, data={"format": "preference"})
    assert r.status_code == 201, r.text
    assert r.json()["format"] == "preference"
    r = client.post("/v1/files", files={"file": ("t.jsonl", jsonl(PLAIN))}, data={"format": "text"})
    assert r.status_code == 422, r.text  # a pair is not a text line


def _spec(**train: Any) -> dict[str, Any]:
    return {
        "model": {"preset": "qwen3", "config": {"hidden_size": 32}},
        "data": {"train": "synthetic", "seq_len": 64},
        "train": {"steps": 2, **train},
        "engine": {"gpus": 0},
    }


def test_dpo_options_need_the_dpo_objective(client: TestClient) -> None:
    spec = JobSpec.model_validate(_spec(objective="dpo"))
    assert spec.dpo is not None and (spec.dpo.beta, spec.dpo.label_smoothing) == (0.1, 0.0)
    assert JobSpec.model_validate(_spec()).train.objective == "sft"
    assert JobSpec.model_validate(_spec()).dpo is None
    r = client.post("/v1/jobs", json={**_spec(), "dpo": {"beta": 0.5}})
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "dpo"
    assert "train.objective" in r.json()["error"]["message"]
    for bad in ({"beta": 0}, {"label_smoothing": 0.5}, {"gamma": 1}):
        with pytest.raises(ValidationError):
            JobSpec.model_validate({**_spec(objective="dpo"), "dpo": bad})


def test_the_objective_and_the_file_format_must_agree(client: TestClient) -> None:
    pairs = client.post("/v1/files", files={"file": ("p.jsonl", jsonl(PLAIN))}).json()["id"]
    text = client.post("/v1/files", files={"file": ("t.jsonl", jsonl({"text": "a"}))}).json()
    for objective, file_id in (("sft", pairs), ("dpo", text["id"])):
        body = _spec(objective=objective)
        body["data"]["train"] = file_id
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "format_mismatch" and err["param"] == "data.train"
        assert "train.objective" in err["message"]


def test_rows_score_the_completion_and_keep_the_start() -> None:
    tok = load_tokenizer(None)  # byte-level: one token a character
    records = [(1, PLAIN), (2, {"prompt": "abc", "chosen": "defghijk", "rejected": "x"})]
    pairs = build_pairs(records, tok, seq_len=8)
    assert pairs.input_ids.shape == (2, 2, 8)
    ids, targets, tokens = pairs.batch(torch.tensor([1]))
    assert ids.shape == (2, 8)
    chosen_ids = tok.encode(["abcdefghijk"])[0]
    # chosen: 12 tokens with eos, cut at 9 -> inputs "abcdefgh", targets from "d" on
    assert ids[0].tolist() == chosen_ids[:8]
    assert targets[0].tolist() == [-100, -100, *chosen_ids[3:9]]
    # rejected: "abcx" + eos, padded; targets "x" and eos
    assert targets[1].tolist()[:4] == [-100, -100, tok.encode(["x"])[0][0], tok.eos_id]
    assert targets[1].tolist()[4:] == [-100] * 4
    assert tokens == 8 + 4


def test_a_prompt_that_leaves_no_completion_is_refused_naming_its_line() -> None:
    tok = load_tokenizer(None)
    records = [(1, PLAIN), (7, {"prompt": "p" * 20, "chosen": "a", "rejected": "b"})]
    with pytest.raises(DataFormatError) as info:
        build_pairs(records, tok, seq_len=8)
    assert info.value.line == 7 and "data.seq_len=8" in info.value.message


def test_sft_blocks_refuse_preference_pairs() -> None:
    from rp_service.data.datasets import build_blocks

    with pytest.raises(DataFormatError, match="train.objective dpo"):
        build_blocks([PLAIN], "preference", load_tokenizer(None), seq_len=8, packing=True)
