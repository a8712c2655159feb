"""Token-in/token-out rollouts (``tau2_rl.rollout.TokenPolicyAgent`` through ``run_episodes``), no model needed.

A fake ``GenerationBackend`` "samples" exactly the tokens the chat template renders for scripted assistant messages
(Hermes ``<tool_call>`` blocks as qwen2_5.jinja renders ``tool_calls``, closed by ``<|im_end|>``). Then the token
view of every episode must be the tokenisation of the template applied to its messages, and the mask must be 1 on
the sampled tokens and nowhere else. The last tests compare ``TransformersBackend`` with and without prefix reuse.
"""

from __future__ import annotations

import random

import pytest
import torch

from tau2_rl.backends import TransformersBackend
from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import TOKEN_BUDGET, DomainEnv, EnvConfig
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.render import render
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.rollout import TokenPolicyAgent, episode_tensors

AIRLINE = get_domain("airline")

pytestmark = pytest.mark.usefixtures("single_thread")

TASKS = ["0", "1", "5"]  # three different tasks in one wave: different users, tool results and lengths

SCRIPT = [  # the same four assistant turns for every episode
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_user_details", "arguments": {"user_id": "x"}}}],
    },
    {
        "role": "assistant",
        "content": "Let me look up that reservation.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_reservation_details",
                                              "arguments": {"reservation_id": "EHGLP3"}}},
            {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "2 + 3"}}},
        ],
    },
    {"role": "assistant", "content": "Could you tell me your user id, please?"},
    {"role": "assistant", "content": "Done. Is there anything else I can help you with?"},
]  # fmt: skip


def sampled_ids(tokenizer, message: dict) -> list[int]:
    """The ids a policy samples for ``message``: its template rendering after ``<|im_start|>assistant\\n``."""
    context = [{"role": "user", "content": "hi"}]
    head = render(tokenizer, context, None, generation_prompt=True)
    full = render(tokenizer, [*context, message], None, generation_prompt=False)
    assert full.startswith(head) and full.endswith("<|im_end|>\n")
    return tokenizer(full[len(head) : -1], add_special_tokens=False)["input_ids"]


