"""The built-in byte-level tokenizer: ids, round trip, save and load back."""

from __future__ import annotations

import pytest

from rp_service.data.tokenizer import BYTE_VOCAB_SIZE, TokenizerError, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def test_ids_are_bytes_then_specials(tok):
    text = "héllo\n\t ✓"
    (ids,) = tok.encode([text])
    assert ids == list(text.encode("utf-8"))
    assert tok.vocab_size == BYTE_VOCAB_SIZE
    assert tok.eos_id == 256 and tok.pad_id == 257
    assert tok.encode(["<|im_start|>x"]) == [[258, 120]]


@pytest.mark.parametrize(
    "text", ["", "plain ascii", "  leading spaces", "ünïcødé 🙂 \r\n", "\x00\x7f"]
)
def test_round_trip(tok, text):
    (ids,) = tok.encode([text]) or [[]]
    assert tok.decode(ids) == text


def test_save_and_load_back(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "a story about finn. 🙂"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode([text])[0]
    assert hf.eos_token_id == tok.eos_id
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = hf.apply_chat_template(chat, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    again = load_tokenizer(tmp_path)
    assert not again.builtin and again.encode([text]) == tok.encode([text])


def test_missing_directory(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(TokenizerError, match="could not load"):
        load_tokenizer(tmp_path)
