"""Render-Twice-Diff: which tokens of a chat belong to whom, for any chat template.

Both the RL rollouts (environment tokens between policy turns) and the SFT masks (assistant tokens of a teacher
trajectory) need to know which tokens the chat template adds for some messages. Instead of hard-coding role
headers per model family, we render the conversation twice — without and with the new messages — and take the
difference, asserting that the longer render extends the shorter one (a template that rewrites earlier turns, such
as Qwen3 dropping past ``<think>`` blocks, is detected instead of silently producing a wrong mask).

Token-in/token-out: the diff is taken on the rendered *text* and only the new suffix is tokenised. The cut is always
placed right after the end-of-turn token of the previous assistant turn; because special tokens are split out before
BPE runs, tokenising the prefix and the suffix separately gives exactly the tokens of tokenising the whole.

SFT masks (``assistant_mask_rows``) are built from the same two pieces the RL rollout uses: ``environment_suffix`` for
everything between two assistant turns (mask 0) and the assistant's own text, from right after the generation prompt
up to and including its end-of-turn token (mask 1). Each piece is tokenised on its own, exactly as a rollout
tokenises the prompt, each environment suffix and each sampled turn, so an SFT row and an RL completion of the same
conversation are the same token ids with the same mask. What a template writes after the end-of-turn token (the
``"\n"`` of ChatML) belongs to the next environment suffix, as in a rollout, where a policy turn ends at its
end-of-turn token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


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


# --------------------------------------------------------------------------------------------------- SFT masks


class UnmaskableTurn(ValueError):
    """An assistant turn whose tokens cannot be told apart from the rest, even rendered on its own."""


@dataclass
class MaskedRow:
    """One training row: token ids, the assistant mask (1 = trained) and the assistant messages it trains."""

    input_ids: list[int]
    assistant_masks: list[int]
    turns: list[int] = field(default_factory=list)


@dataclass
class ConversationMasks:
    """The rows of one conversation; ``per_turn`` when the template forced one row per assistant turn."""

    rows: list[MaskedRow]
    per_turn: bool = False
    reason: str = ""


def trained_turns(messages: list[dict[str, Any]]) -> list[int]:
    """Indices of the assistant messages a policy produces: every assistant message after the first user message.

    Assistant messages before any user message (τ²'s fixed greeting) are part of the prompt, as in the RL rollout
    (``prompt_text``), and are never trained.
    """
    seen_user = False
    turns = []
    for index, message in enumerate(messages):
        if message.get("role") == "user":
            seen_user = True
        elif message.get("role") == "assistant" and seen_user:
            turns.append(index)
    return turns


def assistant_turn_text(
    tokenizer: Any, messages: list[dict[str, Any]], index: int, tools: list[dict] | None
) -> tuple[str, str]:
    """``(context, assistant)`` for assistant message ``index``: the Render-Twice-Diff of one turn.

    ``context`` is ``messages[:index]`` rendered with the generation prompt; ``assistant`` is what rendering
    ``messages[:index + 1]`` adds to it, cut right after the turn's end-of-turn token. Raises
    ``TemplateNotPrefixPreserving`` when the longer render does not extend the shorter one, and ``UnmaskableTurn``
    when the added text holds no end-of-turn token.
    """
    context = render(tokenizer, messages[:index], tools, generation_prompt=True)
    full = render(tokenizer, messages[: index + 1], tools, generation_prompt=False)
    if not full.startswith(context):
        raise TemplateNotPrefixPreserving(
            f"the chat template is not prefix-preserving at assistant message {index}: rendering it changed the "
            f"text before it (first difference at character {_first_difference(full, context)})"
        )
    end_token = end_of_turn_token(tokenizer)
    cut = cut_after_last_turn(full, end_token)
    if cut <= len(context):
        raise UnmaskableTurn(
            f"the chat template adds no end-of-turn token {end_token!r} after assistant message {index}; set the "
            "tokenizer's eos_token to the token that ends an assistant turn"
        )
    return context, full[len(context) : cut]


def _tokenize_pieces(tokenizer: Any, pieces: list[tuple[str, bool]], turns: list[int]) -> MaskedRow:
    """Tokenises each trained piece alone and each run of untrained pieces as one text (as the rollout does)."""
    ids: list[int] = []
    mask: list[int] = []
    pending = ""
    for text, trained in pieces:
        if not trained:
            pending += text
            continue
        if pending:
            context_ids = tokenizer(pending, add_special_tokens=False)["input_ids"]
            ids.extend(context_ids)
            mask.extend([0] * len(context_ids))
            pending = ""
        turn_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(turn_ids)
        mask.extend([1] * len(turn_ids))
    return MaskedRow(input_ids=ids, assistant_masks=mask, turns=list(turns))


def _whole_conversation_pieces(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, turns: list[int]
) -> list[tuple[str, bool]]:
    """The conversation up to its last trained turn as (text, trained) pieces, every render checked to extend the
    previous one. Between assistant turns the text is exactly the rollout's ``environment_suffix``."""
    pieces: list[tuple[str, bool]] = []
    previous: int | None = None
    last = turns[-1]
    for index, message in enumerate(messages[: last + 1]):
        if message.get("role") != "assistant" or index == 0:  # a leading assistant message is plain context
            continue
        context, assistant = assistant_turn_text(tokenizer, messages, index, tools)
        if previous is not None:  # the rollout's environment tokens between two assistant turns
            context = environment_suffix(tokenizer, messages[: previous + 1], messages[:index], tools)
        pieces.append((context, False))
        pieces.append((assistant, index in turns))
        previous = index
    return pieces


def assistant_mask_rows(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None = None
) -> ConversationMasks:
    """Token ids and assistant mask of a conversation by Render-Twice-Diff.

    For every assistant turn i, ``messages[:i]`` is rendered with the generation prompt and ``messages[:i+1]``
    without; the new text, up to and including the end-of-turn token, is the assistant's (mask 1); everything else
    (system, user, tool text, role headers, generation prompts, the text after an end-of-turn token) is not. Each
    render must extend the previous one. One row holds the whole conversation up to its last trained turn.

    When the template is not prefix-preserving (e.g. Qwen3 drops the ``<think>`` block of earlier turns), the
    conversation falls back to one row per trained turn: the history as the template renders it then, and that
    turn's text. A turn that cannot be masked even alone raises ``UnmaskableTurn`` or
    ``TemplateNotPrefixPreserving``: a mask is never silently wrong.
    """
    turns = trained_turns(messages)
    if not turns:
        return ConversationMasks(rows=[])
    try:
        pieces = _whole_conversation_pieces(tokenizer, messages, tools, turns)
        return ConversationMasks(rows=[_tokenize_pieces(tokenizer, pieces, turns)])
    except TemplateNotPrefixPreserving as err:
        reason = str(err)
    rows = []
    for index in turns:
        context, assistant = assistant_turn_text(tokenizer, messages, index, tools)
        rows.append(_tokenize_pieces(tokenizer, [(context, False), (assistant, True)], [index]))
    logger.debug("per-turn rows for a conversation with %d assistant turns: %s", len(turns), reason)
    return ConversationMasks(rows=rows, per_turn=True, reason=reason)
