"""A model's chat rendering, the same in training, samples, evaluation and serving.

Chat records (and preference pairs whose prompt is a message list) are rendered with the
model folder's own chat template, through transformers' `apply_chat_template`, as the
serving process renders a request: a model trained on ``### user:`` turns is asked in
``### user:`` turns. Presets (the built-in byte tokenizer) use ChatML, `CHATML`.

Which tokens carry the loss is read from the template itself, for any template (few have
the ``{% generation %}`` markers `return_assistant_tokens_mask` needs): the reply of
assistant message ``i`` is what rendering ``messages[: i + 1]`` adds to rendering
``messages[:i]`` with the generation prompt, the header being the prompt's. Where a
template rewrites earlier turns once later ones follow (Qwen3 drops the reasoning of
past replies), the reply is found by its content in the whole conversation, with the
end-of-turn text the template writes after it. Whitespace after an end-of-turn token
(ChatML's ``<|im_end|>\n``) is left untrained, as the next header's; where whitespace alone
ends a turn (``### assistant:\n...\n``), it is trained, so the model learns to close it.

The pieces are tokenised apart, the prompt as one piece: exactly the ids serving feeds the
model for the same conversation, whatever the tokenizer's merges across the boundary.

No torch here: the daemon checks a folder's template at submission with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "CHATML",
    "TemplateError",
    "chat_pieces",
    "folder_has_template",
    "generation_prompt",
    "resolve_template",
]

# ChatML, the presets' layout; saved with the byte tokenizer so `apply_chat_template` on the
# trained model's tokenizer renders what it was trained on.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CHOOSE_HINT = (
    "choose one with tokenizer.chat_template: 'chatml', or the path of a Jinja template "
    "file under RP_MODEL_ROOTS"
)


class TemplateError(ValueError):
    """The tokenizer has no chat template, or its template cannot render a record."""


def resolve_template(choice: str) -> str:
    """The Jinja text `tokenizer.chat_template` names: ChatML for ``chatml``, else the
    content of the file at `choice` (the caller checked that it lies under the roots)."""
    if choice == "chatml":
        return CHATML
    try:
        text = Path(choice).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TemplateError(f"tokenizer.chat_template: cannot read {choice!r}: {exc}") from None
    if "messages" not in text:
        raise TemplateError(
            f"tokenizer.chat_template: {choice!r} does not read `messages`, so it is no chat "
            "template; give a Jinja file like transformers' chat_template.jinja"
        )
    return text


def folder_has_template(folder: str | Path) -> bool:
    """Whether a tokenizer folder carries a chat template, as transformers 5 saves it
    (chat_template.jinja, chat_template.json, or tokenizer_config.json's field)."""
    path = Path(folder)
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(isinstance(config, dict) and config.get("chat_template"))


def _render(hf: Any, messages: list[dict[str, Any]], *, prompt: bool) -> str:
    try:
        return str(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))
    except Exception as exc:  # jinja raises its own types, templates raise_exception(...)
        raise TemplateError(f"the chat template cannot render these messages: {exc}") from None


def generation_prompt(hf: Any, messages: list[dict[str, Any]]) -> str:
    """`messages` rendered with the assistant's turn opened: what a model answers."""
    if not getattr(hf, "chat_template", None):
        raise TemplateError(f"the tokenizer has no chat template; {CHOOSE_HINT}")
    return _render(hf, messages, prompt=True)


def _reply_span(
    hf: Any, messages: list[dict[str, Any]], i: int, full: str, cursor: int
) -> tuple[int, int]:
    """Where assistant message `i`'s reply (content and end of turn) lies in `full`."""
    head = _render(hf, messages[:i], prompt=True) if i else ""
    body = _render(hf, messages[: i + 1], prompt=False)
    if body.startswith(head) and full.startswith(body) and len(head) >= cursor:
        return len(head), len(body)
    # Not prefix-stable: find the content itself after what is already placed.
    content = messages[i]["content"]
    start = full.find(content, cursor)
    if start < 0 or not content:
        raise TemplateError(
            f"the chat template does not write message {i}'s content as given, so its "
            "trained tokens cannot be found; use a template that renders content verbatim"
        )
    end = start + len(content)
    at = body.rfind(content)
    closing = body[at + len(content) :] if at >= 0 else ""
    if closing and full.startswith(closing, end):
        end += len(closing)
    return start, end


def chat_pieces(
    hf: Any, messages: list[dict[str, Any]], *, trained_from: int = 0
) -> list[tuple[str, bool]]:
    """`(text, trained)` pieces of a conversation rendered with `hf`'s chat template.

    Args:
        hf: a transformers tokenizer with a chat template.
        messages: the conversation.
        trained_from: assistant messages before this index are context (DPO's prompt).

    Raises:
        TemplateError: no template, or one that cannot render the record.
    """
    if not getattr(hf, "chat_template", None):
        raise TemplateError(f"the tokenizer has no chat template; {CHOOSE_HINT}")
    full = _render(hf, messages, prompt=False)
    pieces: list[tuple[str, bool]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < trained_from:
            continue
        start, end = _reply_span(hf, messages, i, full, cursor)
        reply = full[start:end]
        if not reply.rstrip().endswith(message["content"].rstrip()):
            # an end-of-turn token follows the content: the whitespace after it is the
            # next header's; where whitespace is all that ends the turn, it is trained
            reply = reply.rstrip()
        pieces += [(full[cursor:start], False), (reply, True)]
        cursor = start + len(reply)
    pieces.append((full[cursor:], False))
    return [(text, trained) for text, trained in pieces if text]
