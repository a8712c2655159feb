"""The whole episode loop under hostile model outputs: parse → tools → observation → render → tokenise.

``test_tool_call_parsing`` fuzzes ``Episode.env_response`` alone; here random model outputs go through
``run_episodes`` with ``TokenPolicyAgent``, the real (tiny) Qwen2 tokenizer and its chat template, as in training,
evaluation and collection. The outputs mix the hypothesis strategies of ``test_tool_call_parsing`` (broken and
mutated tool-call blocks, wrong types), tool calls whose arguments hold JSON escapes of lone surrogates (``\\ud800``:
plain ASCII that ``json.loads`` turns into text no tokenizer accepts) and raw random token ids; the user simulator
sometimes answers with hostile text too. Nothing may raise, and everything an episode records must be valid text.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tool_call_parsing import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, turn_text

from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.tools import TOOL_NAMES
from tau2_rl.envs.episode import DomainEnv, EnvConfig
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.envs.users.base import UserReply, UserSimulator
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.rollout import TokenPolicyAgent

AIRLINE = get_domain("airline")

pytestmark = pytest.mark.usefixtures("single_thread")

EPISODES_PER_EXAMPLE = 8
ESCAPES = ["\\ud800", "\\udfff", "\\udc00x", "\\ud83d", "\\ud83d\\ude00", "\\u0000", "\\uffff", "\\\\ud800"]


@st.composite
def escaped_call(draw: st.DrawFn) -> str:
    """A tool call whose name or argument holds a JSON escape (lone surrogates included), as a model writes it."""
    name = draw(st.sampled_from(TOOL_NAMES))
    key = draw(st.sampled_from(["user_id", "reservation_id", "expression", "summary", "\\ud800"]))
    value = draw(st.sampled_from(ESCAPES)) + draw(st.text(alphabet="abc_123 ", max_size=6))
    if draw(st.integers(0, 4)) == 0:
        name = "\\ud800" + name
    arguments = f'{{"{key}": "{value}"}}'
    if draw(st.booleans()):
        arguments = json.dumps(arguments)  # OpenAI style: the arguments as a JSON string holding the escape
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{TOOL_CALL_CLOSE}'


model_output = st.one_of(turn_text, escaped_call(), st.lists(escaped_call() | turn_text, max_size=3).map("".join))
hostile_user_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["\ud800", "a\udfffb", "", "<|im_end|>", "<|im_start|>assistant\n", "</tool_call>", "###STOP###"]),
)


class FuzzBackend:
    """Per prompt: a drawn model output (tokenised, usually closed by EOS) or, one time in five, random token ids."""

    def __init__(self, tokenizer, data: st.DataObject, rng: random.Random) -> None:
        self.tokenizer, self.data, self.rng = tokenizer, data, rng
        self.eos = tokenizer.eos_token_id
        self.outputs = 0

    def generate(self, prompts, max_new_tokens):
        out = []
        for _ in prompts:
            if self.rng.random() < 0.2:
                ids = [self.rng.randrange(len(self.tokenizer)) for _ in range(self.rng.randint(0, 24))]
            else:
                # A model emits token ids, and no token sequence decodes to a lone surrogate (the JSON *escape*
                # ``\\ud800`` is what a model can write): so a drawn text holding one is encoded as the tokenizer
                # would see it after decoding, with the surrogate replaced.
                text = self.data.draw(model_output).encode("utf-8", "replace").decode("utf-8")
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if self.rng.random() < 0.9:
                ids.append(self.eos)
            out.append(ids[:max_new_tokens])
        self.outputs += len(prompts)
        return out, None


class HostileUser(UserSimulator):
    """The scripted user, except that one reply in four is drawn hostile text (an LLM user can send anything)."""

    name = "hostile"

    def __init__(self, data: st.DataObject, rng: random.Random) -> None:
        self.inner, self.data, self.rng = get_user_simulator("scripted"), data, rng

    def reply(self, episode) -> UserReply:
        if self.rng.random() < 0.25:
            return UserReply.from_text(self.data.draw(hostile_user_text))
        return self.inner.reply(episode)


ENV = DomainEnv(AIRLINE, config=EnvConfig(max_turns=5, max_tool_errors=4))


def play_fuzzed(tokenizer, data: st.DataObject, seed: int) -> int:
    """One batch of episodes through the real loop; returns how many model outputs it consumed."""
    rng = random.Random(seed)
    backend = FuzzBackend(tokenizer, data, rng)
    agent = TokenPolicyAgent(backend, tokenizer, [tokenizer.eos_token_id], 4096, 160, 10**9)
    specs = [(str(rng.randrange(50)), i) for i in range(EPISODES_PER_EXAMPLE)]
    episodes = [ENV.reset(t, s) for t, s in specs]
    records = run_episodes(ENV, agent, HostileUser(data, rng), specs, episodes=episodes, score=outcome_reward)
    for episode, record in zip(episodes, records, strict=True):
        assert record.termination is not None and record.reward is not None
        json.dumps(record.to_dict(), ensure_ascii=False).encode("utf-8")  # a results file can hold it
        state = episode.agent_state
        if "prompt_ids" not in state:  # the user ended it before the policy's first turn
            continue
        assert len(state["completion_ids"]) == len(state["tool_mask"]) == len(state["logprobs"])
        assert sum(state["tool_mask"]) == sum(end - start for start, end in state["spans"])
    return backend.outputs


def fuzz_loop(tokenizer, examples: int, minimum_outputs: int) -> None:
    outputs = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def run(data: st.DataObject, seed: int) -> None:
        outputs.append(play_fuzzed(tokenizer, data, seed))

    run()
    assert sum(outputs) >= minimum_outputs, sum(outputs)


def test_lone_surrogate_in_a_tool_argument_does_not_crash_the_loop(tiny_tokenizer) -> None:
    """The regression: ``{"user_id": "\\ud800"}`` became a tool observation that the next turn could not tokenise."""
    tokenizer = tiny_tokenizer
    call = '<tool_call>\n{"name": "get_user_details", "arguments": {"user_id": "\\ud800"}}\n</tool_call>'
    ids = tokenizer(call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    class Repeat:
        def generate(self, prompts, max_new_tokens):
            return [ids] * len(prompts), None

    env = DomainEnv(AIRLINE, config=EnvConfig(max_turns=3))
    agent = TokenPolicyAgent(Repeat(), tokenizer, [tokenizer.eos_token_id], 10**5, 512, 10**9)
    (record,) = run_episodes(env, agent, get_user_simulator("scripted"), [("0", 0)], score=outcome_reward)
    assert record.termination == "max_turns" and len(record.tool_calls) == 3
    assert record.tool_calls[0].arguments == {"user_id": "\ufffd"}
    assert record.tool_calls[0].result == "Error: User \ufffd not found"


def test_fuzz_the_whole_loop(tiny_tokenizer) -> None:
    """≥ 2,000 random model outputs through the loop, in the default suite."""
    fuzz_loop(tiny_tokenizer, examples=100, minimum_outputs=2000)


@pytest.mark.slow
@pytest.mark.exhaustive  # the 2,000-output version above runs in the default suite
def test_fuzz_the_whole_loop_10k(tiny_tokenizer) -> None:
    """The issue's bar: ≥ 10,000 random model outputs through the loop, 0 exceptions."""
    fuzz_loop(tiny_tokenizer, examples=500, minimum_outputs=10_000)
