"""The token-level policy agent shared by the trainer, the evaluator and the trajectory collector.

``TokenPolicyAgent`` plays the policy side of a batch of episodes through any ``GenerationBackend`` (TRL's own
single-turn generation inside the trainer; a transformers model or a vLLM engine in the evaluator), token-in /
token-out:

1. the prompt is the chat template applied to the system prompt, the episode's tool schemas (``episode.tools``: its
   domain's) and the fixed greeting, cut after the greeting's end-of-turn token (identical for every episode of a
   domain, so prefix caches and TRL's grouping work);
2. before each policy turn, the tokens of the messages the environment added since the last turn (user reply, tool
   results) are appended with mask 0: the Render-Twice-Diff suffix of ``tau2_rl.render``;
3. the sampled ids are appended with mask 1 exactly as sampled; their decoded text is only used to run the tools.

The ready episodes of ``run_episodes`` are generated in one backend call (all active ones under lock-step waves).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from tau2_rl.envs.episode import Episode
from tau2_rl.envs.protocol import agent_view
from tau2_rl.envs.runner import AgentTurn
from tau2_rl.render import environment_suffix_ids, prompt_text
from tau2_rl.sampling import turn_seed


class GenerationBackend(Protocol):
    """Samples continuations for a batch of token-id prompts (one call per wave)."""

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Sampled ids per prompt (ending with an end-of-turn id unless cut) and their log-probs if known.

        ``prompts`` may be empty (an idle wave); a backend then returns ``([], None)``.
        """
        ...


