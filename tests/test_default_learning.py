"""Proof that multi-turn GRPO learns on the real airline domain, for every variant, from the warmed default policy.

Setting (the embedded default, shrunk): the tiny Qwen2 warmed up by SFT on a mixed-quality teacher
(``tau2_rl.data.default_policy``: for train tasks 3 and 40 the oracle's dialogue once and a declining agent's
twice; built once per session in outputs/: tests/conftest.py), compact system prompt, the real tools, scripted user
reward. Training: task 3 (the oracle needs 4 turns and 2 tool calls, ``get_reservation_details`` then
``get_user_details``, then says "4"; declining scores 0), two groups of 8 episodes per step sampled at temperature 1,
``STEPS`` steps, lr 1e-4 as the recipe, fixed seed.

What is measured: the outcome reward of the policy before and after training, each over ``EVAL_EPISODES`` episodes
of task 3 played by the evaluator's agent (temperature 1, per-episode seeds, the same seeds before and after). That is
the reward GRPO maximises, measured on more episodes than a training step sees (the per-step training reward of 16
episodes has a standard error of ~0.12; it is printed for information).

Asserted for each variant: the weights move; the reward rises by at least ``MARGIN``; at least
``TOOL_USING_SHARE`` of the successful training episodes made ≥ 2 tool calls over ≥ 2 policy turns. Negative controls
(vanilla): advantages sign-flipped → the reward does not rise (it falls: the policy learns to decline; ``exhaustive``:
in CI tests/test_learning.py flips every variant's advantages on a smaller task); every policy token masked → no
weight moves.

Calibration (one torch thread, seed 0, the trainer's prefix-reuse rollouts with per-row sampling, 2 busy cores): before
0.273 (128 episodes); after 12 steps (64 episodes) 0.625 for all five variants with v2's rules (the default before
issue 67), prm_lite with ``prm_rules: reference`` (today's default) 0.625, joint with it 0.609 (+0.34 to +0.35);
sign-flipped 0.031. ``MARGIN`` = 0.15 sits well below the
smallest gain. 9 tests, 12 min 38 s on a loaded machine. (Earlier, with per-batch sampling: 0.266 → 0.578-0.719.)
The runs are deterministic for a given machine (one torch thread, fixed seeds); elsewhere float differences can
change sampled tokens, hence a margin rather than an exact value. Marked slow (``pytest -m slow
tests/test_default_learning.py``).
"""

from __future__ import annotations

import datasets
import pytest
import torch
from learning_controls import apply_control
from transformers import AutoModelForCausalLM, AutoTokenizer

from tau2_rl.backends import TransformersBackend
from tau2_rl.configs import VARIANTS, MultiTurnGRPOConfig
from tau2_rl.data.default_policy import build_default_policy, compact_env, default_policy_dir
from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import DomainEnv, EnvConfig
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.rollout import TokenPolicyAgent
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

AIRLINE = get_domain("airline")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

WARMUP_TASKS = ("3", "40")  # the default recipe's warm-up (recipes/grpo/cpu_smoke.yaml)
WARMUP_EPOCHS = 96
TASK = "3"
STEPS = 12  # the recipe runs 32
EPISODES_PER_STEP = 16  # two groups of 8, as the recipe
LEARNING_RATE = 1e-4  # as the recipe
EVAL_EPISODES = 64  # per measurement; the baseline uses twice as many
EVAL_SEED = 10_000  # evaluation episode seeds: EVAL_SEED + i (training uses other seeds)
MARGIN = 0.15  # calibrated: see the module docstring
TOOL_USING_SHARE = 0.9  # of the successful episodes (measured 0.96-1.0), this share made >= 2 tool calls
MAX_TURNS = 6  # as the recipe
MAX_TURN_TOKENS = 96


