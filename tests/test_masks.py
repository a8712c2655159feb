"""Render-Twice-Diff assistant masks (``tau2_rl.render.assistant_mask_rows``) across TRL's bundled chat templates.

Each template gets a tokenizer trained in-process on the airline domain (``build_tiny_tokenizer``) with the family's
special tokens added. The mask must cover exactly each assistant turn's text and its end-of-turn token, and nothing of
the system, user or tool text (sentinel words prove it); where TRL ships a ``{% generation %}`` training template,
the mask must agree with the one ``apply_chat_template(return_assistant_tokens_mask=True)`` gives, up to the
documented differences (TRL also trains the ``"\\n"`` after ``<|im_start|>assistant`` in qwen2_5 and the
``"\\n"`` after ``<|im_end|>`` in qwen2_5 / qwen3: at inference the first is part of the generation prompt and the
second comes after the turn has ended). A template that is not prefix-preserving (qwen3) falls back to one row per
assistant turn; a turn that cannot be masked at all is an error. Finally an SFT row equals, token for token, the RL
rollout of the same conversation (``TokenPolicyAgent``).
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tau2_rl.data.collect import rows_to_dataset
from tau2_rl.data.tiny_model import build_tiny_tokenizer
from tau2_rl.domains import get_domain
from tau2_rl.envs.agents import get_agent
from tau2_rl.envs.episode import DomainEnv
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.render import (
    TemplateNotPrefixPreserving,
    UnmaskableTurn,
    assistant_mask_rows,
    environment_suffix,
    prompt_text,
    render,
    trained_turns,
)
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.rollout import TokenPolicyAgent, episode_tensors
from tau2_rl.trainers.sft import prepare_sft_dataset

AIRLINE = get_domain("airline")

LLAMA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Look up {name}.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
    for name in ("get_user_details", "get_reservation_details")
]
SENTINELS = ["zebrasystem", "zebrauser", "zebratool", "zebraother", "zebraagain"]  # never in assistant text


def call(name: str, **arguments: object) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def assistant(content: str, *calls: dict) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


# System, user, assistant (two tool calls), two tool results, assistant text, user, assistant (text + call), tool,
# assistant text. Assistant texts hold no sentinel; every other message holds one.
MULTI_CALL = [
    {"role": "system", "content": "You are an airline agent zebrasystem."},
    {"role": "user", "content": "Hi, cancel my trip zebrauser please."},
    assistant("", call("get_user_details", key="mia_li_3668"), call("get_reservation_details", key="NO6JO3")),
    {"role": "tool", "name": "get_user_details", "content": '{"user_id": "mia_li_3668", "note": "zebratool"}'},
    {"role": "tool", "name": "get_reservation_details", "content": '{"reservation_id": "NO6JO3", "x": "zebraother"}'},
    {"role": "assistant", "content": "I found reservation NO6JO3. Do you confirm (yes/no)?"},
    {"role": "user", "content": "yes zebraagain"},
    assistant("Cancelling now.", call("get_reservation_details", key="NO6JO3")),
    {"role": "tool", "name": "get_reservation_details", "content": '{"status": "cancelled", "y": "zebratool"}'},
    {"role": "assistant", "content": "Done. Anything else?"},
]  # fmt: skip

# Llama 3.1 renders at most one tool call per assistant turn.
SINGLE_CALL = [
    {"role": "system", "content": "You are an airline agent zebrasystem."},
    {"role": "user", "content": "Hi, cancel my trip zebrauser please."},
    assistant("", call("get_user_details", key="mia_li_3668")),
    {"role": "tool", "name": "get_user_details", "content": '{"user_id": "mia_li_3668", "note": "zebratool"}'},
    {"role": "assistant", "content": "I found your profile. Do you confirm (yes/no)?"},
    {"role": "user", "content": "yes zebraagain"},
    {"role": "assistant", "content": "Done. Anything else?"},
]

PLAIN = [
    {"role": "system", "content": "You are an airline agent zebrasystem."},
    {"role": "user", "content": "Hi zebrauser."},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Bye zebraagain."},
    {"role": "assistant", "content": "Goodbye!"},
]

QWEN_TURNS = [  # what qwen2_5.jinja adds for each assistant turn of MULTI_CALL, up to <|im_end|>
    '<tool_call>\n{"name": "get_user_details", "arguments": {"key": "mia_li_3668"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_reservation_details", "arguments": {"key": "NO6JO3"}}\n</tool_call><|im_end|>',
    "I found reservation NO6JO3. Do you confirm (yes/no)?<|im_end|>",
    'Cancelling now.\n<tool_call>\n{"name": "get_reservation_details", "arguments": {"key": "NO6JO3"}}\n</tool_call>'
    "<|im_end|>",
    "Done. Anything else?<|im_end|>",
]
LLAMA31_TURNS = [
    '{"name": "get_user_details", "parameters": {"key": "mia_li_3668"}}<|eot_id|>',
    "I found your profile. Do you confirm (yes/no)?<|eot_id|>",
    "Done. Anything else?<|eot_id|>",
]


def template(name: str) -> str:
    return resources.files("trl").joinpath("chat_templates", name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(vocab_size=1024).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def make_tokenizer(base_dir: Path):
    def make(template_name: str):
        tokenizer = AutoTokenizer.from_pretrained(base_dir)
        if template_name.startswith("qwen3"):
            tokenizer.add_tokens(["<think>", "</think>"])  # added but not special, as in Qwen3
        if template_name.startswith("llama3"):
            tokenizer.add_tokens(LLAMA_SPECIAL, special_tokens=True)
            tokenizer.bos_token = "<|begin_of_text|>"
            tokenizer.eos_token = "<|eot_id|>"
        tokenizer.chat_template = template(template_name)
        return tokenizer

    return make


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every run of ones."""
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


