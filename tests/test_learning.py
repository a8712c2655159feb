"""Proof that the trainer learns: GRPO through ``MultiTurnGRPOTrainer`` raises the reward on a tiny task, for every
variant, and the same run with the advantage sign flipped or with the policy tokens masked out does not.

The task: each episode is one policy turn of one token (``max_turns=1``, ``max_turn_tokens=1``) after the real
environment's prompt (short system prompt, the scripted user's opening message). ``suppress_tokens`` restricts the
random tiny model to four candidate tokens, one of which is ``<tool_call>`` (a single token); the reward is 1 when the
turn's text contains ``<tool_call>``, else 0. The untrained policy picks it with some probability b (measured by the
masked control, whose parameters never move); a working trainer drives the reward to ~1 within a few steps.

Negative controls, same settings, same seed:
- advantages negated after the trainer computed them → the reward falls instead (towards 0);
- every policy token masked (tool_mask all 0, as if the mask dropped the sampled tokens) → nothing moves.

Marked slow (about 30 s on 2 cores, one torch thread): ``pytest -m slow tests/test_learning.py``.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from learning_controls import apply_control
from transformers import AutoModelForCausalLM

from tau2_rl.configs import VARIANTS, MultiTurnGRPOConfig
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

STEPS = 12  # optimisation steps per run: the working trainer saturates after ~3–6
K = 4  # windows compared: the first K and the last K steps
LEARNED = 0.9  # mean reward over the last K steps that counts as "learned"


def tool_call_reward(completions: list, **kwargs) -> list[float]:
    """1 when the policy's (only) turn contains the ``<tool_call>`` token, else 0."""
    return [1.0 if "<tool_call>" in (c[-1].get("content") or "") else 0.0 for c in completions]


def run(tmp_path, model_dir, tokenizer, short_env, variant: str, control: str | None = None):
    """Trains ``STEPS`` steps; returns the mean reward of every step and whether any parameter moved."""
    candidates = [tokenizer.convert_tokens_to_ids("<tool_call>")]
    candidates += [tokenizer.convert_tokens_to_ids(t) for t in ("a", "e", "o")]  # byte-level tokens: always there
    assert len(set(candidates)) == 4 and tokenizer.unk_token_id not in candidates
    suppress = [i for i in range(len(tokenizer)) if i not in candidates]
    args = MultiTurnGRPOConfig(
        output_dir=str(tmp_path / f"{variant}-{control}"),
        variant=variant,
        per_device_train_batch_size=8,  # one group of 8 episodes per step
        num_generations=8,
        max_turn_tokens=1,  # shrunk: one sampled token per episode
        max_completion_length=256,  # room for the user's opening message + the one token
        generation_kwargs={"suppress_tokens": suppress},  # sample among the four candidates only
        reward_weights=[1.0],
        learning_rate=5e-3,  # large: the random tiny model must move within a few steps
        lr_scheduler_type="constant",
        max_steps=STEPS,
        logging_steps=10_000,  # no per-step log printing
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=0,
    )
    env = short_env(max_turns=1)
    rows = [{"prompt": [{"role": "system", "content": env.system_prompt}], "task_id": str(t)} for t in range(8)]
    rewards_per_step: list[float] = []

    def reward(completions, **kwargs):
        values = tool_call_reward(completions)
        rewards_per_step.append(sum(values) / len(values))
        return values

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = MultiTurnGRPOTrainer(
        model=model,
        args=args,
        env=env,
        user=get_user_simulator("scripted"),
        train_dataset=datasets.Dataset.from_list(rows * 16),
        processing_class=tokenizer,
        reward_funcs=[reward],
    )
    apply_control(trainer, control)
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters(), strict=True))
    assert len(rewards_per_step) == STEPS
    return rewards_per_step, moved


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory, tiny_model_dir, tiny_tokenizer, short_env, single_thread):
    """The masked control: no parameter may move, so its rewards sample the untrained policy (the baseline b)."""
    path = tmp_path_factory.mktemp("baseline")
    return run(path, tiny_model_dir, tiny_tokenizer, short_env, "vanilla", "mask_policy")


def test_masked_policy_tokens_do_not_learn(untrained):
    rewards, moved = untrained
    assert not moved, "with every policy token masked the loss must have no gradient"
    baseline = mean(rewards)
    assert 0.05 < baseline < 0.8, f"the untrained policy should sometimes, not always, call the tool: {rewards}"
    assert mean(rewards[-K:]) < LEARNED, rewards


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_grpo_raises_the_reward_and_flipped_advantages_lower_it(
    variant, untrained, tmp_path, tiny_model_dir, tiny_tokenizer, short_env
):
    baseline = mean(untrained[0])
    learned, moved = run(tmp_path, tiny_model_dir, tiny_tokenizer, short_env, variant)
    assert moved
    assert mean(learned[-K:]) >= max(LEARNED, baseline + 0.25), (variant, baseline, learned)
    assert mean(learned[-K:]) > mean(learned[:K]), (variant, learned)

    flipped, _ = run(tmp_path, tiny_model_dir, tiny_tokenizer, short_env, variant, "flip_sign")
    print(f"{variant}: baseline {baseline:.2f}; learned {learned}; flipped {flipped}")  # shown with pytest -s
    # the flipped run unlearns the tool call: its last steps end near 0 and below the untrained policy's rate
    # (a40362a: with --seed in the episode seeds the masked control measured b = 0.16, not 0.29; the former
    # "b - 0.25" needed b >= 0.25 to be satisfiable at all)
    assert mean(flipped[-K:]) <= min(baseline - 0.1, 0.1), (variant, baseline, flipped)
