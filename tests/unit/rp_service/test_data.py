"""Data pipeline: jsonl validation (line numbers), tokenisation masks, packing, batch order."""

from __future__ import annotations

import json

import pytest
import torch

from rp_service.data.datasets import (
    IGNORE_INDEX,
    BatchOrder,
    DataFormatError,
    build_blocks,
    read_records,
    tokenize_records,
    validate_jsonl,
)
from rp_service.data.tokenizer import load_tokenizer
from rp_service.demo import synthetic_records


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _lines(*records: object) -> list[str]:
    return [r if isinstance(r, str) else json.dumps(r) for r in records]


@pytest.mark.parametrize(
    ("record", "fmt"),
    [
        ({"text": "hello"}, "text"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "chat",
        ),
        ({"prompt": "2+2=", "completion": "4"}, "prompt_completion"),
    ],
)
def test_detects_each_format(record, fmt, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(_lines(record, record)) + "\n\n")
    assert validate_jsonl(path) == (2, fmt)
    assert validate_jsonl(_lines(record), fmt) == (1, fmt)


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"text": 3}, '"text" must be a string'),
        ({"prompt": "x", "completion": "y"}, "text"),  # format changes mid-file
        ({"text": ""}, "empty"),
    ],
)
def test_first_bad_line_is_named(bad, needle):
    lines = _lines({"text": "a"}, "", {"text": "b"}, bad, "{also bad")
    with pytest.raises(DataFormatError) as info:
        validate_jsonl(lines)
    assert info.value.line == 4
    assert needle in info.value.message


@pytest.mark.parametrize(
    ("line", "where"),
    [
        ('{"text": "a"', "Expecting ',' delimiter where the line ends, after column 12"),
        ('{"text": "a",', "where the line ends, after column 13"),
        ('{"text": "a"}  x', "Extra data at column 16"),
        ('{"text": "\u00e9", x}', "at column 15"),  # columns count characters, not bytes
        ('{"text": "a\tb"}', "Invalid control character at column 12"),
    ],
)
@pytest.mark.parametrize("ending", ["\n", "\r\n", ""])
def test_a_json_error_names_a_column_inside_the_line(line, where, ending, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(('{"text": "ok"}\n' + line + ending).encode())
    with pytest.raises(DataFormatError) as info:
        validate_jsonl(path)
    assert info.value.line == 2
    assert info.value.message.startswith("not valid JSON (")
    assert where in info.value.message
    assert f"column {len(line) + 1}" not in info.value.message  # never past the end


def test_chat_validation_names_the_message():
    no_assistant = {"messages": [{"role": "user", "content": "hi"}]}
    bad_role = {"messages": [{"role": "robot", "content": "hi"}]}
    for record, needle in [(no_assistant, "assistant"), (bad_role, "messages[0].role")]:
        with pytest.raises(DataFormatError) as info:
            validate_jsonl(_lines(record), "chat")
        assert info.value.line == 1
        assert needle in info.value.message


def test_empty_and_non_utf8():
    with pytest.raises(DataFormatError) as info:
        validate_jsonl(["", "  \n"])
    assert info.value.line == 0
    with pytest.raises(DataFormatError) as info:
        validate_jsonl([b'{"text": "ok"}\n', b'{"text": "\xff"}\n'])
    assert info.value.line == 2


def test_masks_follow_the_format(tok):
    pc = tokenize_records([{"prompt": "ab", "completion": "cd"}], "prompt_completion", tok)
    ids, trained = pc[0]
    assert ids == [97, 98, 99, 100, tok.eos_id]
    assert trained == [False, False, True, True, True]

    chat = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ids, trained = tokenize_records([chat], "chat", tok)[0]
    text = tok.decode(ids)
    assert (
        text == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n<|endoftext|>"
    )
    assert (
        tok.decode([i for i, t in zip(ids, trained, strict=True) if t])
        == "a<|im_end|><|endoftext|>"
    )


def test_packing_shifts_labels_and_keeps_every_target(tok):
    records = [{"text": "abcdefg"}, {"text": "hijklmn"}]  # 16 tokens with the two eos
    blocks = build_blocks(records, "text", tok, seq_len=5, packing=True)
    stream = [*range(97, 104), tok.eos_id, *range(104, 111), tok.eos_id]
    assert len(blocks) == 3
    assert blocks.input_ids.flatten().tolist() == stream[:15]
    assert blocks.labels.flatten().tolist() == stream[1:16]
    assert blocks.tokens.tolist() == [5, 5, 5]


def test_packing_masks_prompts(tok):
    records = [{"prompt": "ab", "completion": "c"}] * 3
    blocks = build_blocks(records, "prompt_completion", tok, seq_len=4, packing=True)
    # stream: a b c eos a b c eos a b c eos; targets of a, b (prompt) are masked.
    assert blocks.labels.flatten().tolist() == [
        IGNORE_INDEX, 99, tok.eos_id, IGNORE_INDEX,
        IGNORE_INDEX, 99, tok.eos_id, IGNORE_INDEX,
    ]  # fmt: skip


def test_unpacked_pads_and_truncates(tok):
    records = [{"text": "ab"}, {"text": "abcdefghij"}]
    blocks = build_blocks(records, "text", tok, seq_len=4, packing=False)
    assert blocks.input_ids.tolist() == [[97, 98, tok.pad_id, tok.pad_id], [97, 98, 99, 100]]
    assert blocks.labels.tolist() == [
        [98, tok.eos_id, IGNORE_INDEX, IGNORE_INDEX],
        [98, 99, 100, 101],
    ]
    assert blocks.tokens.tolist() == [2, 4]


def test_too_little_data_for_one_block(tok):
    with pytest.raises(DataFormatError, match=r"seq_len"):
        build_blocks([{"text": "ab"}], "text", tok, seq_len=64, packing=True)


def test_batch_order_is_a_function_of_seed_and_step():
    order = BatchOrder(7, 3, seed=5)
    steps = [order.indices(k).tolist() for k in range(7)]
    # Every epoch is a permutation: 7 steps x 3 = 3 full epochs of 7 blocks.
    flat = [i for s in steps for i in s]
    for epoch in range(3):
        assert sorted(flat[epoch * 7 : epoch * 7 + 7]) == list(range(7))
    fresh = BatchOrder(7, 3, seed=5)
    assert [fresh.indices(k).tolist() for k in (6, 2, 4)] == [steps[6], steps[2], steps[4]]
    other = BatchOrder(7, 3, seed=6)
    assert [other.indices(k).tolist() for k in range(7)] != steps
    assert order.position(5) == {"epoch": 2, "offset": 1, "samples": 15}
    assert order.steps_for_epochs(1.0) == 3


def test_read_records_and_synthetic(tok):
    records = synthetic_records(50, seed=1)
    assert records == synthetic_records(50, seed=1)
    assert records != synthetic_records(50, seed=1, valid=True)
    lines = [json.dumps(r) for r in records]
    fmt, parsed = read_records(lines)
    assert fmt == "text" and parsed == records
    blocks = build_blocks(parsed, fmt, tok, seq_len=32, packing=True)
    ids, labels, tokens = blocks.batch(torch.tensor([0, 2]))
    assert ids.dtype == torch.int64 and ids.shape == (2, 32) and tokens == 64
    assert torch.equal(labels[0, :-1], ids[0, 1:])
