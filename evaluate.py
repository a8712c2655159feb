"""Evaluate a policy on the τ²-bench airline tasks, or compare evaluations (see docs/metrics.md).

    # the scripted baselines (no model): the oracle must score 1.0, noop shows what refusing everything earns
    python evaluate.py --model oracle --num_samples 1
    python evaluate.py --model noop --num_samples 1
    # checkpoints of a local-hub run, on CPU with the tiny recipe, or on a GPU with vLLM
    python evaluate.py --config recipes/eval/cpu_tiny.yaml
    python evaluate.py --config recipes/eval/gpu_vllm.yaml --model grpo-joint --steps 200,250,300 \
        --user_base_url http://localhost:8001/v1 --user_model Qwen2.5-72B-Instruct-AWQ
    # compare variants and steps: ablation table + two plots
    python evaluate.py --compare outputs/eval/grpo-vanilla outputs/eval/grpo-joint --output_dir outputs/comparison

Every selected task (default: all 50; ``--split`` only assigns groups) is played ``--num_samples`` times by the same
episode runner and batched token-level policy agent as training. Results go to
``<output_dir>/<name>[/step-<N>]/results.json`` (+ ``summary.md``); a rerun resumes, and a results file from another
configuration is refused. Any field of a recipe can be overridden on the command line.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are local directories: never reach for the Hub

from trl import TrlParser  # noqa: E402

from airline_rl.configs import EvalArguments  # noqa: E402
from airline_rl.evaluation import INPUT_ERRORS, run_compare, run_evaluation  # noqa: E402
from airline_rl.evaluation.evaluator import describe_results  # noqa: E402

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


def make_parser() -> TrlParser:
    return TrlParser((EvalArguments,))


def cli(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )
    logging.getLogger("airline_rl").setLevel(logging.INFO)
    (args,) = make_parser().parse_args_and_config(argv)
    try:
        main(args)
    except INPUT_ERRORS as err:
        logger.debug("evaluation failed", exc_info=True)
        print(f"evaluate.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
