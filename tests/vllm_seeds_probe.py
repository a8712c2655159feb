"""The trainer's vLLM rollout path, played with the same episodes in one generation batch and in two halves.

    python tests/vllm_seeds_probe.py <model dir> <out.json>     # vLLM's CPU build (tests/test_vllm.py runs it)

Everything between the episode loop and the engine is the code a GPU run takes: ``run_episodes`` and the trainer's
``TokenPolicyAgent`` over ``TrainerBackend`` (which sets the per-request seeds), TRL's own
``GRPOTrainer._generate_single_turn`` and ``VLLMGeneration.generate`` (colocate mode), and a ``vllm.LLM`` wrapped by
``tau2_rl.backends.vllm_seeds``. Only the trainer object around them is a stand-in (no model to train: the
engine's weights are the checkpoint's). It writes each episode's completion token ids, per batch layout, and the
same episodes played batch-seeded (TRL's path without the wrapper) for comparison.

Then the event-driven loop on vLLM: the same episodes against the LLM user behind the stub server with seeded
log-normal reply delays, under ``Schedule(mode="waves")`` and the default event-driven schedule, through the
trainer's path and through the evaluator's ``VLLMBackend`` (ready micro-batches to ``LLM.generate``); per schedule
the completions, the messages and the number of policy calls.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402
from vllm import LLM  # noqa: E402

from tau2_rl.backends import VLLMBackend, vllm_seeds  # noqa: E402
from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.envs.episode import DomainEnv, EnvConfig  # noqa: E402
from tau2_rl.envs.runner import RunTimings, Schedule, run_episodes  # noqa: E402
from tau2_rl.envs.users.scripted import ScriptedUser  # noqa: E402
from tau2_rl.rewards.outcome import outcome_reward  # noqa: E402
from tau2_rl.rollout import TokenPolicyAgent  # noqa: E402
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer, TrainerBackend  # noqa: E402

AIRLINE = get_domain("airline")

EPISODES = 16
TASKS = ["0", "1", "3", "4"]
MAX_TURN_TOKENS, MAX_COMPLETION, MAX_LEN = 24, 2048, 12288


def stand_in_trainer(llm: LLM, tokenizer) -> SimpleNamespace:
    """What ``TrainerBackend`` and TRL's ``_generate_single_turn`` read of a GRPO trainer with vLLM colocated."""
    generation = VLLMGeneration.__new__(VLLMGeneration)  # TRL's colocate generate, around this process's engine
    generation.__dict__.update(
        mode="colocate", llm=llm, accelerator=SimpleNamespace(is_main_process=True), model=torch.nn.Module(),
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        max_completion_length=MAX_TURN_TOKENS, logprobs=0, generation_kwargs={}, structured_outputs_regex=None,
        tensor_parallel_size=1, enable_sleep_mode=False, _llm_weights_sleeping=False,
    )  # fmt: skip
    trainer = SimpleNamespace(
        use_vllm=True, vllm_generation=generation, processing_class=tokenizer, generation_config=None,
        accelerator=SimpleNamespace(num_processes=1, device="cpu", is_main_process=True),
        state=SimpleNamespace(global_step=0), _last_loaded_step=0, use_transformers_continuous_batching=False,
        args=SimpleNamespace(rollout_prefix_reuse=None, report_to=[]),
    )  # fmt: skip
    trainer._generate_single_turn = GRPOTrainer._generate_single_turn.__get__(trainer)
    trainer._max_new_tokens = MultiTurnGRPOTrainer._max_new_tokens.__get__(trainer)
    return trainer


