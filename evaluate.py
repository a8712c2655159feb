"""Evaluate a policy on τ²-bench's tasks (one domain or several), or compare evaluations (see docs/metrics.md).

    # the scripted baselines (no model): the oracle must score 1.0, noop shows what refusing everything earns
    python evaluate.py --model oracle --num_samples 1
    python evaluate.py --model noop --num_samples 1
    # checkpoints of a local-hub run, on CPU with the tiny recipe, or on a GPU with vLLM
    python evaluate.py --config recipes/eval/cpu_tiny.yaml
    python evaluate.py --config recipes/eval/gpu_vllm.yaml --model grpo-joint --steps 200,250,300 \
        --user_base_url http://localhost:8001/v1 --user_model Qwen2.5-72B-Instruct-AWQ
    # compare variants and steps: ablation table + two plots
    python evaluate.py --compare outputs/eval/grpo-vanilla outputs/eval/grpo-joint --output_dir outputs/comparison

Every selected task (default: every task of the domain's task set; ``--split`` only assigns groups) is played
``--num_samples`` times by the same episode runner and batched token-level policy agent as training. Results go to
``<output_dir>/<name>[/step-<N>]/results.json`` (+ ``summary.md``); a rerun resumes, and a results file from another
configuration is refused. Any field of a recipe can be overridden on the command line.

Exit status: 0 when every results file is complete, 1 when one is incomplete or has no scored episode (e.g. every
episode failed with ``user_error``), 2 on bad input (one line naming the flag or file), 130 on Ctrl-C (one line; a
rerun resumes).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories: never reach for the Hub

from trl import TrlParser  # noqa: E402

from tau2_rl.configs import EvalArguments  # noqa: E402
from tau2_rl.evaluation import INPUT_ERRORS, run_compare, run_evaluation  # noqa: E402
from tau2_rl.evaluation.evaluator import describe_results  # noqa: E402
from tau2_rl.evaluation.tau2_export import TAU2_INCOMPLETE_FILE, own_part  # noqa: E402
from tau2_rl.rewards.judge import JudgeError  # noqa: E402
from tau2_rl.run.cli import EXIT_INTERRUPTED, INTERRUPTED_LINE, exit_with_line, parse_or_exit  # noqa: E402

logger = logging.getLogger(__name__)


def main(args: EvalArguments) -> list[Path]:
    """Compare mode when ``--compare`` is given, else an evaluation; returns the files written."""
    if args.compare:
        written = run_compare(args.compare, args.output_dir, args.baseline)
        for kind, path in written.items():
            print(f"{kind}: {path}")
        return list(written.values())
    paths = run_evaluation(args)
    for path in paths:
        print(describe_results(path))
    return paths


def unfinished(path: Path) -> str | None:
    """Why a results file is not a finished evaluation (None when it is): episodes missing, none scored, or
    conversations τ²'s models refused in the τ² export next to it (named by task and sample)."""
    metrics = json.loads(path.read_text(encoding="utf-8"))["metrics"]
    tau2_partial = path.parent / TAU2_INCOMPLETE_FILE
    if tau2_partial.is_file():
        refused = own_part(json.loads(tau2_partial.read_text(encoding="utf-8"))).get("rejected", [])
        rejected = ", ".join(f"task {r['task_id']} sample {r['sample']} ({r['error']})" for r in refused)
        if rejected:
            return f"{tau2_partial}: τ²'s models rejected {len(refused)} conversation(s): {rejected}"
    if not metrics.get("valid_episodes"):
        return (
            f"{path}: no episode could be scored ({metrics.get('user_errors', 0)} user_error and "
            f"{metrics.get('agent_errors', 0)} agent_error of {metrics.get('episodes', 0)}); fix the failing endpoint "
            "and rerun to retry them"
        )
    if not metrics.get("complete"):
        wanted = metrics.get("tasks", 0) * metrics.get("num_samples", 0)
        return (
            f"{path}: incomplete ({metrics.get('valid_episodes')} of {wanted} episodes scored, "
            f"{metrics.get('user_errors', 0)} user errors, {metrics.get('agent_errors', 0)} agent errors); rerun the "
            "same command to resume"
        )
    return None


def make_parser() -> TrlParser:
    return TrlParser((EvalArguments,))


def cli(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )
    logging.getLogger("tau2_rl").setLevel(logging.INFO)
    (args,) = parse_or_exit(make_parser(), argv, prog="evaluate.py")
    try:
        paths = main(args)
    except KeyboardInterrupt:  # finished episodes are in results.json already: a rerun resumes after them
        exit_with_line(INTERRUPTED_LINE, EXIT_INTERRUPTED)
    except JudgeError as err:  # an endpoint failed, not the input: exit 1 as for a failing user endpoint (the
        # episodes scored before it are in results.json; a rerun resumes after them)
        print(f"evaluate.py: error: {err}", file=sys.stderr)
        return 1
    except INPUT_ERRORS as err:
        logger.debug("evaluation failed", exc_info=True)
        print(f"evaluate.py: error: {err}", file=sys.stderr)
        return 2
    if not args.compare:  # results that are not a finished evaluation must not look like one to a script
        problems = [problem for path in paths if (problem := unfinished(path))]
        for problem in problems:
            print(f"evaluate.py: error: {problem}", file=sys.stderr)
        if problems:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