class RecordingTrainer(MultiTurnGRPOTrainer):
    """Keeps each step's episodes (reward, tool calls, turns) for the assertions."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[list[tuple[float, int, int]]] = []
        self.saturated_with_signal: list[float] = []  # prm/saturated_groups_with_signal of the steps that had one

    def _log_rollout_metrics(self, mode, records, prm_results, summaries, timings, seconds) -> None:
        if mode == "train":
            self.steps.append([(float(r.reward["reward"]), r.num_tool_calls, len(r.turns)) for r in records])
        logged = self._metrics[mode].get("prm/saturated_groups_with_signal", [])
        before = len(logged)
        super()._log_rollout_metrics(mode, records, prm_results, summaries, timings, seconds)
        logged = self._metrics[mode].get("prm/saturated_groups_with_signal", [])
        if mode == "train" and len(logged) > before:
            self.saturated_with_signal.append(logged[-1])


def _env() -> DomainEnv:
    return compact_env(DomainEnv(AIRLINE, config=EnvConfig(max_turns=MAX_TURNS)))


def mean_reward(model, tokenizer, episodes: int) -> float:
    """Mean outcome reward of ``model`` over ``episodes`` episodes of the task (the evaluator's agent and seeds)."""
    env = _env()
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    backend = TransformersBackend(model.eval(), tokenizer, temperature=1.0, eos_token_ids=eos, seed=0,
                                  prefix_cache=False)  # fmt: skip
    agent = TokenPolicyAgent(backend, tokenizer, eos, 2048, MAX_TURN_TOKENS, per_episode_seeds=True)
    specs = [(TASK, EVAL_SEED + i) for i in range(episodes)]
    with torch.no_grad():
        records = run_episodes(env, agent, get_user_simulator("scripted"), specs, score=outcome_reward)
    return sum(float(r.reward["reward"]) for r in records) / len(records)


@pytest.fixture(scope="module")
def default_policy(default_policy_cache) -> str:
    """The recipe's default policy, from the session's cache (tests/conftest.py; this reuses, never rebuilds)."""
    directory = default_policy_dir(default_policy_cache, WARMUP_TASKS, WARMUP_EPOCHS, [AIRLINE])
    return str(build_default_policy(directory, WARMUP_TASKS, epochs=WARMUP_EPOCHS, specs=[AIRLINE]))


@pytest.fixture(scope="module")
def reward_before(default_policy) -> float:
    tokenizer = AutoTokenizer.from_pretrained(default_policy)
    model = AutoModelForCausalLM.from_pretrained(default_policy)
    return mean_reward(model, tokenizer, 2 * EVAL_EPISODES)


def train(
    policy_dir: str,
    output_dir,
    variant: str,
    control: str | None = None,
    steps: int = STEPS,
    prm_rules: str = "reference",
):
    """Trains ``steps`` steps; returns (trainer, per-step episodes, whether any parameter moved)."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    env = _env()
    args = MultiTurnGRPOConfig(
        output_dir=str(output_dir),
        variant=variant,
        prm_rules=prm_rules,
        per_device_train_batch_size=EPISODES_PER_STEP,
        num_generations=8,
        max_turn_tokens=MAX_TURN_TOKENS,
        max_completion_length=2048,
        mask_truncated_completions=False,
        temperature=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        scale_rewards="none",  # as the recipe: all-fail groups must not turn PRM-Lite noise into unit advantages
        max_steps=steps,
        logging_steps=10_000,
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )
    row = {"prompt": [{"role": "system", "content": env.system_prompt}], "task_id": TASK}
    rows = [row] * (EPISODES_PER_STEP * steps)
    trainer = RecordingTrainer(
        model=model,
        args=args,
        env=env,
        user=get_user_simulator("scripted"),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    apply_control(trainer, control)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters(), strict=True))
    assert len(trainer.steps) == steps
    return trainer, trainer.steps, moved


def step_rewards(steps: list[list[tuple[float, int, int]]]) -> list[float]:
    return [round(sum(r for r, _, _ in episodes) / len(episodes), 3) for episodes in steps]


CASES = [(variant, "reference") for variant in VARIANTS] + [("prm_lite", "v2"), ("joint", "v2")]
"""(variant, prm_rules): every variant with the default rule set (the reference reward, tau2_rl.rewards.prm.reference),
and the process-reward variants with the seed's trajectory-only rules (v2)."""


CI_CASES: set[tuple[str, str]] = set()
"""The cases CI runs: none since issue 67 (CI's time: vanilla's 12 steps here took ~100 s of stage 2). Every variant's
loss path learns in CI on a smaller task (tests/test_learning.py, in seconds, the sign-flipped control included), and
the quick starts' path (joint: PRM-Lite with the 1/sqrt(L) weights) learns from the embedded default on the airline,
on airline and retail together and on telecom (tests/test_readme_numbers.py, tests/test_retail_training.py,
tests/test_telecom_training.py: 32 steps each); the masked-tokens control below still runs. Every case here, every
variant from the warmed default with the reference reward and prm_lite/joint with v2's rules, is ``exhaustive``
(~1.5 min each)."""


@pytest.mark.parametrize(
    ("variant", "prm_rules"),
    [case if case in CI_CASES else pytest.param(*case, marks=pytest.mark.exhaustive) for case in CASES],
    ids=[f"{v}-{r}" if r != "reference" else v for v, r in CASES],
)
def test_grpo_raises_the_outcome_reward_on_the_airline_domain(
    variant, prm_rules, default_policy, reward_before, tmp_path
):
    trainer, steps, moved = train(default_policy, tmp_path, variant, prm_rules=prm_rules)
    after = mean_reward(trainer.model, trainer.processing_class, EVAL_EPISODES)
    signal = trainer.saturated_with_signal
    print(f"{variant} ({prm_rules}): reward {reward_before:.3f} -> {after:.3f} ({after - reward_before:+.3f}); "
          f"per-step training reward {step_rewards(steps)}; "
          f"prm/saturated_groups_with_signal per step {signal}")  # fmt: skip
    assert moved
    assert after - reward_before >= MARGIN, f"{variant}: {reward_before:.3f} -> {after:.3f}"
    successes = [(calls, turns) for episodes in steps for reward, calls, turns in episodes if reward >= 1.0]
    with_tools = sum(calls >= 2 and turns >= 2 for calls, turns in successes)
    print(f"{variant}: {with_tools}/{len(successes)} successful training episodes made >= 2 tool calls")
    # Task 3 is read-only: a policy that memorised the answer can say it without looking it up, so a few successes
    # may skip the tools; the learned behaviour must still be the tool-using one.
    assert with_tools >= TOOL_USING_SHARE * len(successes), successes


@pytest.mark.exhaustive  # CI: tests/test_learning.py's flipped control, for every variant (issue 50: CI time)
def test_sign_flipped_advantages_do_not_raise_the_reward(default_policy, reward_before, tmp_path):
    trainer, steps, moved = train(default_policy, tmp_path, "vanilla", "flip_sign")
    after = mean_reward(trainer.model, trainer.processing_class, EVAL_EPISODES)
    print(f"flipped: reward {reward_before:.3f} -> {after:.3f}; per-step training reward {step_rewards(steps)}")
    assert moved
    assert after < reward_before, f"sign-flipped advantages raised the reward: {reward_before:.3f} -> {after:.3f}"


def test_masked_policy_tokens_leave_the_weights_unchanged(default_policy, tmp_path):
    _, steps, moved = train(default_policy, tmp_path, "vanilla", "mask_policy", steps=2)
    assert not moved, "with every policy token masked the loss must have no gradient"
    assert sum(len(episodes) for episodes in steps) == 2 * EPISODES_PER_STEP  # the episodes were played, no update
