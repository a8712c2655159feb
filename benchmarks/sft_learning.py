"""Proof that SFT learns: the tiny model fine-tuned on oracle trajectories of covered tasks (CPU).

1. Collect oracle trajectories (scripted user) of the chosen covered tasks (``collect``, resumable).
2. Build the embedded tiny Qwen2 (``--hidden``/``--layers``) and measure teacher-forced accuracy on the assistant
   tokens of those trajectories (argmax prediction given the true prefix).
3. Fine-tune with ``train_sft.py`` (TRL's SFTTrainer on Render-Twice-Diff masks) and measure it again.
4. Play each task greedily with the fine-tuned model against the scripted user through ``run_episodes`` and the RL
   rollout's ``TokenPolicyAgent`` (temperature 0): does the first tool call equal the first gold action, and does the
   episode earn reward 1?

Usage: ``python benchmarks/sft_learning.py [--tasks 27,49] [--epochs 50] [--hidden 128]``; prints one JSON object.
``tests/test_sft.py::test_sft_learns`` (slow) runs it with its defaults. Nothing in the trajectories is shortened:
each example holds the whole ~4.4k-token system prompt with the tool schemas.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tau2_rl.backends import TransformersBackend  # noqa: E402
from tau2_rl.configs import CollectArguments  # noqa: E402
from tau2_rl.data.collect import collect, decode_rows, load_trajectories  # noqa: E402
from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.envs.agents import get_agent  # noqa: E402
from tau2_rl.envs.episode import DomainEnv  # noqa: E402
from tau2_rl.envs.runner import run_episodes  # noqa: E402
from tau2_rl.envs.splits import get_split  # noqa: E402
from tau2_rl.envs.users import get_user_simulator  # noqa: E402
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.rollout import TokenPolicyAgent  # noqa: E402
from tau2_rl.trainers.sft import prepare_sft_dataset, teacher_forced_accuracy  # noqa: E402

AIRLINE = get_domain("airline")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TASKS = "27,49"  # covered tasks whose gold begins with a tool call


def greedy_rollouts(
    model_dir: str, tasks: list[str], max_turn_tokens: int = 512, reference: dict[str, list] | None = None
) -> dict[str, Any]:
    """Plays ``tasks`` greedily with the model against the scripted user; per task: reward, first call vs gold, and
    whether the whole conversation equals the teacher's (``reference``: messages by task)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    env = DomainEnv(AIRLINE)
    backend = TransformersBackend(model, tokenizer, temperature=0.0, eos_token_ids=[tokenizer.eos_token_id])
    agent = TokenPolicyAgent(
        backend,
        tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        max_completion_length=8192,
        max_turn_tokens=max_turn_tokens,
    )
    records = run_episodes(
        env, agent, get_user_simulator("scripted"), [(task, 0) for task in tasks], score=outcome_reward
    )
    noop = run_episodes(
        env, get_agent("noop"), get_user_simulator("scripted"), [(task, 0) for task in tasks], score=outcome_reward
    )
    results = {}
    for record, baseline in zip(records, noop, strict=True):
        gold = env.domain.get_task(record.task_id).actions
        first = record.tool_calls[0] if record.tool_calls else None
        results[record.task_id] = {
            "reward": record.reward["reward"],
            "noop_reward": baseline.reward["reward"],  # reward 1 without doing anything: a weak success signal
            "termination": record.termination,
            "first_gold_call": bool(
                gold and first is not None and first.name == gold[0].name and first.arguments == gold[0].arguments
            ),
            "first_call": None if first is None else {"name": first.name, "arguments": first.arguments},
            "turns": len(record.turns),
            "same_as_teacher": reference is not None and record.messages == reference.get(record.task_id),
            "turn_texts": [turn.raw_text for turn in record.turns],
        }
    return results