def play(
    env: DomainEnv,
    trainer: SimpleNamespace,
    tokenizer,
    rows: range,
    seeded: bool,
    user=None,
    schedule: Schedule | None = None,
    backend=None,
    details: dict | None = None,
) -> dict[int, list[int]]:
    """Episodes ``rows`` (task, seed fixed per row) in one call of the episode loop; row → completion token ids."""
    if backend is None:
        backend = TrainerBackend(trainer)
        if not seeded:
            backend.seeded_llm = None  # TRL's own path: one generator for the batch
        seeded = backend.seeded_llm is not None
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    agent = TokenPolicyAgent(backend, tokenizer, eos, MAX_COMPLETION, MAX_TURN_TOKENS, MAX_LEN,
                             per_episode_seeds=seeded)  # fmt: skip
    specs = [(TASKS[row % len(TASKS)], 7_000 + row) for row in rows]
    episodes = [env.reset(task, seed) for task, seed in specs]
    for episode in episodes:
        agent.start(episode)
    timings = RunTimings()
    if user is not None:
        agent = WholeTurns(agent)
    run_episodes(env, agent, user or ScriptedUser(), specs, episodes=episodes, score=outcome_reward,
                 schedule=schedule, timings=timings)  # fmt: skip
    if details is not None:
        details.update(calls=timings.waves, messages=[ep.messages for ep in episodes])
    return {row: list(ep.agent_state["completion_ids"]) for row, ep in zip(rows, episodes, strict=True)}


class WholeTurns:
    """Takes every turn as finished: the random tiny model seldom samples its end-of-turn token within the budget,
    which would end each episode after one turn (``token_budget``); the schedules need several turns to differ."""

    def __init__(self, agent: TokenPolicyAgent) -> None:
        self.agent, self.release, self.on_schedule = agent, agent.release, agent.on_schedule

    def act(self, episodes):
        turns = self.agent.act(episodes)
        for turn in turns:
            turn.truncated = False
        return turns


def evaluator_backend(engine: vllm_seeds.SeededLLM) -> VLLMBackend:
    """The evaluator's ``VLLMBackend`` (per-request seeds, temperature 1) around this process's engine."""
    backend = VLLMBackend.__new__(VLLMBackend)
    backend.llm, backend.temperature, backend.top_p, backend.seed = engine, 1.0, 1.0, 0
    return backend


def schedules(env: DomainEnv, trainer: SimpleNamespace, engine, tokenizer) -> dict[str, dict]:
    """Waves vs events against the LLM user with reply delays, on the trainer's and the evaluator's vLLM paths."""
    from tau2_rl.envs.users.llm import LLMUser
    from tests.openai_stub_server import StubServer

    found: dict[str, dict] = {}
    with StubServer("echo", latency=(0.2, 1.0)) as stub:
        user = LLMUser(base_url=stub.base_url, model=stub.model, timeout=120.0)
        for path in ("trainer", "evaluator"):
            for mode in ("waves", "events"):
                details: dict = {}
                backend = evaluator_backend(engine) if path == "evaluator" else None
                ids = play(env, trainer, tokenizer, range(8), True, user, Schedule(mode=mode), backend, details)
                found[f"{path}_{mode}"] = {"ids": ids, **details}
        user.close()
    return found


if __name__ == "__main__":
    from transformers import AutoTokenizer

    model, out = sys.argv[1], Path(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = vllm_seeds.SeededLLM(LLM(model=model, seed=0, gpu_memory_utilization=0.2, max_model_len=MAX_LEN,
                                      max_num_batched_tokens=MAX_LEN, enable_prefix_caching=True))  # fmt: skip
    trainer = stand_in_trainer(engine, tokenizer)
    env = DomainEnv(AIRLINE)
    whole = play(env, trainer, tokenizer, range(EPISODES), seeded=True)
    halves = {**play(env, trainer, tokenizer, range(EPISODES // 2), seeded=True),
              **play(env, trainer, tokenizer, range(EPISODES // 2, EPISODES), seeded=True)}  # fmt: skip
    unseeded_whole = play(env, trainer, tokenizer, range(EPISODES), seeded=False)
    unseeded_halves = {**play(env, trainer, tokenizer, range(EPISODES // 2), seeded=False),
                       **play(env, trainer, tokenizer, range(EPISODES // 2, EPISODES), seeded=False)}  # fmt: skip
    short = DomainEnv(AIRLINE, config=EnvConfig(max_turns=4))
    out.write_text(json.dumps({"whole": whole, "halves": halves, "unseeded_whole": unseeded_whole,
                               "unseeded_halves": unseeded_halves,
                               "schedules": schedules(short, trainer, engine, tokenizer)}))  # fmt: skip