def masked_texts(tokenizer, row) -> list[str]:
    return [tokenizer.decode(row.input_ids[a:b]) for a, b in runs(row.assistant_masks)]


def assert_only_assistant(tokenizer, row, messages) -> None:
    """No system/user/tool text (sentinel words) under the mask; all of it outside."""
    trained = "".join(masked_texts(tokenizer, row))
    untrained = tokenizer.decode([i for i, m in zip(row.input_ids, row.assistant_masks, strict=True) if not m])
    for sentinel in SENTINELS:
        present = any(sentinel in (m.get("content") or "") for m in messages)
        assert sentinel not in trained
        assert (sentinel in untrained) == present


# ---------------------------------------------------------------------------------------------- exact masks


@pytest.mark.parametrize(
    ("template_name", "messages", "expected"),
    [("qwen2_5.jinja", MULTI_CALL, QWEN_TURNS), ("llama3_1.jinja", SINGLE_CALL, LLAMA31_TURNS)],
)
def test_mask_is_exactly_the_assistant_turns(make_tokenizer, template_name, messages, expected) -> None:
    tokenizer = make_tokenizer(template_name)
    masks = assistant_mask_rows(tokenizer, messages, TOOLS)
    assert not masks.per_turn and len(masks.rows) == 1
    row = masks.rows[0]
    assert masked_texts(tokenizer, row) == expected
    assert_only_assistant(tokenizer, row, messages)
    # The row is the conversation as the template renders it, up to the last end-of-turn token.
    full = render(tokenizer, messages, TOOLS, generation_prompt=False)
    eot = tokenizer.eos_token
    assert tokenizer.decode(row.input_ids) == full[: full.rfind(eot) + len(eot)]
    assert row.turns == trained_turns(messages)


@pytest.mark.parametrize("template_name", ["qwen2_5.jinja", "qwen3_training.jinja", "llama3.jinja", "llama3_1.jinja"])
def test_no_system_user_or_tool_text_is_trained(make_tokenizer, template_name) -> None:
    tokenizer = make_tokenizer(template_name)
    messages = (
        SINGLE_CALL
        if template_name.startswith("llama3_1")
        else PLAIN
        if template_name == "llama3.jinja"
        else MULTI_CALL
    )
    row = assistant_mask_rows(tokenizer, messages, TOOLS if "llama3.j" not in template_name else None).rows[0]
    texts = masked_texts(tokenizer, row)
    assert len(texts) == len(trained_turns(messages))
    assert all(text.endswith(tokenizer.eos_token) and text.count(tokenizer.eos_token) == 1 for text in texts)
    assert_only_assistant(tokenizer, row, messages)