def run(
    tasks: str = DEFAULT_TASKS,
    epochs: int = 50,
    hidden: int = 128,
    layers: int = 2,
    learning_rate: float = 3e-3,
    workdir: str | None = None,
    max_turn_tokens: int = 512,
    lr_scheduler: str = "constant",
) -> dict[str, Any]:
    import train_sft

    start = time.perf_counter()
    workdir = Path(workdir or tempfile.mkdtemp(prefix="sft-learning-"))
    task_ids = [t.strip() for t in tasks.split(",") if t.strip()]
    collected = collect(
        CollectArguments(
            tasks=",".join(task_ids),
            output_dir=str(workdir / "trajectories"),
            hub_dir=str(workdir / "hub"),
            progress=False,
        )
    )
    trajectories = load_trajectories(collected.output_dir)
    argv = [
        "--config", str(REPO_ROOT / "recipes" / "sft" / "cpu_smoke.yaml"),
        "--dataset_path", collected.output_dir,
        "--output_dir", str(workdir / "sft"),
        "--run_name", "sft-learning",
        "--hub_dir", str(workdir / "hub"),
        "--tiny_model_dir", str(workdir / f"tiny-h{hidden}-l{layers}"),
        "--tiny_hidden_size", str(hidden),
        "--tiny_num_layers", str(layers),
        "--num_train_epochs", str(epochs),
        "--learning_rate", str(learning_rate),
        "--lr_scheduler_type", lr_scheduler,
        "--warmup_steps", "0",
        "--gradient_accumulation_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--logging_steps", "10",
        "--disable_tqdm", "true",
    ]  # fmt: skip
    script_args, training_args, model_args = train_sft.make_parser().parse_args_and_config(args=argv)

    # Before: the freshly built tiny model on the same tokenised rows.
    env = DomainEnv(AIRLINE)
    split = get_split(script_args.split or AIRLINE.default_split, AIRLINE.split_file())
    base = train_sft.resolve_model_path(model_args, script_args, training_args.output_dir, env)
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows, report = prepare_sft_dataset(trajectories, tokenizer, split=split, max_length=training_args.max_length)
    before = teacher_forced_accuracy(AutoModelForCausalLM.from_pretrained(base), rows)

    train_start = time.perf_counter()
    outcome = train_sft.main(script_args, training_args, model_args)
    train_seconds = time.perf_counter() - train_start

    after = teacher_forced_accuracy(AutoModelForCausalLM.from_pretrained(training_args.output_dir), rows)
    reference = {row["task_id"]: row["messages"] for row in decode_rows(trajectories)}
    rollouts = greedy_rollouts(training_args.output_dir, task_ids, max_turn_tokens, reference)
    return {
        "tasks": task_ids,
        "model": {"hidden_size": hidden, "num_layers": layers, "base": base},
        "epochs": epochs,
        "learning_rate": learning_rate,
        "lr_scheduler": lr_scheduler,
        "data": report.to_dict(),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "per_task_accuracy_after": after["per_task"],
        "assistant_tokens": after["tokens"],
        "final_train_loss": outcome["metrics"].get("train_loss"),
        "rollouts": rollouts,
        "first_gold_call_reproduced": sum(r["first_gold_call"] for r in rollouts.values()),
        "solved": sum(r["reward"] == 1.0 for r in rollouts.values()),
        "solved_where_noop_fails": sum(r["reward"] == 1.0 and r["noop_reward"] < 1.0 for r in rollouts.values()),
        "noop_fails": sum(r["noop_reward"] < 1.0 for r in rollouts.values()),
        "same_as_teacher": sum(r["same_as_teacher"] for r in rollouts.values()),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - start, 1),
        "hub_path": outcome["hub_path"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated covered task ids")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--lr_scheduler", default="constant")
    parser.add_argument("--max_turn_tokens", type=int, default=512, help="greedy rollouts: most tokens per turn")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    result = run(
        args.tasks,
        epochs=args.epochs,
        hidden=args.hidden,
        layers=args.layers,
        learning_rate=args.learning_rate,
        workdir=args.workdir,
        max_turn_tokens=args.max_turn_tokens,
        lr_scheduler=args.lr_scheduler,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
