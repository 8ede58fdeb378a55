"""Tokenizers for jobs: a local Hugging Face tokenizer directory, or the built-in byte-level one.

The built-in tokenizer maps every UTF-8 byte to the token id of the same value (0..255) and
adds four special tokens after them. It is a real `tokenizers` object wrapped in a
transformers fast tokenizer, so `save_pretrained` writes a `tokenizer.json` that
`AutoTokenizer.from_pretrained` loads back next to the trained model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rp_service.errors import JobFailure

from .chat_template import CHATML

__all__ = [
    "BYTE_VOCAB_SIZE",
    "CHAT_TEMPLATE",
    "IM_END",
    "IM_START",
    "JobTokenizer",
    "TokenizerError",
    "build_byte_tokenizer",
    "load_tokenizer",
]

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_SPECIALS = (EOS, PAD, IM_START, IM_END)
BYTE_VOCAB_SIZE = 256 + len(_SPECIALS)
"""Token ids used by the built-in tokenizer: 256 bytes, then the special tokens."""

CHAT_TEMPLATE = CHATML
"""The byte tokenizer's chat template (`chat_template.CHATML`)."""


class TokenizerError(JobFailure, ValueError):
    """The tokenizer directory is missing, unreadable or unusable for training."""

    def __init__(self, message: str) -> None:
        super().__init__("invalid_tokenizer", message, param="tokenizer.path")


def _byte_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (the GPT-2 convention).

    Printable Latin-1 bytes stand for themselves; the others are shifted to code points
    from 256 up so that every byte has a visible, non-whitespace character.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def build_byte_tokenizer() -> Any:
    """Return the built-in byte-level tokenizer as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges every byte is one token whatever the split.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _SPECIALS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


@dataclass(frozen=True, kw_only=True, slots=True)
class JobTokenizer:
    """A tokenizer plus the ids the data pipeline needs.

    Attributes:
        hf: the transformers tokenizer (saved with the final model).
        eos_id: appended after every record, so packed records stay apart; None if the
            tokenizer has no end-of-text token.
        pad_id: fills the tail of unpacked sequences (never trained on).
        vocab_size: number of ids the model's embedding must cover.
        builtin: True for the built-in byte-level tokenizer.
    """

    hf: Any
    eos_id: int | None
    pad_id: int
    vocab_size: int
    builtin: bool

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens added by the tokenizer."""
        if not texts:
            return []
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (special tokens kept)."""
        return self.hf.decode(ids, skip_special_tokens=False)

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer files into `directory` (next to a saved model)."""
        self.hf.save_pretrained(str(directory))


def _wrap(hf: Any, *, builtin: bool) -> JobTokenizer:
    eos_id = hf.eos_token_id
    pad_id = hf.pad_token_id
    if pad_id is None:
        # Pad positions are masked out of the loss, so any id is fine; eos is the usual choice.
        pad_id = eos_id if eos_id is not None else 0
    return JobTokenizer(
        hf=hf, eos_id=eos_id, pad_id=int(pad_id), vocab_size=len(hf), builtin=builtin
    )


def load_tokenizer(path: str | Path | None, *, chat_template: str | None = None) -> JobTokenizer:
    """Load the tokenizer of a job.

    Args:
        path: a local tokenizer (or model) directory readable by `AutoTokenizer`; None
            selects the built-in byte-level tokenizer.
        chat_template: the Jinja template the job chose (`tokenizer.chat_template`,
            resolved); it replaces the folder's and is saved with the trained model.

    Raises:
        TokenizerError: `path` is not a directory or holds no loadable tokenizer.
    """
    if path is None:
        byte = build_byte_tokenizer()
        if chat_template is not None:
            byte.chat_template = chat_template
        return _wrap(byte, builtin=True)
    directory = Path(path)
    if not directory.is_dir():
        raise TokenizerError(f"tokenizer directory {str(directory)!r} does not exist")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # transformers raises many types; all mean "not loadable"
        raise TokenizerError(
            f"could not load a tokenizer from {str(directory)!r}: {exc}. The directory needs "
            "tokenizer.json (or the files of a slow tokenizer) and tokenizer_config.json"
        ) from exc
    log.info("tokenizer %s: %d ids, eos %s", directory, len(hf), hf.eos_token_id)
    if chat_template is not None:
        hf.chat_template = chat_template
    return _wrap(hf, builtin=False)
