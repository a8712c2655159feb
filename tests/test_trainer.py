"""``MultiTurnGRPOTrainer`` end to end on CPU with the tiny model: loss equivalence, masking, every variant, resume,
local-hub export, early errors and logged metrics. About 30 s on 2 cores (one torch thread).

Shrunk hyper-parameters (each marked where set): one group of 4 episodes per step instead of 8 × 8; a one-line
system prompt with no tool schemas (~40 tokens instead of ~7k); turns of 8 tokens, at most 3 turns, a 192-token
episode budget. ``forced_eos_token_id`` makes every turn end with ``<|im_end|>`` after its 8 tokens, so the random
model plays real multi-turn episodes (user and tool messages between policy turns) instead of one truncated turn.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import train_grpo
from tau2_rl.configs import VARIANTS, MultiTurnGRPOConfig
from tau2_rl.domains import get_domain
from tau2_rl.envs.prompt_style import read_prompt_style, write_prompt_style
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.run.guard import RUN_CONFIG_FILE
from tau2_rl.run.hub import HubError, ensure_writable, resolve_model
from tau2_rl.trainers import grpo_run, multiturn_grpo
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

AIRLINE = get_domain("airline")

pytestmark = pytest.mark.usefixtures("single_thread")

REPO_ROOT = Path(__file__).resolve().parent.parent
TASKS = ["0", "1", "2", "3"]


def assistant_chars(completions: list, **kwargs) -> list[float]:
    """A reward that varies within a group: characters the policy wrote (so advantages are non-zero)."""
    return [float(sum(len(m.get("content") or "") for m in c if m["role"] == "assistant")) for c in completions]


def make_args(tmp_path: Path, variant: str, tokenizer, **overrides) -> MultiTurnGRPOConfig:
    values = {
        "output_dir": str(tmp_path / "out"),
        "variant": variant,
        "per_device_train_batch_size": 4,  # shrunk from 8: one group per step
        "num_generations": 4,  # shrunk from 8
        "max_completion_length": 192,  # shrunk from 8192: whole-episode budget
        "max_turn_tokens": 8,  # shrunk from 512
        "generation_kwargs": {"forced_eos_token_id": tokenizer.eos_token_id},  # every 8-token turn ends the turn
        "learning_rate": 1e-2,  # large: one step must visibly move the random tiny model
        "lr_scheduler_type": "constant",
        "max_steps": 1,  # shrunk: one optimisation step
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "seed": 0,
    }
    values.update(overrides)
    return MultiTurnGRPOConfig(**values)


def make_trainer(tmp_path, variant, tiny_model, tokenizer, short_env, reward_funcs=(assistant_chars,), **overrides):
    env = short_env(max_turns=3)  # shrunk from 30
    args = make_args(tmp_path, variant, tokenizer, **overrides)
    rows = [{"prompt": [{"role": "system", "content": env.system_prompt}], "task_id": t} for t in TASKS]
    return MultiTurnGRPOTrainer(
        model=tiny_model,
        args=args,
        env=env,
        user=get_user_simulator("scripted"),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        reward_funcs=list(reward_funcs) if reward_funcs is not None else None,
    )


def one_group(trainer) -> list[dict]:
    """The rows of one GRPO group as TRL's sampler would hand them over (one task, num_generations copies)."""
    row = trainer.train_dataset[0]
    return [row] * trainer.num_generations


def capture_group_advantages(monkeypatch) -> dict:
    """Records the per-sequence (TRL) advantages the trainer hands to the variant weighting."""
    seen: dict = {}
    original = multiturn_grpo.token_advantages

    def spy(variant, group_advantages, *args, **kwargs):
        seen["group"] = group_advantages.detach().clone()
        return original(variant, group_advantages, *args, **kwargs)

    monkeypatch.setattr(multiturn_grpo, "token_advantages", spy)
    return seen


def gradients(model, loss) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


# ---------------------------------------------------------------------------------------------------------------------
# (a) vanilla is TRL's loss_type="grpo"


