"""Does the README's main command learn? Runs the default GRPO recipe for a fixed number of steps and prints the
outcome-reward gain of the last quarter of steps over the first (the last line).

1. Build (or reuse) the warmed default policy (``tau2_rl.data.default_policy``; cached in ``outputs/``), timed.
2. Train ``recipes/grpo/cpu_smoke.yaml`` (joint variant unless ``--variant``) for ``--steps`` steps into a fresh
   ``outputs/cpu-learning-<variant>``, through ``train_grpo.main``: the real trainer, environment, scripted user and
   reward. Timed.
3. Read the run's TensorBoard events, print one row per step, write the learning-curve PNG, print the gain.

Usage: ``OMP_NUM_THREADS=1 python benchmarks/cpu_learning.py [--steps 32] [--variant joint]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_name, "1")

import torch  # noqa: E402

import train_grpo  # noqa: E402
from tau2_rl.data.default_policy import build_default_policy, default_policy_dir  # noqa: E402
from tau2_rl.evaluation.learning_curve import (  # noqa: E402
    CURVE_FILE,
    PANELS,
    plot_learning_curve,
    quarter_gain,
    read_run_scalars,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = REPO_ROOT / "recipes" / "grpo" / "cpu_smoke.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=32, help="GRPO steps (the recipe's max_steps: 32)")
    parser.add_argument("--variant", default="joint")
    parser.add_argument("--outputs", default=str(REPO_ROOT / "outputs"), help="where the run and the cache go")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    output_dir = Path(args.outputs) / f"cpu-learning-{args.variant}"
    shutil.rmtree(output_dir, ignore_errors=True)  # a fresh run, not a resumed one
    argv = [
        "--config", str(RECIPE),
        "--variant", args.variant,
        "--max_steps", str(args.steps),
        "--save_steps", str(args.steps),
        "--output_dir", str(output_dir),
        "--run_name", output_dir.name,
        "--hub_dir", str(Path(args.outputs) / "cpu-learning-hub"),
        "--warmup_cache_dir", str(args.outputs),
    ]  # fmt: skip
    script_args, training_args, model_args = train_grpo.parse_args(argv)

    start = time.perf_counter()
    tasks = [t.strip() for t in script_args.warmup_tasks.split(",")]
    specs = script_args.domain_specs()
    build_default_policy(default_policy_dir(args.outputs, tasks, script_args.warmup_epochs, specs), tasks,
                         epochs=script_args.warmup_epochs, specs=specs)  # fmt: skip
    build_seconds = time.perf_counter() - start
    start = time.perf_counter()
    train_grpo.main(script_args, training_args, model_args)
    train_seconds = time.perf_counter() - start

    scalars = read_run_scalars(output_dir)
    curve = plot_learning_curve(scalars, output_dir / CURVE_FILE, output_dir.name)
    columns = [tag for _, tag in PANELS] + ["train/reward_std", "train/loss"]
    print("\nstep  " + "  ".join(tag.split("/")[-1][:12].rjust(12) for tag in columns))
    by_tag = {tag: dict(scalars.get(tag, [])) for tag in columns}
    for step in sorted(by_tag[PANELS[0][1]]):
        print(f"{step:4d}  " + "  ".join(f"{by_tag[t].get(step, float('nan')):12.3f}" for t in columns))
    outcome = [v for _, v in scalars[PANELS[0][1]]]
    first, last, gain = quarter_gain(outcome)
    loss = [v for _, v in scalars.get("train/loss", [])]
    saturation = [v for _, v in scalars.get(PANELS[3][1], [])]
    truncation = [v for _, v in scalars.get(PANELS[2][1], [])]
    print(f"default policy: {build_seconds:.0f} s (0 when cached); GRPO training: {train_seconds:.0f} s for "
          f"{len(outcome)} steps ({train_seconds / max(len(outcome), 1):.1f} s/step); curve: {curve}")  # fmt: skip
    print(f"steps with non-zero loss: {sum(v != 0 for v in loss)}/{len(loss)}; with group saturation < 1: "
          f"{sum(v < 1 for v in saturation)}/{len(saturation)}; mean truncation rate "
          f"{sum(truncation) / max(len(truncation), 1):.2f}")  # fmt: skip
    print(f"outcome reward: first quarter {first:.3f}, last quarter {last:.3f}")
    print(f"outcome reward gain (last quarter - first quarter): {gain:+.3f}")


if __name__ == "__main__":
    main()