def test_greeting_before_the_first_user_message_is_context(make_tokenizer) -> None:
    tokenizer = make_tokenizer("qwen2_5.jinja")
    messages = [MULTI_CALL[0], {"role": "assistant", "content": "Hi! How can I help you today?"}, *MULTI_CALL[1:]]
    row = assistant_mask_rows(tokenizer, messages, TOOLS).rows[0]
    assert masked_texts(tokenizer, row) == QWEN_TURNS
    assert trained_turns(messages) == [3, 6, 8, 10]


# ---------------------------------------------------------------------------------------------- TRL generation masks


@pytest.mark.parametrize(
    ("template_name", "messages", "tools", "extra"),
    [
        # TRL also trains "\n" after "<|im_start|>assistant" and after each "<|im_end|>".
        ("qwen2_5_training.jinja", MULTI_CALL, TOOLS, {"header_newline", "eot_newline"}),
        # TRL also trains the "\n" after each "<|im_end|>"; the role header's "\n" is outside its generation block.
        ("qwen3_training.jinja", MULTI_CALL, TOOLS, {"eot_newline"}),
        # Identical: Llama 3 puts nothing between the end-of-turn token and the next header.
        ("llama3_training.jinja", PLAIN, None, set()),
    ],
)
def test_agrees_with_trl_generation_masks(make_tokenizer, template_name, messages, tools, extra) -> None:
    tokenizer = make_tokenizer(template_name)
    ours = assistant_mask_rows(tokenizer, messages, tools)
    assert not ours.per_turn
    row = ours.rows[0]
    trl = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    trl_ids, trl_mask = list(trl["input_ids"]), list(trl["assistant_masks"])
    # Tokenising the pieces separately (as the rollout does) gives the tokens of the whole text.
    assert trl_ids[: len(row.input_ids)] == row.input_ids
    differences = set()
    for position, (mine, theirs) in enumerate(zip(row.assistant_masks, trl_mask, strict=False)):
        if mine == theirs:
            continue
        assert mine == 0 and theirs == 1, f"token {position} is trained by us but not by TRL"
        token = tokenizer.decode([trl_ids[position]])
        previous = tokenizer.decode(trl_ids[max(0, position - 2) : position])
        assert token == "\n", f"unexpected difference at token {position}: {token!r}"
        differences.add("eot_newline" if previous.endswith(tokenizer.eos_token) else "header_newline")
    tail = [
        tokenizer.decode([i])
        for i, m in zip(trl_ids[len(row.input_ids) :], trl_mask[len(row.input_ids) :], strict=True)
        if m
    ]
    assert set(tail) <= {"\n"}  # after our row ends: TRL's last "\n" after the final end-of-turn token
    assert differences == extra


# ---------------------------------------------------------------------------------------------- fallback and errors


QWEN3_TWO_QUERIES = [
    {"role": "system", "content": "You are an airline agent zebrasystem."},
    {"role": "user", "content": "Hi zebrauser."},
    {**assistant("Let me check.", call("get_user_details", key="a1")), "reasoning_content": "The user greets."},
    {"role": "tool", "name": "get_user_details", "content": '{"user_id": "a1", "note": "zebratool"}'},
    {"role": "assistant", "content": "Found you."},
    {"role": "user", "content": "Bye zebraagain."},
    {"role": "assistant", "content": "Goodbye!"},
]  # fmt: skip


