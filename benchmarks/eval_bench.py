"""Evaluation throughput: batched rollouts against one episode at a time, on the tiny model and the seed test split.

Both sides run the real evaluator (``tau2_rl.evaluation.run_evaluation``: ``run_episodes`` + ``TokenPolicyAgent``
over ``TransformersBackend``, scripted user) on the same episodes; the only difference is ``--batch_size``:

- batched: all (task, sample) episodes in one ``run_episodes`` call, so every wave is one batched ``generate``;
- one at a time: ``batch_size 1``, one ``run_episodes`` call (and one ``generate`` per turn) per episode.

The tiny random-weight model (vocab 1024) rarely emits its end-of-turn token, so most episodes run until the token
budget cuts a turn: the benchmark measures the generation path, not the policy. Prefix reuse of the shared system
prompt is on for both sides (``--no-prefix-cache`` turns it off for both). Prints both times and the ratio (target:
at least 4×).

Both sides use one torch thread by default (``--threads``): the tiny model's operations are too small to split, and
on a shared 2-core machine OpenMP threads spin waiting for each other, which makes timings swing by 10×.

Usage: ``python benchmarks/eval_bench.py [--samples 4] [--turn-tokens 32] [--episode-tokens 512] [--tasks ...]``.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tau2_rl.configs import EvalArguments  # noqa: E402
from tau2_rl.data.tiny_model import build_tiny_model  # noqa: E402
from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.domains.airline.tools import TOOL_SCHEMAS  # noqa: E402
from tau2_rl.envs.episode import DomainEnv  # noqa: E402
from tau2_rl.envs.splits import get_split  # noqa: E402
from tau2_rl.evaluation import run_evaluation  # noqa: E402

AIRLINE = get_domain("airline")


def tiny_model(directory: Path) -> Path:
    env = DomainEnv(AIRLINE)
    return build_tiny_model(directory, vocab_size=1024, extra_texts=[env.system_prompt, *map(str, TOOL_SCHEMAS)])


def timed_run(
    model: Path, tasks: list[str], batch_size: int, options: argparse.Namespace, out: Path
) -> tuple[float, dict]:
    args = EvalArguments(
        model=str(model),
        tasks=",".join(tasks),
        num_samples=options.samples,
        max_turn_tokens=options.turn_tokens,
        max_new_tokens=options.episode_tokens,
        max_turns=options.max_turns,
        batch_size=batch_size,
        prefix_cache=not options.no_prefix_cache,
        shared_prefix_attention=not (options.no_prefix_cache or options.materialised_prefix),
        device="cpu",
        dtype="float32",
        output_dir=str(out),
        progress=False,
        bootstrap_samples=100,
    )
    start = time.perf_counter()
    (path,) = run_evaluation(args)
    seconds = time.perf_counter() - start
    return seconds, json.loads(path.read_text(encoding="utf-8"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4, help="episodes per task")
    # budgets of the CPU smoke recipes (recipes/grpo/cpu_smoke.yaml, recipes/eval/cpu_tiny.yaml)
    parser.add_argument("--turn-tokens", type=int, default=64, help="--max_turn_tokens")
    parser.add_argument("--episode-tokens", type=int, default=1536, help="--max_new_tokens (whole episode)")
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument(
        "--tasks", default=None, help="comma-separated task ids (default: the seed split's test tasks)"
    )
    parser.add_argument("--no-prefix-cache", action="store_true", help="no prefix reuse at all (both sides)")
    parser.add_argument(
        "--materialised-prefix", action="store_true", help="reuse the prefix by copying it into every row (both sides)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="alternating repeats; the best time of each counts")
    parser.add_argument("--model-dir", default=None, help="where the tiny model is built (default: a temp dir)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for both sides (0: torch's default)"
    )
    options = parser.parse_args()
    if options.threads:
        import torch

        torch.set_num_threads(options.threads)
    logging.basicConfig(level=logging.WARNING)

    tasks = options.tasks.split(",") if options.tasks else list(get_split("seed", AIRLINE.split_file()).test)
    prefix = "off" if options.no_prefix_cache else "materialised" if options.materialised_prefix else "shared"
    with tempfile.TemporaryDirectory(prefix="eval-bench-") as tmp:
        model = tiny_model(Path(options.model_dir or Path(tmp) / "tiny-1024"))
        print(f"tiny model {model}; tasks {','.join(tasks)} × {options.samples} samples = "
              f"{len(tasks) * options.samples} episodes; turn budget {options.turn_tokens} tokens; prefix reuse "
              f"{prefix}; torch threads {__import__('torch').get_num_threads()}")  # fmt: skip
        batched_times, sequential_times = [], []
        for repeat in range(options.repeats):  # alternate the two, so that a busy spell on the host hits both
            seconds, batched_data = timed_run(model, tasks, 0, options, Path(tmp) / f"batched-{repeat}")
            batched_times.append(seconds)
            print(f"batched (one run_episodes call, {batched_data['runs'][0]['waves']} waves): {seconds:.1f} s; "
                  f"split {batched_data['runs'][0]['timings']}")  # fmt: skip
            seconds, sequential_data = timed_run(model, tasks, 1, options, Path(tmp) / f"sequential-{repeat}")
            sequential_times.append(seconds)
            print(f"one episode at a time ({sequential_data['runs'][0]['waves']} waves): {seconds:.1f} s; "
                  f"split {sequential_data['runs'][0]['timings']}")  # fmt: skip
        batched, sequential = min(batched_times), min(sequential_times)
    for name, data in (("batched", batched_data), ("sequential", sequential_data)):
        metrics = data["metrics"]
        print(f"  {name}: {metrics['episodes']} episodes, {metrics['turns_per_episode']:.2f} turns/episode, "
              f"p50 {metrics['reasoning_depth_p50']} tokens/turn, terminations {metrics['terminations']}")  # fmt: skip
    print(f"best of {options.repeats}: batched {batched:.1f} s, one at a time {sequential:.1f} s")
    print(f"speed-up (one at a time / batched): {sequential / batched:.2f}x (target >= 4x)")


if __name__ == "__main__":
    main()