def test_vanilla_equals_trl_grpo_on_the_same_batch(tmp_path, tiny_model, tiny_tokenizer, short_env, monkeypatch):
    seen = capture_group_advantages(monkeypatch)
    trainer = make_trainer(tmp_path, "vanilla", tiny_model, tiny_tokenizer, short_env)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; we call _compute_loss directly
    batch = trainer._generate_and_score_completions(one_group(trainer))

    # The group advantages are TRL's (r − mean) / (std + 1e-4) of our reward, independently recomputed.
    episodes = trainer._rollout_episodes
    rewards = torch.tensor(assistant_chars([ep.messages[2:] for ep in episodes]))
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    torch.testing.assert_close(seen["group"], expected)
    assert seen["group"].abs().sum() > 0
    assert batch["advantages"].shape == batch["completion_ids"].shape  # per-token advantages

    loss_vanilla = trainer._compute_loss(trainer.model, batch)
    grads_vanilla = gradients(trainer.model, loss_vanilla)
    trainer.loss_type = "grpo"
    stock = {**batch, "advantages": seen["group"]}  # TRL's own [B] advantages, TRL's own per-sequence mean
    loss_grpo = trainer._compute_loss(trainer.model, stock)
    grads_grpo = gradients(trainer.model, loss_grpo)

    torch.testing.assert_close(loss_vanilla, loss_grpo)
    assert len(grads_vanilla) == len(grads_grpo) > 0
    for g_vanilla, g_grpo in zip(grads_vanilla, grads_grpo, strict=True):
        torch.testing.assert_close(g_vanilla, g_grpo, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads_vanilla)


# ---------------------------------------------------------------------------------------------------------------------
# (b) + (f) every variant trains, environment tokens are masked, metrics are logged


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_step_updates_parameters_with_environment_tokens_masked(
    variant, tmp_path, tiny_model, tiny_tokenizer, short_env
):
    trainer = make_trainer(tmp_path, variant, tiny_model, tiny_tokenizer, short_env)
    batches = []
    original = trainer._generate_and_score_completions

    def keep(inputs):
        batches.append(original(inputs))
        return batches[-1]

    trainer._generate_and_score_completions = keep
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 1
    changed = [not torch.equal(b, p.detach()) for b, p in zip(before, trainer.model.parameters(), strict=True)]
    assert any(changed), f"{variant}: no parameter moved"

    (batch,) = batches
    episodes = trainer._rollout_episodes
    mask, completion_mask, advantages = batch["tool_mask"], batch["completion_mask"], batch["advantages"]
    policy = torch.zeros_like(mask)
    for row, episode in enumerate(episodes):
        for start, end in episode.agent_state["spans"]:
            policy[row, start:end] = 1
        assert len(episode.agent_state["spans"]) >= 2  # multi-turn: environment tokens sit between policy turns
    assert torch.equal(mask * completion_mask, policy)  # tool_mask is 1 exactly on the sampled tokens
    assert (advantages[policy == 0] == 0).all()  # environment tokens and padding get no advantage
    assert (advantages[policy == 1] != 0).any()
    assert (mask == 0).sum() > 0

    # (f) the episode, PRM and timing metrics reached the log
    logs = trainer.state.log_history[0]
    for key in ("episode/outcome_reward", "episode/group_saturation", "episode/turns", "episode/truncation_rate"):
        assert key in logs, key
    assert any(k.startswith("prm/") and k.endswith("/fire_rate") for k in logs)
    # the within-group signal: how many groups had mixed outcomes (the AUC and the correlations only where some did)
    assert "prm/mixed_groups" in logs
    if logs["prm/mixed_groups"] > 0:
        assert 0.0 <= logs["prm/within_group_auc"] <= 1.0 and 0.0 <= logs["prm/sign_agreement"] <= 1.0
    # ... and the groups with equal outcomes, in which the process score is the only signal
    assert "prm/saturated_groups" in logs
    if logs["prm/saturated_groups"] > 0:
        assert 0.0 <= logs["prm/saturated_groups_with_signal"] <= 1.0
    for key in ("generation", "env_user", "reward_prm", "rollout", "optimisation", "env_user_reward_share"):
        assert f"timing/{key}" in logs, key
    assert 0.0 <= logs["timing/env_user_reward_share"] <= 1.0
    assert logs["episode/turns"] >= 2
    # every optimiser step's pre-clip gradient norm (the variants differ in step size) and whether it was clipped
    assert logs["grad_norm/pre_clip"] == pytest.approx(logs["grad_norm"]) and logs["grad_norm/pre_clip"] > 0
    assert logs["grad_norm/clipped"] in (0.0, 1.0)