def test_qwen3_falls_back_to_one_row_per_turn(make_tokenizer) -> None:
    tokenizer = make_tokenizer("qwen3.jinja")  # drops the <think> blocks of turns before the last user query
    masks = assistant_mask_rows(tokenizer, QWEN3_TWO_QUERIES, TOOLS)
    assert masks.per_turn and "prefix-preserving" in masks.reason
    assert [row.turns for row in masks.rows] == [[2], [4], [6]]
    expected = [
        '<think>\nThe user greets.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_user_details", '
        '"arguments": {"key": "a1"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nFound you.<|im_end|>",
        "<think>\n\n</think>\n\nGoodbye!<|im_end|>",
    ]
    for row, index, text in zip(masks.rows, [2, 4, 6], expected, strict=True):
        assert masked_texts(tokenizer, row) == [text]
        context = render(tokenizer, QWEN3_TWO_QUERIES[:index], TOOLS, generation_prompt=True)
        assert tokenizer.decode(row.input_ids) == context + text  # the history as the template renders it then
        assert_only_assistant(tokenizer, row, QWEN3_TWO_QUERIES[:index])
    # The last row's history no longer shows the first turn's reasoning: what Qwen3 sees at inference.
    assert "The user greets." not in tokenizer.decode(masks.rows[2].input_ids)


def test_fallback_rows_are_counted_in_a_warning(make_tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = make_tokenizer("qwen3.jinja")
    rows = [
        {"task_id": "1", "messages": QWEN3_TWO_QUERIES, "tools": TOOLS, "reward": 1.0},
        {"task_id": "3", "messages": MULTI_CALL, "tools": TOOLS, "reward": 1.0},
    ]
    with caplog.at_level(logging.WARNING, logger="tau2_rl"):
        dataset, report = prepare_sft_dataset(rows_to_dataset(rows), tokenizer)
    assert report.per_turn_conversations == 2 and report.per_turn_rows == 3 + 4 == len(dataset)
    assert "2 conversations were split into 7 per-turn rows" in caplog.text


def test_turn_that_cannot_be_masked_is_an_error(make_tokenizer) -> None:
    tokenizer = make_tokenizer("qwen2_5.jinja")
    # The generation prompt opens a <think> block that the rendered assistant turn does not have.
    tokenizer.chat_template = template("qwen2_5.jinja").replace(
        "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    )
    with pytest.raises(TemplateNotPrefixPreserving, match="assistant message 2"):
        assistant_mask_rows(tokenizer, MULTI_CALL, TOOLS)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(UnmaskableTurn, match="no end-of-turn token"):
        assistant_mask_rows(tokenizer, PLAIN, None)


# ---------------------------------------------------------------------------------------------- shared with RL


def test_sft_row_equals_the_rl_rollout_of_the_same_episode(make_tokenizer) -> None:
    """The oracle's episode, replayed by ``TokenPolicyAgent`` sampling exactly the SFT row's assistant tokens, gives
    the same token ids and the same mask: SFT and RL see one tokenisation of the conversation."""
    tokenizer = make_tokenizer("qwen2_5.jinja")
    env = DomainEnv(AIRLINE)
    (record,) = run_episodes(
        env, get_agent("oracle"), get_user_simulator("scripted"), [("1", 0)], score=outcome_reward
    )
    assert record.reward["reward"] == 1.0
    row = assistant_mask_rows(tokenizer, record.messages, env.tools).rows[0]
    spans = iter(runs(row.assistant_masks))

    class Replay:
        def generate(self, prompts, max_new_tokens):
            return [row.input_ids[slice(*next(spans))] for _ in prompts], None

    episode = env.reset("1", 0)
    agent = TokenPolicyAgent(Replay(), tokenizer, [tokenizer.eos_token_id], 10**6, 10**6)
    run_episodes(env, agent, get_user_simulator("scripted"), [("1", 0)], episodes=[episode], score=outcome_reward)
    assert episode.record.messages == record.messages and episode.record.reward["reward"] == 1.0
    tensors = episode_tensors(episode)
    assert tensors["prompt_ids"] + tensors["completion_ids"] == row.input_ids
    assert [0] * len(tensors["prompt_ids"]) + tensors["tool_mask"] == row.assistant_masks
    # The pieces are the rollout's: prompt_text, then environment_suffix between assistant turns.
    assert tokenizer.decode(row.input_ids).startswith(prompt_text(tokenizer, record.messages[:2], env.tools))
    suffix = environment_suffix(tokenizer, record.messages[:4], record.messages[:5], env.tools)
    assert suffix in tokenizer.decode(row.input_ids)