class ScriptedBackend:
    """Returns, per prompt, the rendered tokens of ``SCRIPT[turn]`` (turn: counted from the prompt's role headers)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.calls: list[tuple[int, int]] = []  # (batch size, max_new_tokens)

    def _turn(self, prompt: list[int]) -> int:
        h = len(self.header)
        return sum(prompt[i : i + h] == self.header for i in range(len(prompt) - h + 1)) - 2  # greeting, this turn

    def generate(self, prompts, max_new_tokens):
        self.calls.append((len(prompts), max_new_tokens))
        return [sampled_ids(self.tokenizer, SCRIPT[self._turn(p)]) for p in prompts], None


class RecordingBackend:
    """Wraps a backend and remembers what it returned for each prompt (keyed by the prompt's length and content)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.returned: dict[tuple[int, ...], list[int]] = {}
        self.max_new_tokens: list[int] = []

    def generate(self, prompts, max_new_tokens):
        ids, logprobs = self.inner.generate(prompts, max_new_tokens)
        self.max_new_tokens.append(max_new_tokens)
        for prompt, sample in zip(prompts, ids, strict=True):
            self.returned[tuple(prompt)] = list(sample)
        return ids, logprobs


def play(env, tokenizer, backend, task_ids, *, max_completion=100_000, max_turn_tokens=512, max_context=10**9):
    agent = TokenPolicyAgent(
        backend, tokenizer, [tokenizer.eos_token_id], max_completion, max_turn_tokens, max_context
    )
    specs = [(t, i) for i, t in enumerate(task_ids)]
    episodes = [env.reset(t, s) for t, s in specs]
    records = run_episodes(env, agent, get_user_simulator("scripted"), specs, episodes=episodes, score=outcome_reward)
    return episodes, records


def test_completion_is_the_template_of_the_episode_and_mask_marks_sampled_tokens(airline_env, tiny_tokenizer):
    tok = tiny_tokenizer
    backend = RecordingBackend(ScriptedBackend(tok))
    episodes, records = play(airline_env, tok, backend, TASKS)
    assert backend.inner.calls[0] == (len(TASKS), 512)  # one batched call per wave
    for episode, record in zip(episodes, records, strict=True):
        tensors = episode_tensors(episode)
        prompt, completion, mask = tensors["prompt_ids"], tensors["completion_ids"], tensors["tool_mask"]
        assert len(completion) == len(mask) == len(tensors["logprobs"])
        roles = [m["role"] for m in episode.messages]
        assert roles.count("assistant") >= 3, (record.termination, roles)  # greeting + at least two policy turns
        last = max(i for i, r in enumerate(roles) if r == "assistant")
        text = render(tok, episode.messages[: last + 1], airline_env.tools, generation_prompt=False)
        text = text[: text.rindex("<|im_end|>") + len("<|im_end|>")]  # the runner stops after the last policy turn
        assert prompt + completion == tok(text, add_special_tokens=False)["input_ids"]
        # The prompt: system prompt + greeting, cut right after the greeting's <|im_end|> (same for every episode).
        assert tok.decode(prompt).endswith("Hi! How can I help you today?<|im_end|>")
        # The mask is 1 exactly on the tokens the backend returned, at the spans the agent recorded.
        spans = tensors["spans"]
        assert len(spans) == len(record.turns)
        expected_mask = [0] * len(completion)
        for start, end in spans:
            sampled = backend.returned[tuple(prompt + completion[:start])]
            assert completion[start:end] == sampled
            assert sampled[-1] == tok.eos_token_id
            expected_mask[start:end] = [1] * (end - start)
        assert mask == expected_mask
        # Environment tokens (user turns, tool results, role headers) carry mask 0 and decode to the messages.
        env_text = tok.decode([t for t, m in zip(completion, mask, strict=True) if m == 0])
        for message in episode.messages[2:last]:
            if message["role"] in ("user", "tool"):
                assert message["content"] in env_text
    # The tool calls really ran, from the sampled text.
    assert all(r.num_tool_calls >= 1 for r in records)
    assert {c.name for r in records for c in r.tool_calls} >= {"get_user_details", "get_reservation_details"}


class EndlessBackend:
    """Never emits EOS: always exactly ``max_new_tokens`` ordinary tokens."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.requests: list[int] = []

    def generate(self, prompts, max_new_tokens):
        self.requests.append(max_new_tokens)
        return [[self.token] * max_new_tokens for _ in prompts], None


def test_a_turn_without_eos_ends_the_episode_as_token_budget(airline_env, tiny_tokenizer):
    tok = tiny_tokenizer
    backend = EndlessBackend(tok.convert_tokens_to_ids("a"))
    episodes, records = play(airline_env, tok, backend, TASKS, max_turn_tokens=7)
    for episode, record in zip(episodes, records, strict=True):
        assert record.termination == TOKEN_BUDGET and record.truncated
        assert len(record.turns) == 1 and record.turns[0].truncated
        assert sum(episode.agent_state["tool_mask"]) == 7
    assert backend.requests == [7]


class LongTurnBackend:
    """Well-formed but long turns (EOS as the last of ``max_new_tokens``), optionally returning more than asked."""

    def __init__(self, tokenizer, overshoot: int = 0) -> None:
        self.word = tokenizer.convert_tokens_to_ids("a")
        self.eos = tokenizer.eos_token_id
        self.overshoot = overshoot
        self.requests: list[int] = []

    def generate(self, prompts, max_new_tokens):
        self.requests.append(max_new_tokens)
        n = max_new_tokens + self.overshoot
        return [[self.word] * (n - 1) + [self.eos] for _ in prompts], None


@pytest.mark.parametrize("overshoot", [0, 5])
def test_max_completion_length_caps_the_whole_episode(airline_env, tiny_tokenizer, overshoot):
    tok = tiny_tokenizer
    max_completion, max_turn = 150, 40
    backend = LongTurnBackend(tok, overshoot)
    episodes, records = play(airline_env, tok, backend, TASKS, max_completion=max_completion, max_turn_tokens=max_turn)
    assert all(0 < n <= max_turn for n in backend.requests)
    for episode, record in zip(episodes, records, strict=True):
        state = episode.agent_state
        assert len(state["completion_ids"]) <= max_completion
        assert record.termination == TOKEN_BUDGET
        for start, end in state["spans"]:
            assert 0 < end - start <= max_turn
        assert sum(state["tool_mask"]) == sum(end - start for start, end in state["spans"])


def test_context_window_caps_prompt_plus_completion(airline_env, tiny_tokenizer):
    tok = tiny_tokenizer
    prompt_len = len(TokenPolicyAgent(None, tok, [tok.eos_token_id], 1, 1)._prompt(
        airline_env.reset("0").messages[:2], airline_env.tools))  # fmt: skip
    max_context = prompt_len + 120
    episodes, _ = play(airline_env, tok, LongTurnBackend(tok), TASKS, max_turn_tokens=40, max_context=max_context)
    for episode in episodes:
        assert len(episode.agent_state["prompt_ids"]) + len(episode.agent_state["completion_ids"]) <= max_context


class RandomBackend:
    """Arbitrary ids, half of them from the tokens that matter for parsing (tool-call tags, JSON pieces, role and
    end-of-turn tokens), the rest from the whole vocabulary; most turns end with EOS."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = len(tokenizer)
        self.eos = tokenizer.eos_token_id
        pieces = '<tool_call>\n{"name": "get_user_details", "arguments": {"user_id": "x"}}\n</tool_call><|im_start|>'
        self.interesting = tokenizer(pieces + "<|endoftext|>###STOP###", add_special_tokens=False)["input_ids"]

    def generate(self, prompts, max_new_tokens):
        out = []
        for _ in prompts:
            n = self.rng.randint(0, max_new_tokens)
            ids = [
                self.rng.choice(self.interesting) if self.rng.random() < 0.5 else self.rng.randrange(self.vocab_size)
                for _ in range(n)
            ]
            if self.rng.random() < 0.7:
                ids.append(self.eos)
            out.append(ids[:max_new_tokens])
        return out, None


def test_malformed_model_turns_never_crash(tiny_tokenizer):
    tok = tiny_tokenizer
    env = DomainEnv(AIRLINE, config=EnvConfig(max_turns=6))
    kinds = set()
    for seed in range(4):
        backend = RandomBackend(tok, seed)
        episodes, records = play(
            env, tok, backend, [str(t) for t in range(8)], max_completion=2000, max_turn_tokens=24
        )
        kinds |= {call.error_kind for record in records for call in record.tool_calls}
        for episode, record in zip(episodes, records, strict=True):
            state = episode.agent_state
            assert record.termination is not None and record.reward is not None
            assert len(state["completion_ids"]) == len(state["tool_mask"]) <= 2000
            assert sum(state["tool_mask"]) == sum(e - s for s, e in state["spans"])
    assert "parse" in kinds  # broken tool-call blocks were sampled and became error observations


def test_idle_waves_still_call_the_backend(airline_env, tiny_tokenizer):
    """A distributed backend must join every wave's collective, even when none of its episodes can sample."""
    tok = tiny_tokenizer
    backend = EndlessBackend(tok.convert_tokens_to_ids("a"))
    agent = TokenPolicyAgent(backend, tok, [tok.eos_token_id], 1, 8)
    episode = airline_env.reset("0")
    episode.user_response("hello")
    agent.start(episode)
    turns = agent.act([episode])  # the user's message alone exceeds a 1-token completion budget
    assert turns[0].truncated and turns[0].num_tokens == 0
    assert backend.requests == [1]
    assert episode.agent_state["completion_ids"] == []  # an environment suffix that does not fit is not appended


# ---------------------------------------------------------------------------------------------------------------------
# TransformersBackend: batching and prefix reuse must not change what greedy decoding produces


def _greedy(model, tokenizer, prompts, max_new_tokens, **kwargs):
    backend = TransformersBackend(model, tokenizer, temperature=0.0, eos_token_ids=[tokenizer.eos_token_id], **kwargs)
    return backend, backend.generate(prompts, max_new_tokens)[0]


def test_prefix_reuse_matches_plain_greedy_decoding(tiny_model, tiny_tokenizer, airline_env):
    tok = tiny_tokenizer
    agent = TokenPolicyAgent(None, tok, [tok.eos_token_id], 1, 1)
    prefix = agent._prompt(airline_env.reset("0").messages[:2], airline_env.tools)[:300]  # a shared prefix, shortened
    rng = random.Random(0)
    prompts = [prefix + [rng.randrange(1000) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    new = 8
    singles = [_greedy(tiny_model, tok, [p], new, prefix_cache=False)[1][0] for p in prompts]
    _, batched = _greedy(tiny_model, tok, prompts, new, prefix_cache=False)
    backend, cached = _greedy(tiny_model, tok, prompts, new, prefix_cache=True, min_prefix_tokens=16)
    assert backend.prefix_stats["built"] == 1 and backend.prefix_stats["prefix_tokens"] >= len(prefix)
    assert batched == singles
    assert cached == singles
    # The cached prefix is reused by a later call whose prompts extend it (the next wave) and by a single prompt.
    later = [p + s for p, s in zip(prompts, cached, strict=True)]
    again = backend.generate(later, new)[0]
    one = backend.generate(later[:1], new)[0]
    assert backend.prefix_stats["built"] == 1 and backend.prefix_stats["reused"] == 2
    assert again == [_greedy(tiny_model, tok, [p], new, prefix_cache=False)[1][0] for p in later]
    assert one == again[:1]
    # Changing the weights (an optimiser step between calls) invalidates the cached prefix.
    with torch.no_grad():
        tiny_model.model.embed_tokens.weight.mul_(2.0)
    after = backend.generate(prompts, new)[0]
    assert backend.prefix_stats["built"] == 2
    assert after == [_greedy(tiny_model, tok, [p], new, prefix_cache=False)[1][0] for p in prompts]


def test_prefix_reuse_logits_match(tiny_model, tiny_tokenizer):
    """Next-token logits through the cached prefix equal a plain forward (middle padding + position ids)."""
    tok = tiny_tokenizer
    rng = random.Random(1)
    prefix = [rng.randrange(1000) for _ in range(64)]
    prompts = [prefix + [rng.randrange(1000) for _ in range(n)] for n in (1, 9, 30)]
    backend = TransformersBackend(tiny_model, tok, temperature=0.0, prefix_cache=True, min_prefix_tokens=16)
    cached = backend.next_token_logits(prompts)
    with torch.no_grad():
        plain = torch.stack([tiny_model(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(cached, plain, atol=1e-4, rtol=1e-4)


def test_sampling_is_reproducible_with_a_seed(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11] * 12]
    a = TransformersBackend(tiny_model, tok, seed=3).generate(prompts, 6)[0]
    b = TransformersBackend(tiny_model, tok, seed=3).generate(prompts, 6)[0]
    assert a == b


def test_waves_are_batched(airline_env, tiny_tokenizer):
    tok = tiny_tokenizer
    backend = ScriptedBackend(tok)
    play(airline_env, tok, backend, TASKS * 2)
    assert backend.calls[0][0] == 2 * len(TASKS)
    assert len(backend.calls) == len(SCRIPT)  # one call per wave, never one per episode


def test_a_budget_spent_before_the_policy_samples_is_the_episodes_truncation_not_a_turn(airline_env, tiny_tokenizer):
    """Complete 40-token turns until the 150-token episode budget runs out: an episode whose budget is gone before
    its next turn ends as token_budget without a 0-token turn (turns = policy spans, all with sampled tokens)."""
    tok = tiny_tokenizer
    backend = LongTurnBackend(tok)
    episodes, records = play(airline_env, tok, backend, TASKS, max_completion=150, max_turn_tokens=40)
    cut_between_turns = 0
    for episode, record in zip(episodes, records, strict=True):
        spans = episode.agent_state["spans"]
        assert record.termination == TOKEN_BUDGET
        assert len(record.turns) == len(spans) and all(t.num_policy_tokens for t in record.turns)
        assert [t.num_policy_tokens for t in record.turns] == [end - start for start, end in spans]
        cut_between_turns += not record.turns[-1].truncated  # the last turn ended with EOS: the cut came after it
        assert record.messages[-1]["role"] != "assistant" or record.messages[-1]["content"]
    assert cut_between_turns > 0  # the case under test occurred


def test_a_zero_token_turn_ends_the_episode_without_a_turn(airline_env):
    episode = airline_env.reset("0", 0)
    episode.user_response("Hi, I need help.")
    before = list(episode.messages)
    assert episode.env_response("", num_policy_tokens=0, truncated=True) == []
    assert episode.record.termination == TOKEN_BUDGET and episode.record.turns == []
    assert episode.messages == before


# ---------------------------------------------------------------------------------------------------------------------
# Turn caching (SharedPrefixTransformersBackend): each episode's KV kept between waves must not change any token


def _waves(backend, prompts, rng, waves: int, new: int, seeds=None) -> list[list[list[int]]]:
    """``waves`` calls like a rollout's: each prompt grows by its sampled ids and a few "environment" tokens; the
    second row finishes after wave 5 (it leaves the batch) and every row's environment suffix has its own length."""
    out = []
    prompts = [list(p) for p in prompts]
    for wave in range(waves):
        live = [i for i in range(len(prompts)) if not (i == 1 and wave > 5)]
        ids, _ = backend.generate([prompts[i] for i in live], new, **({"seeds": [seeds[i] + wave for i in live]}
                                                                      if seeds else {}))  # fmt: skip
        out.append(ids)
        for i, sampled in zip(live, ids, strict=True):
            prompts[i] += sampled + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "per-row-seeds"])
def test_turn_caching_equals_re_prefill_over_16_waves(tiny_model, tiny_tokenizer, airline_env, temperature):
    """16 waves through the turn cache == the same backend re-prefilling every history == plain ``generate`` one
    prompt at a time (greedy), token for token; sampling with per-row seeds draws the same tokens too."""
    from tau2_rl.backends.shared_prefix import SharedPrefixTransformersBackend

    tok = tiny_tokenizer
    agent = TokenPolicyAgent(None, tok, [tok.eos_token_id], 1, 1)
    prefix = agent._prompt(airline_env.reset("0").messages[:2], airline_env.tools)[:300]  # a shared prefix, shortened
    starts = [prefix + [random.Random(i).randrange(1000) for _ in range(20 + 7 * i)] for i in range(3)]
    options = {"temperature": temperature, "eos_token_ids": [tok.eos_token_id], "min_prefix_tokens": 16}
    seeds = [11, 22, 33] if temperature else None
    results = {}
    for name, tokens in (("cached", 1 << 20), ("re-prefill", 0)):
        backend = SharedPrefixTransformersBackend(tiny_model, tok, turn_cache_tokens=tokens, **options)
        results[name] = _waves(backend, starts, random.Random(5), waves=16, new=6, seeds=seeds)
        if tokens:
            stats = backend.turn_cache_stats
            # from the second wave on, each live row reuses its history: far more reused than prefilled tokens
            assert stats["reused_tokens"] > 3 * stats["prefilled_tokens"] and stats["dropped"] == 0
            assert stats["diverged"] == 0 and backend.enabled
        backend.close()
    assert results["cached"] == results["re-prefill"]
    assert all(len(ids) > 0 for wave in results["cached"] for ids in wave)
    if not temperature:  # the plain reference: each wave's prompts one at a time through plain generate
        plain = TransformersBackend(tiny_model, tok, prefix_cache=False, **options)
        one_at_a_time = _OneAtATime(plain)
        assert _waves(one_at_a_time, starts, random.Random(5), waves=16, new=6) == results["cached"]


class _OneAtATime:
    def __init__(self, inner) -> None:
        self.inner = inner

    def generate(self, prompts, max_new_tokens):
        return [self.inner.generate([p], max_new_tokens)[0][0] for p in prompts], None


def test_turn_cache_cap_drops_the_oldest_and_transcripts_stay_equal(tiny_model, tiny_tokenizer, airline_env):
    """A cap below one wave's cached tokens: the oldest episodes are dropped and re-prefilled, nothing changes."""
    from tau2_rl.backends.shared_prefix import SharedPrefixTransformersBackend

    tok = tiny_tokenizer
    agent = TokenPolicyAgent(None, tok, [tok.eos_token_id], 1, 1)
    prefix = agent._prompt(airline_env.reset("0").messages[:2], airline_env.tools)[:300]
    starts = [prefix + [random.Random(i).randrange(1000) for _ in range(20 + 7 * i)] for i in range(3)]
    options = {"temperature": 0.0, "eos_token_ids": [tok.eos_token_id], "min_prefix_tokens": 16}
    capped = SharedPrefixTransformersBackend(tiny_model, tok, turn_cache_tokens=150, **options)  # ~2 rows' worth
    free = SharedPrefixTransformersBackend(tiny_model, tok, turn_cache_tokens=0, **options)
    got = _waves(capped, starts, random.Random(5), waves=8, new=6)
    assert got == _waves(free, starts, random.Random(5), waves=8, new=6)
    stats = capped.turn_cache_stats
    assert stats["dropped"] > 0 and stats["peak_tokens"] <= 150 and stats["reused_tokens"] > 0