def test_within_group_signal_metrics_are_logged(tmp_path, tiny_model, tiny_tokenizer, short_env):
    """prm/within_group_auc, prm/sign_agreement and prm/rule/<id>/corr over the groups with mixed outcomes (groups
    are num_generations consecutive episodes): a process score that ranks a group's success first is a signal."""
    from tau2_rl.envs.episode import EpisodeRecord
    from tau2_rl.envs.runner import RunTimings
    from tau2_rl.rewards.prm import PRMResult

    trainer = make_trainer(tmp_path, "joint", tiny_model, tiny_tokenizer, short_env, prm_rules="v1")
    assert trainer.args.prm_rules == "v1"
    group = trainer.num_generations  # 4
    outcomes = [1.0, 0.0, 0.0, 0.0] + [0.0] * group  # group 0 mixed, group 1 all failed (not counted)
    scores = [0.2, 0.1, 0.0, -0.1] + [0.3] * group
    summaries, results = [], []
    for outcome, score in zip(outcomes, scores, strict=True):
        counts = {"B5": int(outcome >= 1.0), "P9": 0}
        results.append(PRMResult([score], [{}], score, score, counts))
        summaries.append({
            "reward": {"reward": outcome, "user_error": False}, "prm": {"process_score": score, "rule_counts": counts},
            "num_turns": 1, "num_tool_calls": 0, "num_tool_errors": 0, "truncated": False,
        })  # fmt: skip
    records = [EpisodeRecord(task_id="0", seed=i) for i in range(len(outcomes))]
    trainer._log_rollout_metrics("train", records, results, summaries, RunTimings(), 0.0)
    metrics = trainer._metrics["train"]
    assert metrics["prm/mixed_groups"] == [1.0]
    assert metrics["prm/within_group_auc"] == [1.0]
    assert metrics["prm/sign_agreement"] == [pytest.approx(0.75)]  # the 0.1 failure is above its group mean
    assert metrics["prm/rule/B5/corr"] == [pytest.approx(1.0)] and "prm/rule/P9/corr" not in metrics  # constant
    # group 1 is saturated (all failed) and its process scores tie: no signal left to break the saturation
    assert metrics["prm/saturated_groups"] == [1.0] and metrics["prm/saturated_groups_with_signal"] == [0.0]


def test_reference_rules_score_rollouts_against_the_envs_task(tmp_path, tiny_model, tiny_tokenizer, short_env):
    """prm_rules reference: the trainer passes its environment, so each episode is scored against its own task's gold
    actions (the reward the variant adds is that score)."""
    from tau2_rl.rewards.prm import REFERENCE_TERMS, score_episode

    trainer = make_trainer(tmp_path, "prm_lite", tiny_model, tiny_tokenizer, short_env, reward_funcs=None,
                           prm_rules="reference")  # fmt: skip
    trainer.model.train()
    trainer._generate_and_score_completions(one_group(trainer))
    records = [ep.record for ep in trainer._rollout_episodes]
    assert [r.rule_counts for r in trainer._last_prm] == [
        score_episode(record, clip=(-0.5, 0.5), rules="reference", env=trainer.env).rule_counts for record in records
    ]
    assert all(set(r.rule_counts) == set(REFERENCE_TERMS) for r in trainer._last_prm)


def test_default_rewards_follow_the_variant(tmp_path, tiny_model, tiny_tokenizer, short_env):
    plain = make_trainer(tmp_path, "lata", tiny_model, tiny_tokenizer, short_env, reward_funcs=None)
    assert [f.__name__ for f in plain.reward_funcs] == ["outcome"]
    joint = make_trainer(tmp_path, "joint", tiny_model, tiny_tokenizer, short_env, reward_funcs=None, prm_coef=0.2)
    assert [f.__name__ for f in joint.reward_funcs] == ["outcome", "process"]
    assert joint.reward_weights.tolist() == pytest.approx([1.0, 0.2])


