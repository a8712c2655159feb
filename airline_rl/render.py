"""Render-Twice-Diff: which tokens of a chat belong to whom, for any chat template.

Both the RL rollouts (environment tokens between policy turns) and the SFT masks (assistant tokens of a teacher
trajectory) need to know which tokens the chat template adds for some messages. Instead of hard-coding role
headers per model family, we render the conversation twice — without and with the new messages — and take the
difference, asserting that the longer render extends the shorter one (a template that rewrites earlier turns, such
as Qwen3 dropping past ``<think>`` blocks, is detected instead of silently producing a wrong mask).

Token-in/token-out: the diff is taken on the rendered *text* and only the new suffix is tokenised. The cut is always
placed right after the end-of-turn token of the previous assistant turn; because special tokens are split out before
BPE runs, tokenising the prefix and the suffix separately gives exactly the tokens of tokenising the whole.
"""

from __future__ import annotations

from typing import Any


class TemplateNotPrefixPreserving(ValueError):
    """Rendering more messages changed the text of the earlier ones."""


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool) -> str:
    """The chat template applied to ``messages`` as text."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
    )


def end_of_turn_token(tokenizer: Any) -> str:
    """The text of the token that ends an assistant turn (``<|im_end|>`` for Qwen2.5; the tokenizer's EOS)."""
    token = tokenizer.eos_token
    if not token:
        raise ValueError("the tokenizer has no eos_token; set it to the chat template's end-of-turn token")
    return token


def cut_after_last_turn(text: str, end_token: str) -> int:
    """Position right after the last ``end_token`` in ``text`` (0 when there is none)."""
    position = text.rfind(end_token)
    return 0 if position < 0 else position + len(end_token)


def prompt_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None) -> str:
    """The text a policy is conditioned on before its first sampled token, cut after the last end-of-turn token.

    ``messages`` ends with a non-policy assistant message (the fixed greeting), so the cut leaves everything that
    the template puts after it (newline, next role header) to the environment suffix of the first user message.
    """
    text = render(tokenizer, messages, tools, generation_prompt=False)
    return text[: cut_after_last_turn(text, end_of_turn_token(tokenizer))]


def environment_suffix(
    tokenizer: Any,
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    tools: list[dict] | None,
) -> str:
    """Text the template inserts after the last assistant turn of ``before`` for the new messages of ``after``.

    It runs up to and including the next generation prompt; for Qwen2.5:
    ``\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``.
    """
    shorter = render(tokenizer, before, tools, generation_prompt=False)
    cut = cut_after_last_turn(shorter, end_of_turn_token(tokenizer))
    longer = render(tokenizer, after, tools, generation_prompt=True)
    if not longer.startswith(shorter[:cut]):
        raise TemplateNotPrefixPreserving(
            "the chat template is not prefix-preserving: rendering the new messages changed the earlier text "
            f"(first difference at character {_first_difference(longer, shorter[:cut])})"
        )
    return longer[cut:]


def environment_suffix_ids(
    tokenizer: Any, before: list[dict[str, Any]], after: list[dict[str, Any]], tools: list[dict] | None
) -> list[int]:
    """Token ids of ``environment_suffix`` (tokenised alone: exact, since the cut follows a special token)."""
    return tokenizer(environment_suffix(tokenizer, before, after, tools), add_special_tokens=False)["input_ids"]


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