class TokenPolicyAgent:
    """The ``Agent`` of ``run_episodes`` for a language-model policy.

    Per-episode token state lives in ``episode.agent_state``: ``prompt_ids``, ``completion_ids``, ``tool_mask``
    (1 = sampled by the policy), ``logprobs``, ``spans`` (completion (start, end) of every policy turn) and ``seen``
    (how many messages are already tokenised).
    """

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Any,
        eos_token_ids: list[int] | set[int],
        max_completion_length: int,
        max_turn_tokens: int,
        max_context: int = 10**9,
        per_episode_seeds: bool = False,
    ) -> None:
        """``per_episode_seeds``: turn t of an episode samples with ``turn_seed(episode.seed, t)`` (the evaluator:
        its episodes must not depend on the batch they run in; the backend's ``generate`` takes ``seeds``)."""
        self.backend = backend
        self.per_episode_seeds = per_episode_seeds
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_token_ids)
        self.max_completion = max_completion_length
        self.max_turn_tokens = max_turn_tokens
        self.max_context = max_context
        self._prompt_cache: dict[tuple[str, tuple[str, ...]], list[int]] = {}
        self.partial_calls = False

    @property
    def schedule_invariant(self) -> bool:
        """An episode's turns do not depend on which episodes share its generation call (per-episode seeds)."""
        return self.per_episode_seeds

    schedule_reason = "the policy samples from one generator per generation call"

    def on_schedule(self, partial_calls: bool) -> None:
        """Told by ``run_episodes``: whether a call may carry only some of the live episodes (event-driven, with a
        user that answers later). Then the backend caches exactly the system prompt and greeting as the shared prefix
        (``prefix_hint``), which every episode extends: the common part of a first call's one or two episodes would
        reach into their own turns and be rebuilt (and the turn caches dropped) at the next call."""
        self.partial_calls = partial_calls

    def release(self, episodes: list[Episode]) -> None:
        """Finished episodes: the backend frees what it keeps for them (their turn caches)."""
        release = getattr(self.backend, "release", None)
        if release is not None:
            release([ep.agent_state["prompt_ids"] + ep.agent_state["completion_ids"] for ep in episodes
                     if "prompt_ids" in ep.agent_state])  # fmt: skip

    def _prompt(self, prompt_messages: list[dict], tools: list[dict]) -> list[int]:
        """Token ids of the system prompt + greeting with the episode's tool schemas (cached: identical for every
        episode of a domain with that system prompt)."""
        key = (json.dumps(prompt_messages, sort_keys=True), tuple(tool["function"]["name"] for tool in tools))
        if key not in self._prompt_cache:
            text = prompt_text(self.tokenizer, prompt_messages, tools)
            self._prompt_cache[key] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._prompt_cache[key]

    def start(self, episode: Episode) -> None:
        prefix = getattr(episode, "prefix_length", 2)  # system prompt + fixed greeting (or the task's history)
        prompt_ids = self._prompt(episode.messages[:prefix], episode.tools)
        episode.agent_state.update(
            prompt_ids=prompt_ids, completion_ids=[], tool_mask=[], logprobs=[], spans=[], seen=prefix
        )

    def _environment_ids(self, episode: Episode) -> list[int]:
        """Tokens of the messages the environment added since the episode's last policy turn (mask 0)."""
        state = episode.agent_state
        before = agent_view(episode.messages[: state["seen"]])  # the user's own tool calls are not the agent's
        return environment_suffix_ids(self.tokenizer, before, agent_view(episode.messages), episode.tools)

    def _append_environment(self, episode: Episode, suffix: list[int]) -> None:
        state = episode.agent_state
        state["completion_ids"].extend(suffix)
        state["tool_mask"].extend([0] * len(suffix))
        state["logprobs"].extend([0.0] * len(suffix))
        state["seen"] = len(episode.messages)

    def _budget(self, episode: Episode, extra: int = 0) -> int:
        state = episode.agent_state
        used = len(state["completion_ids"]) + extra
        context_left = self.max_context - len(state["prompt_ids"]) - used
        return min(self.max_turn_tokens, self.max_completion - used, context_left)

    def budgets(self, episodes: list[Episode]) -> list[int]:
        """Tokens each episode may sample this turn (≤ 0: its budget is spent, the episode ends truncated)."""
        return [self._budget(episode) for episode in episodes]

    def act(self, episodes: list[Episode]) -> list[AgentTurn]:
        budgets = []
        for episode in episodes:
            if "prompt_ids" not in episode.agent_state:
                self.start(episode)
            suffix = self._environment_ids(episode)
            budget = self._budget(episode, extra=len(suffix))
            if budget > 0:  # an environment suffix with no room left to answer it is dropped: caps stay caps
                self._append_environment(episode, suffix)
            budgets.append(budget)
        turns: list[AgentTurn] = [AgentTurn(text="", num_tokens=0, truncated=True) for _ in episodes]
        runnable = [i for i, budget in enumerate(budgets) if budget > 0]
        sampled, logprobs = self._generate([episodes[i] for i in runnable], [budgets[i] for i in runnable])
        for j, i in enumerate(runnable):
            ids = list(sampled[j])[: budgets[i]]
            lps = list(logprobs[j])[: len(ids)] if logprobs is not None else [0.0] * len(ids)
            state = episodes[i].agent_state
            start = len(state["completion_ids"])
            state["completion_ids"].extend(ids)
            state["tool_mask"].extend([1] * len(ids))
            state["logprobs"].extend(lps)
            state["spans"].append((start, start + len(ids)))
            truncated = not ids or ids[-1] not in self.eos_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            turns[i] = AgentTurn(text=text, num_tokens=len(ids), truncated=truncated)
        for episode in episodes:  # env_response appends the assistant message next: count it as seen
            episode.agent_state["seen"] = len(episode.messages) + 1
        return turns

    def _generate(
        self, episodes: list[Episode], budgets: list[int]
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        # Called every wave, even with nothing to generate: a distributed backend must join every wave's collective.
        prompts = [ep.agent_state["prompt_ids"] + ep.agent_state["completion_ids"] for ep in episodes]
        if self.partial_calls and episodes and hasattr(self.backend, "prefix_hint"):
            self.backend.prefix_hint = episodes[0].agent_state["prompt_ids"]
        if self.per_episode_seeds:
            seeds = [turn_seed(ep.seed, len(ep.record.turns)) for ep in episodes]
            return self.backend.generate(prompts, max(budgets, default=1), seeds=seeds)  # type: ignore[call-arg]
        return self.backend.generate(prompts, max(budgets, default=1))


def policy_max_context(trainer: Any) -> int:
    """The ``max_context`` of a GRPO trainer's policy agent, in the trainer and in its rollout worker alike (both
    read it here): vLLM's ``vllm_max_model_length`` when vLLM generates, else the model's
    ``max_position_embeddings``."""
    if trainer.use_vllm and getattr(trainer.args, "vllm_max_model_length", None):
        return int(trainer.args.vllm_max_model_length)
    config = getattr(trainer.model, "config", None)
    return int(getattr(config, "max_position_embeddings", None) or 10**9)


def episode_tensors(episode: Episode) -> dict[str, list]:
    """The token view of a finished episode: prompt ids, completion ids, mask, log-probs, turn spans."""
    state = episode.agent_state
    return {key: state[key] for key in ("prompt_ids", "completion_ids", "tool_mask", "logprobs", "spans")}
