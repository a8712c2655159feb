"""Held-out pass^k inside GRPO training (``tau2_rl.evaluation.heldout``) with the tiny model on CPU: an eval step
plays the held-out tasks through the evaluator's episode loop and results format, logs ``eval/pass^1`` and friends
to TensorBoard, writes a results file that compare mode reads, and never rewrites a complete one. ~15 s.

Shrunk settings (each marked where set): a 2-task test split plus 1 uncovered train task instead of 10 (+ M), 2
samples per task, a one-line system prompt, 8-token turns ending with EOS (``forced_eos_token_id``), 3 turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from tau2_rl.configs import EnvArguments, MultiTurnGRPOConfig
from tau2_rl.domains import get_domain
from tau2_rl.envs.splits import Split, get_split
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.evaluation import run_compare
from tau2_rl.evaluation.evaluator import episode_seed
from tau2_rl.evaluation.heldout import HeldoutEvaluation, build_heldout, heldout_task_ids, log_values
from tau2_rl.evaluation.results import ConfigMismatchError
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

AIRLINE = get_domain("airline")

pytestmark = pytest.mark.usefixtures("single_thread")

# 4 train tasks of which 1 covered, 2 test tasks: the held-out set is small enough for a test
TINY_SPLIT = Split("tiny", train=("0", "1", "3", "4"), test=("2", "8"), covered=("0",))


def test_heldout_tasks_are_the_test_tasks_plus_a_fixed_uncovered_sample() -> None:
    split = get_split("seed", AIRLINE.split_file())
    assert heldout_task_ids(split) == sorted(split.test, key=int)
    chosen = heldout_task_ids(split, 5, seed=42)
    extra = set(chosen) - set(split.test)
    assert len(chosen) == 15 and extra <= set(split.group("uncovered_seen")) and len(extra) == 5
    assert heldout_task_ids(split, 5, seed=42) == chosen  # the same sample at every eval step and on resume
    assert heldout_task_ids(split, 5, seed=7) != chosen
    with pytest.raises(ValueError, match=r"--heldout_uncovered_tasks must be in \[0, 24\]"):
        heldout_task_ids(split, 25)


def test_logged_keys_become_eval_slash_tags_and_missing_values_are_left_out() -> None:
    from transformers.integrations.integration_utils import rewrite_logs

    metrics = {
        "pass1": {"overall": {"value": 0.25, "ci_low": 0.0, "ci_high": 0.5}, "unseen": {"value": 0.25},
                  "uncovered_seen": {"value": None}, "generalization": {"value": None}},
        "pass_hat_k": {"1": 0.25, "2": 0.1, "3": None},
        "refusal_floor": {"overall": 0.5},
        "error_rate": 0.5,
        "reasoning_depth_p50": 8.0,
    }  # fmt: skip
    logs = log_values(metrics)
    assert logs["eval_pass^1"] == 0.25 and logs["eval_pass^2"] == 0.1 and "eval_pass^3" not in logs
    assert "eval_generalization" not in logs and "eval_pass^1/uncovered_seen" not in logs
    tags = rewrite_logs(logs)
    assert tags["eval/pass^1"] == 0.25 and tags["eval/pass^1/unseen"] == 0.25 and tags["eval/noop_floor"] == 0.5
    assert tags["eval/reasoning_depth_p50"] == 8.0 and tags["eval/error_rate"] == 0.5


def make_trainer(tmp_path: Path, tiny_model, tokenizer, short_env, **overrides) -> MultiTurnGRPOTrainer:
    env = short_env(max_turns=3)  # shrunk from 30
    values = {
        "output_dir": str(tmp_path / "run"),
        "variant": "vanilla",
        "per_device_train_batch_size": 4,  # shrunk from 8: one group per step
        "per_device_eval_batch_size": 4,  # held-out episodes played together per run_episodes call
        "num_generations": 4,  # shrunk from 8
        "max_completion_length": 192,  # shrunk from 8192
        "max_turn_tokens": 8,  # shrunk from 512
        "generation_kwargs": {"forced_eos_token_id": tokenizer.eos_token_id},  # every 8-token turn ends the turn
        "max_steps": 1,  # shrunk: one optimisation step, then one eval step
        "eval_strategy": "steps",
        "eval_steps": 1,
        "heldout_num_samples": 2,  # shrunk from 4
        "heldout_uncovered_tasks": 1,  # one uncovered train task: generalization is defined
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "tensorboard",
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "seed": 0,
    }
    values.update(overrides)
    args = MultiTurnGRPOConfig(**values)
    user = get_user_simulator("scripted")
    heldout = build_heldout(EnvArguments(split="tiny"), args, env, user, TINY_SPLIT, "tiny-run")
    rows = [{"prompt": [{"role": "system", "content": env.system_prompt}], "task_id": t} for t in ("0", "1")]
    return MultiTurnGRPOTrainer(
        model=tiny_model,
        args=args,
        env=env,
        user=user,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        heldout=heldout,
    )


def scalar_tags(logdir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[str, list[float]] = {}
    for events in logdir.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            values.setdefault(tag, []).extend(e.value for e in accumulator.Scalars(tag))
    return values


def test_an_eval_step_plays_the_heldout_tasks_logs_pass_k_and_writes_a_results_file(
    tmp_path, tiny_model, tiny_tokenizer, short_env
) -> None:
    trainer = make_trainer(tmp_path, tiny_model, tiny_tokenizer, short_env)
    heldout = trainer.heldout
    assert isinstance(heldout, HeldoutEvaluation)
    assert {"2", "8"} <= set(heldout.task_ids) and len(heldout.task_ids) == 3
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.model.training

    # the results file: the evaluator's format, every (task, sample) once, seeded as evaluate.py seeds them
    path = tmp_path / "run" / "heldout" / "step-000001" / "results.json"
    data = json.loads(path.read_text())
    config, metrics = data["config"], data["metrics"]
    assert config["step"] == 1 and config["label"] == "tiny-run-heldout" and config["source"] == "training"
    assert config["tasks"] == heldout.task_ids and config["num_samples"] == 2 and metrics["complete"]
    assert config["group_sizes"] == {"covered_seen": 1, "uncovered_seen": 3, "unseen": 2}
    schedule = data["runs"][0]["schedule"]  # the scripted user answers at once: nothing in flight
    assert schedule["mode"] == "events" and schedule["user_requests_in_flight_max"] == 0
    for task_id, task in data["tasks"].items():
        assert [s["sample"] for s in task["samples"]] == [0, 1]
        assert [s["seed"] for s in task["samples"]] == [episode_seed(0, task_id, s) for s in (0, 1)]
        assert task["group"] == TINY_SPLIT.group_of(task_id)
    turn_tokens = [n for t in data["tasks"].values() for s in t["samples"] for n in s["policy_tokens"]]
    assert turn_tokens and all(1 <= n <= 8 for n in turn_tokens)  # 8-token turns; no 0-token turn recorded
    assert path.with_name("summary.md").is_file()

    # the logs: eval_* keys in the trainer's history, eval/* tags in TensorBoard
    (entry,) = [e for e in trainer.state.log_history if "eval_pass^1" in e]
    assert entry["step"] == 1
    assert entry["eval_pass^1"] == metrics["pass1"]["overall"]["value"]
    assert entry["eval_pass^2"] == metrics["pass_hat_k"]["2"]
    assert entry["eval_pass^1/unseen"] == metrics["pass1"]["unseen"]["value"]
    assert entry["eval_generalization"] == metrics["pass1"]["generalization"]["value"]
    assert entry["eval_noop_floor"] == metrics["refusal_floor"]["overall"]
    assert entry["eval_reasoning_depth_p50"] == metrics["reasoning_depth_p50"] > 0
    assert entry["eval_episodes"] == 6
    tags = scalar_tags(tmp_path / "run")  # TensorBoard events under <output_dir>/runs/
    for tag in ("eval/pass^1", "eval/pass^2", "eval/generalization", "eval/error_rate", "eval/noop_floor",
                "eval/reasoning_depth_p50", "train/reward"):  # fmt: skip
        assert tag in tags, sorted(tags)
    assert tags["eval/pass^1"] == [pytest.approx(entry["eval_pass^1"])]

    # compare mode reads the held-out files as the variant <run>-heldout at each step
    written = run_compare([str(tmp_path / "run" / "heldout")], tmp_path / "comparison")
    assert "tiny-run-heldout @ 1" in written["table"].read_text(encoding="utf-8")

    # evaluating the same step again (a resumed run) plays nothing and leaves the complete file byte-identical
    before = path.read_bytes()
    again = trainer.evaluate()
    assert path.read_bytes() == before
    assert again["eval_pass^1"] == entry["eval_pass^1"] and again["eval_episodes"] == 6


def test_step_files_of_another_configuration_are_refused_before_training(
    tmp_path, tiny_model, tiny_tokenizer, short_env
) -> None:
    trainer = make_trainer(tmp_path, tiny_model, tiny_tokenizer, short_env, report_to="none")
    trainer.evaluate()  # step 0
    assert (tmp_path / "run" / "heldout" / "step-000000" / "results.json").is_file()
    trainer.heldout.check_existing(trainer)  # same configuration: fine
    other = make_trainer(tmp_path, tiny_model, tiny_tokenizer, short_env, report_to="none", heldout_num_samples=3)
    with pytest.raises(ConfigMismatchError, match="num_samples: file has 2, this run has 3"):
        other.heldout.check_existing(other)


def train_numbers(trainer: MultiTurnGRPOTrainer) -> list[dict[str, float]]:
    """Every training log entry's numbers, wall-clock ones left out (they differ between any two runs)."""
    timing = ("time", "timing", "seconds", "runtime", "per_second", "speed", "idle", "in_flight")
    return [
        {k: v for k, v in entry.items() if isinstance(v, int | float) and not any(t in k for t in timing)}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]