def test_episode_without_policy_turn_gets_a_masked_placeholder(tmp_path, tiny_model, tiny_tokenizer, short_env):
    """A user simulator failing on its first reply leaves no completion; TRL still needs one token per row."""
    trainer = make_trainer(tmp_path, "vanilla", tiny_model, tiny_tokenizer, short_env)
    trainer.model.train()

    class FailingUser:
        name = "failing"

        def reply_batch(self, episodes):
            from tau2_rl.envs.users.base import UserReply

            return [UserReply(error="endpoint down") for _ in episodes]

    trainer.user = FailingUser()
    batch = trainer._generate_and_score_completions(one_group(trainer))
    assert batch["completion_ids"].dtype == torch.long and batch["completion_ids"].shape[1] == 1
    assert (batch["tool_mask"] * batch["completion_mask"]).sum() == 0
    assert (batch["advantages"] == 0).all()


# ---------------------------------------------------------------------------------------------------------------------
# (c) + (d) train_grpo.py: checkpoints, resume, local hub


def cli(tmp_path: Path, model_dir: Path, *extra: str) -> list[str]:
    return [
        "--config", str(REPO_ROOT / "recipes/grpo/cpu_smoke.yaml"),
        "--model_name_or_path", str(model_dir),
        "--variant", "vanilla",
        "--output_dir", str(tmp_path / "run"),
        "--run_name", "tiny-run",
        "--hub_dir", str(tmp_path / "hub"),
        "--tasks", "0,1",
        "--task_repeats", "1",  # shrunk: 2 prompts × 4 generations = 2 steps
        "--num_generations", "4",
        "--per_device_train_batch_size", "4",  # shrunk from 8: one group per step
        "--max_turns", "2",  # shrunk from 6
        "--max_turn_tokens", "8",  # shrunk from 64
        "--max_completion_length", "160",  # shrunk from 1536
        "--max_steps", "2",
        "--save_steps", "1",
        "--mask_truncated_completions", "false",  # the random model's 8-token turns rarely end with EOS
        "--report_to", "none",
        *extra,
    ]  # fmt: skip


def test_train_resume_and_hub_export(tmp_path, tiny_model_dir, short_env, monkeypatch):
    monkeypatch.setattr(grpo_run, "run_env", lambda specs, data_dir=None, config=None: short_env(config.max_turns))

    def outcome(completions, **kwargs):  # τ²'s reward is 0 for a random policy: use one that moves the weights
        return assistant_chars(completions)

    monkeypatch.setattr(multiturn_grpo, "outcome", outcome)
    steps_run: list[int] = []
    original_step = MultiTurnGRPOTrainer.training_step

    def counting_step(self, *args, **kwargs):
        steps_run.append(self.state.global_step)
        return original_step(self, *args, **kwargs)

    monkeypatch.setattr(MultiTurnGRPOTrainer, "training_step", counting_step)

    train_grpo.main(*train_grpo.parse_args(cli(tmp_path, tiny_model_dir)))
    run_dir = tmp_path / "run"
    assert steps_run == [0, 1]
    assert (run_dir / "checkpoint-1").is_dir() and (run_dir / "checkpoint-2").is_dir()
    straight = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint-2").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(initial[name], tensor) for name, tensor in straight.items())  # training moved it

    # (d) the local hub: one loadable revision per save, a model card, refs.json pointing at the newest
    hub, run = tmp_path / "hub", "tiny-run"
    refs = json.loads((hub / run / "refs.json").read_text())
    assert refs == {"main": "step-000002", "revisions": {"step-000001": 1, "step-000002": 2},
                    "written_by": {"step-000001": "../../run", "step-000002": "../../run"}}  # fmt: skip
    for name in ("step-000001", "step-000002"):
        revision = hub / run / name
        assert AutoModelForCausalLM.from_pretrained(revision, local_files_only=True).config.vocab_size > 0
        assert AutoTokenizer.from_pretrained(revision, local_files_only=True).eos_token == "<|im_end|>"
        card = (revision / "README.md").read_text()
        assert "`variant`: vanilla" in card and f"# {run} @ step {int(name[-6:])}" in card
        assert "`prm_rules`: reference" in card  # the process reward's rule set: evaluate.py copies it to results.json
        assert "`system_prompt`: full" in card and read_prompt_style(revision) == "full"
    assert read_prompt_style(run_dir) == "full"  # the final model in output_dir too
    assert resolve_model(run, hub) == hub / run / "step-000002"
    assert resolve_model(f"{run}@1", hub) == hub / run / "step-000001"
    assert resolve_model(f"{run}@step-000002", hub) == hub / run / "step-000002"
    assert resolve_model(str(hub / run / "step-000001"), hub) == hub / run / "step-000001"
    with pytest.raises(HubError, match=r"no checkpoint step '7'; available steps: \[1, 2\]"):
        resolve_model(f"{run}@7", hub)
    with pytest.raises(HubError, match="neither a model directory nor a run"):
        resolve_model("no-such-run", hub)

    # (c) resume from checkpoint-1: only step 2 runs again, and it lands where the uninterrupted run did
    steps_run.clear()
    resume = cli(tmp_path, tiny_model_dir, "--resume_from_checkpoint", str(run_dir / "checkpoint-1"))
    train_grpo.main(*train_grpo.parse_args(resume))
    assert steps_run == [1]
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2]
    resumed = AutoModelForCausalLM.from_pretrained(run_dir).state_dict()
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, msg=f"resumed run diverged at {name}")
    assert json.loads((hub / run / "refs.json").read_text())["main"] == "step-000002"


