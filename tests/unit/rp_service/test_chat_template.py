"""The model's own chat template renders training data (rp_service/data/chat_template.py):
which text is trained is read from the template, for prefix-stable templates and for
those that rewrite past turns; a folder without a template is refused at submission."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rp_service.data.chat_template import (
    CHATML,
    TemplateError,
    chat_pieces,
    folder_has_template,
    generation_prompt,
)
from rp_service.data.datasets import IGNORE_INDEX, tokenize_records
from rp_service.data.preference import build_pairs
from rp_service.data.tokenizer import load_tokenizer
from rp_service.errors import InvalidRequest
from rp_service.jobs.resolve import SpecResolver
from rp_service.schemas import JobSpec
from rp_service.settings import Settings

HASH = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)
# Like Qwen3's: the last reply is written with a marker the earlier ones lose, so rendering
# a prefix of the conversation is no prefix of rendering all of it.
REWRITES = (
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if loop.last and m['role'] == 'assistant' %}[final]{% endif %}"
    "{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "3 plus 4?"},
    {"role": "assistant", "content": "7."},
    {"role": "user", "content": "And 2 plus 2?"},
    {"role": "assistant", "content": "4."},
]


def _tok(template: str) -> object:
    tok = load_tokenizer(None, chat_template=template)
    assert tok.hf.chat_template == template
    return tok


def _trained(pieces: list[tuple[str, bool]]) -> list[str]:
    return [text for text, trained in pieces if trained]


def test_a_non_chatml_template_trains_the_replies_it_writes() -> None:
    pieces = chat_pieces(_tok(HASH).hf, CHAT)
    assert _trained(pieces) == ["7.\n", "4.\n"]
    assert "".join(t for t, _ in pieces) == _tok(HASH).hf.apply_chat_template(CHAT, tokenize=False)
    # the prompt of the first reply is exactly what serving renders to ask for it
    assert pieces[0][0] == generation_prompt(_tok(HASH).hf, CHAT[:2])


def test_chatml_keeps_the_reply_and_its_end_of_turn() -> None:
    assert _trained(chat_pieces(_tok(CHATML).hf, CHAT)) == ["7.<|im_end|>", "4.<|im_end|>"]


def test_a_template_that_rewrites_past_turns_finds_each_reply() -> None:
    pieces = chat_pieces(_tok(REWRITES).hf, CHAT)
    assert _trained(pieces) == ["7.</s>", "[final]4.</s>"]


def test_token_labels_follow_the_template() -> None:
    tok = _tok(HASH)
    [(ids, trained)] = tokenize_records([{"messages": CHAT[1:3]}], "chat", tok)
    assert tok.decode([i for i, t in zip(ids, trained, strict=True) if t]) == "7.\n<|endoftext|>"
    assert tok.decode(ids).startswith("### user:\n3 plus 4?\n### assistant:\n7.\n")


def test_preference_pairs_render_with_the_template() -> None:
    tok = _tok(HASH)
    record = {
        "prompt": [{"role": "user", "content": "2 plus 2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    pairs = build_pairs([(1, record)], tok, seq_len=64)
    rows, targets = pairs.rows()
    for row, target, reply in ((0, 0, "4"), (1, 1, "5")):
        text = tok.decode(rows[row].tolist())
        assert text.startswith("### user:\n2 plus 2?\n### assistant:\n" + reply)
        scored = [t for t in targets[target].tolist() if t != IGNORE_INDEX]
        assert tok.decode(scored) == reply + "\n<|endoftext|>"


def test_no_template_is_an_error_that_says_how_to_choose() -> None:
    tok = load_tokenizer(None)
    tok.hf.chat_template = None
    with pytest.raises(TemplateError, match="tokenizer.chat_template: 'chatml'"):
        chat_pieces(tok.hf, CHAT)


def _folder(root: Path, *, template: str | None) -> Path:
    tok = load_tokenizer(None)
    tok.hf.chat_template = template
    folder = root / "m"
    folder.mkdir()
    tok.save(folder)
    config = {"model_type": "llama", "vocab_size": 260, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    assert folder_has_template(folder) == (template is not None)
    return folder


def _resolver_and_spec(
    tmp_path: Path, folder: Path, **tokenizer: str
) -> tuple[SpecResolver, JobSpec]:
    data = tmp_path / "data"
    data.mkdir()
    (data / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    settings = Settings(data_dir=tmp_path / "d", model_roots=[tmp_path], dataset_roots=[data])
    spec = JobSpec.model_validate(
        {
            "model": {"path": str(folder)},
            "tokenizer": tokenizer,
            "data": {"train": str(data / "chat.jsonl"), "seq_len": 32},
            "train": {"steps": 1},
        }
    )
    return SpecResolver(settings, None), spec  # type: ignore[arg-type]


def test_chat_data_for_a_folder_without_a_template_is_422_on_data_train(tmp_path: Path) -> None:
    resolver, spec = _resolver_and_spec(tmp_path, _folder(tmp_path, template=None))
    with pytest.raises(InvalidRequest) as refused:
        resolver.check(spec, gpu_count=0)
    assert refused.value.param == "data.train" and refused.value.code == "no_chat_template"
    assert "tokenizer.chat_template: 'chatml'" in refused.value.message


def test_a_chosen_template_lets_it_through_and_reaches_the_worker(tmp_path: Path) -> None:
    folder = _folder(tmp_path, template=None)
    resolver, spec = _resolver_and_spec(tmp_path, folder, chat_template="chatml")
    resolver.check(spec, gpu_count=0)
    assert resolver.resolve(spec, tmp_path / "job")["chat_template"] == "chatml"
    template = tmp_path / "hash.jinja"
    template.write_text(HASH)
    spec.tokenizer.chat_template = str(template)
    resolver.check(spec, gpu_count=0)
    assert resolver.resolve(spec, tmp_path / "job")["chat_template"] == str(template)


def test_a_folder_with_a_template_needs_no_choice(tmp_path: Path) -> None:
    resolver, spec = _resolver_and_spec(tmp_path, _folder(tmp_path, template=HASH))
    resolver.check(spec, gpu_count=0)


def test_a_preset_with_a_tokenizer_folder_without_a_template_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path, template=None)
    resolver, spec = _resolver_and_spec(tmp_path, folder)
    preset = spec.model_copy(
        update={"model": spec.model.model_copy(update={"path": None, "preset": "qwen3"})}
    )
    preset.tokenizer.path = str(folder)
    with pytest.raises(InvalidRequest) as refused:
        resolver.check(preset, gpu_count=0)
    assert refused.value.param == "data.train"