def test_the_heldout_evaluation_does_not_change_the_training_run(
    tmp_path, tiny_model_dir, tiny_tokenizer, short_env
) -> None:
    """Same seeds, evaluation on or off: the same training numbers (issue 23.2: an eval at step 1 moved step 2's
    reward from 0.438 to 0.312, because the evaluation drew from the training RNG)."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    class Completions(TrainerCallback):
        """What the policy wrote in each training step's episodes (a random tiny model's rewards are all 0)."""

        def __init__(self, trainer: MultiTurnGRPOTrainer) -> None:
            self.trainer, self.texts = trainer, []

        def on_step_end(self, args, state, control, **kwargs) -> None:
            episodes = self.trainer._rollout_episodes
            self.texts.append([[m.get("content") for m in e.messages if m["role"] == "assistant"] for e in episodes])

    runs = {}
    for name, overrides in {"off": {"eval_strategy": "no"}, "on": {"eval_strategy": "steps", "eval_steps": 1}}.items():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        trainer = make_trainer(tmp_path / name, model, tiny_tokenizer, short_env, max_steps=3, report_to="none",
                               **overrides)  # fmt: skip
        completions = Completions(trainer)
        trainer.add_callback(completions)
        trainer.train()
        runs[name] = (trainer, train_numbers(trainer), completions.texts)
    evaluated = [e for e in runs["on"][0].state.log_history if "eval_pass^1" in e]
    assert [e["step"] for e in evaluated] == [1, 2, 3]  # the evaluation did run, between the training steps
    assert len(runs["off"][1]) == 3 and runs["on"][1] == runs["off"][1]
    texts = runs["off"][2]
    assert len(texts) == 3 and texts[1] != texts[0]  # the comparison has something to compare
    assert runs["on"][2] == texts


def test_eval_strategy_no_builds_nothing(tiny_tokenizer) -> None:
    args = MultiTurnGRPOConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
    assert build_heldout(EnvArguments(), args, None, None, TINY_SPLIT, "run") is None


TWO_RANKS_SCRIPT = """
import json, sys
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tau2_rl.configs import EnvArguments, MultiTurnGRPOConfig
from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import DomainEnv, EnvConfig
from tau2_rl.envs.splits import Split
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.evaluation.heldout import build_heldout
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