def test_a_model_trained_with_the_compact_prompt_keeps_it(tmp_path, tiny_model_dir, short_env, monkeypatch):
    """GRPO from a model whose directory records the compact prompt trains with it and records it in its exports."""
    monkeypatch.setattr(grpo_run, "run_env", lambda specs, data_dir=None, config=None: short_env(config.max_turns))
    seen: list[str] = []
    original_init = MultiTurnGRPOTrainer.__init__

    def spy_init(self, *args, **kwargs):
        seen.append(kwargs["env"].system_prompt)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(MultiTurnGRPOTrainer, "__init__", spy_init)
    model = tmp_path / "compact-model"
    shutil.copytree(tiny_model_dir, model)
    write_prompt_style(model, compact=True, specs=[AIRLINE])
    train_grpo.main(*train_grpo.parse_args(cli(tmp_path, model, "--max_steps", "1")))
    assert seen == [AIRLINE.compact_prompt]
    run_dir, revision = tmp_path / "run", tmp_path / "hub" / "tiny-run" / "step-000001"
    assert json.loads((run_dir / RUN_CONFIG_FILE).read_text())["fingerprint"]["compact_prompt"] is True
    assert read_prompt_style(run_dir) == read_prompt_style(revision) == "compact"


# ---------------------------------------------------------------------------------------------------------------------
# (e) bad input fails before any work, naming the flag


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match=r"unknown variant 'nope'.*valid variants"):
        MultiTurnGRPOConfig(output_dir="unused", variant="nope")


@pytest.mark.parametrize(
    ("variant", "field"),
    [("vanilla", "prm_coef"), ("lata", "turn_discount_alpha"), ("prm_lite", "turn_credit_coef")],
)
def test_variant_field_under_another_variant_is_rejected(variant, field):
    with pytest.raises(ValueError, match=f"--{field} belongs to variant"):
        MultiTurnGRPOConfig(output_dir="unused", variant=variant, **{field: 0.5})


def test_missing_model_path_names_the_flag(tmp_path, airline_env):
    cpu = ["--use_cpu", "true", "--bf16", "false"]
    script, _, model = train_grpo.parse_args(
        ["--output_dir", str(tmp_path), "--model_name_or_path", "/nope/model", *cpu]
    )
    with pytest.raises(SystemExit, match="--model_name_or_path /nope/model does not exist"):
        train_grpo.resolve_model_path(model, script, str(tmp_path), airline_env)