torch.set_num_threads(1)
model_dir, out = sys.argv[1], Path(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(model_dir)
env = DomainEnv(get_domain("airline"), config=EnvConfig(max_turns=2))
env.system_prompt, env.tools = "You are an airline customer service agent.", []
args = MultiTurnGRPOConfig(
    output_dir=str(out / "run"), variant="vanilla", per_device_train_batch_size=4, per_device_eval_batch_size=2,
    num_generations=4, max_completion_length=96, max_turn_tokens=6, eval_strategy="steps", eval_steps=1,
    heldout_num_samples=3, generation_kwargs={"forced_eos_token_id": tokenizer.eos_token_id}, report_to="none",
    use_cpu=True, bf16=False, save_strategy="no", seed=0,
)
split = Split("tiny", train=("0", "1", "3", "4"), test=("2", "8"), covered=("0",))
user = get_user_simulator("scripted")
heldout = build_heldout(EnvArguments(split="tiny"), args, env, user, split, "two-ranks")
rows = [{"prompt": [{"role": "system", "content": env.system_prompt}], "task_id": "0"}] * 4
trainer = MultiTurnGRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, env=env, user=user,
    train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer, heldout=heldout,
)
logs = trainer.evaluate()
rank = trainer.accelerator.process_index
(out / f"logs-{rank}.json").write_text(json.dumps({**logs, "world": trainer.accelerator.num_processes}))
from tau2_rl.run.start import leave_distributed_run
leave_distributed_run()
"""


@pytest.mark.slow
def test_two_processes_play_one_shard_each_and_report_the_same_metrics(tmp_path, tiny_model_dir) -> None:
    """Two CPU processes (torchrun, gloo): 2 tasks × 3 samples = 6 episodes, 3 per rank in chunks of 2 (a rank whose
    episodes end first joins the other's generations), one complete results file, the same logs on both ranks."""
    import os
    import subprocess
    import sys

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(root)}  # fmt: skip
    # torchrun: two CPU processes with the gloo backend (accelerate's CPU launcher would need MPI)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29617",
               str(script), str(tiny_model_dir), str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [json.loads((tmp_path / f"logs-{rank}.json").read_text()) for rank in (0, 1)]
    logs[0].pop("eval_runtime"), logs[1].pop("eval_runtime")
    assert logs[0] == logs[1] and logs[0]["eval_episodes"] == 6 and logs[0]["world"] == 2
    data = json.loads((tmp_path / "run" / "heldout" / "step-000000" / "results.json").read_text())
    assert data["metrics"]["complete"] and data["runs"][0]["episodes"] == 6
    for task_id in ("2", "8"):
        samples = data["tasks"][task_id]["samples"]
        assert [s["seed"] for s in samples] == [episode_seed(0, task_id, s) for s in (0, 1, 2)]