def test_unwritable_hub_dir_is_rejected(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(HubError, match="--hub_dir"):
        ensure_writable(blocker / "hub")  # a directory under a regular file: unwritable even for root


def test_unknown_task_fails_before_the_model_is_loaded(tmp_path, tiny_model_dir, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    with pytest.raises(SystemExit, match=r"error: --tasks: Unknown task id '999'.*task ids 0\.\.49"):
        train_grpo.main(*train_grpo.parse_args(cli(tmp_path, tiny_model_dir, "--tasks", "999")))


def test_use_vllm_without_vllm_is_a_clear_error_where_the_run_starts(tmp_path, tiny_model_dir, monkeypatch, hide_vllm):
    """A GPU recipe parses anywhere (its fields are only recorded); the run itself refuses, before any model loads."""
    config = MultiTurnGRPOConfig(output_dir=str(tmp_path), variant="vanilla", use_vllm=True, bf16=False)
    assert config.use_vllm

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the missing vLLM was reported")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    args = train_grpo.parse_args(cli(tmp_path, tiny_model_dir, "--use_vllm", "true"))
    with pytest.raises(SystemExit, match=r"^error: --use_vllm needs vLLM, which is not installed: pip install -r "):
        train_grpo.main(*args)
    assert not (tmp_path / "run").exists()  # nothing was claimed or written


def test_use_vllm_without_vllm_is_one_line_and_status_2(tmp_path, tiny_model_dir):
    """The command line as a user meets it (vLLM hidden from the child with a ``sitecustomize`` shim)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import importlib.util\n"
        "_real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'vllm' else _real(name, *a)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(REPO_ROOT)])}
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train_grpo.py"), *cli(tmp_path, tiny_model_dir, "--use_vllm", "true")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if ": error:" in line]
    assert lines == ["train_grpo.py: error: --use_vllm needs vLLM, which is not installed: pip install -r "
                     "requirements-gpu.txt (vllm==0.31.0)"], proc.stderr[-2000:]  # fmt: skip
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--variant", "vanilla", "--prm_coef", "0.3"], "train_grpo.py: error: --prm_coef belongs to variant(s)"),
        (
            ["--hub_dir", "{tmp}/a-file/hub"],
            "train_grpo.py: error: hub directory {tmp}/a-file/hub (--hub_dir) is not writable",
        ),
    ],
)
def test_train_grpo_cli_prints_one_line_errors(tmp_path, flags, message):
    (tmp_path / "a-file").write_text("")
    flags = [f.format(tmp=tmp_path) for f in flags]
    command = [sys.executable, "train_grpo.py", "--config", "recipes/grpo/cpu_smoke.yaml", *flags]
    command += ["--output_dir", str(tmp_path / "out")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(message.format(tmp=tmp_path))
    assert not (tmp_path / "out").exists()  # nothing was trained or written


def test_lora_training_exports_a_loadable_adapter(tmp_path, tiny_model_dir, short_env, monkeypatch):
    """LoRA through ModelConfig (--use_peft): only adapter weights train, and the hub revision (the adapter, whose
    config points at the local base model) loads offline with from_pretrained and resolves for evaluate.py."""
    monkeypatch.setattr(grpo_run, "run_env", lambda specs, data_dir=None, config=None: short_env(config.max_turns))
    monkeypatch.setattr(multiturn_grpo, "outcome", lambda completions, **kwargs: assistant_chars(completions))
    flags = cli(tmp_path, tiny_model_dir, "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8")
    flags[flags.index("--max_steps") + 1] = "1"  # shrunk: one step is enough to move the adapter
    train_grpo.main(*train_grpo.parse_args(flags))
    revision = resolve_model("tiny-run", tmp_path / "hub")
    assert (revision / "adapter_config.json").is_file()
    adapted = AutoModelForCausalLM.from_pretrained(revision, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    lora = {name: p for name, p in adapted.named_parameters() if "lora_B" in name}
    assert lora and any(p.abs().sum() > 0 for p in lora.values())  # lora_B starts at zero: training moved it
    base_names = dict(base.named_parameters())
    frozen = [n for n, p in adapted.named_parameters() if "lora_" not in n]
    assert frozen and all(
        torch.equal(
            dict(adapted.named_parameters())[n],
            base_names[n.replace("base_model.model.", "").replace(".base_layer", "")],
        )
        for n in frozen
        if n.replace("base_model.model.", "").replace(".base_layer", "") in base_names
    )
