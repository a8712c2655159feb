"""Generation ahead of training: step time at --max_staleness 0, 1, 2, side by side in one run (issue 38).

    python benchmarks/async_step.py                      # the quick start and the balanced setting, k = 0, 1, 2
    python benchmarks/async_step.py --settings balanced --steps 6 --ks 0,1

Each (setting, k) is one ``train_grpo.py`` run (scripted user) of ``--steps`` steps; the first step (the worker's
start, the first batch nobody can overlap) is left out of the means. Per k it prints the step time, the generation
seconds (the rollout for k = 0, the worker's busy time for k ≥ 1) and the training seconds (the step minus the
rollout for k = 0, the trainer's ``timing/optimisation`` for k ≥ 1: its own work without the wait), the idle
shares, and the overlap efficiency (t_gen + t_train − t_step) / min(t_gen, t_train), where 1.0 is perfect
overlap and 0 none.

Settings: ``quick_start`` is recipes/grpo/cpu_smoke.yaml with one group per step; ``balanced`` makes the training
phase as heavy as the rollout (``--num_iterations 2``: each batch is trained for two optimiser steps, which also
halves how often the worker must play). The last line starts with the k = 1 speed-up over k = 0 on ``balanced``.
Ratios are measured side by side; absolute seconds depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "quick_start": ["--per_device_train_batch_size", "8"],
    "balanced": ["--per_device_train_batch_size", "8", "--num_iterations", "2"],
}


def run(setting: str, k: int, steps: int, workdir: Path) -> dict[str, float]:
    out = workdir / f"{setting}-k{k}"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml",
        "train_grpo.py", "--config", "recipes/grpo/cpu_smoke.yaml", "--max_steps", str(steps),
        "--max_staleness", str(k), "--output_dir", str(out), "--run_name", out.name,
        "--hub_dir", str(workdir / "hub"), "--eval_strategy", "no", "--save_steps", str(steps), *SETTINGS[setting],
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {setting} k={k} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    history = json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())["log_history"]
    rows = [entry for entry in history if "step_time" in entry][1:]  # the first step overlaps nothing
    step = statistics.fmean(r["step_time"] for r in rows)
    if k == 0:
        # a step without generation (num_iterations 2) has no rollout entry: its generation time is 0
        gen = statistics.fmean(r.get("timing/rollout", 0.0) for r in rows)
        train = step - gen
        gen_idle, train_idle = 1.0 - gen / step, gen / step
    else:
        gen = statistics.fmean(r.get("async/generator_busy_seconds", 0.0) for r in rows)
        wait = statistics.fmean(r.get("async/trainer_wait_seconds", 0.0) for r in rows)
        train = statistics.fmean(r["timing/optimisation"] for r in rows)  # the trainer's own work, no waiting
        gen_idle, train_idle = max(0.0, 1.0 - gen / step), wait / step
    overlap = (gen + train - step) / min(gen, train) if min(gen, train) > 0 else 0.0
    return {"step": step, "gen": gen, "train": train, "gen_idle": gen_idle, "train_idle": train_idle,
            "overlap": overlap}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="quick_start,balanced")
    parser.add_argument("--ks", default="0,1,2")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"error: --settings: unknown {unknown}; valid: {sorted(SETTINGS)}")
    ks = [int(k) for k in args.ks.split(",")]
    results: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setting in settings:
            for k in ks:
                results[setting, k] = r = run(setting, k, args.steps, Path(tmp))
                print(f"{setting:12s} k={k}: step {r['step']:6.2f} s | gen {r['gen']:6.2f} s | train "
                      f"{r['train']:6.2f} s | idle gen {r['gen_idle']:.2f} train {r['train_idle']:.2f} | overlap "
                      f"{r['overlap']:.2f}", flush=True)  # fmt: skip
    for setting in settings:
        if (setting, 0) in results and (setting, 1) in results and setting != "balanced":
            print(f"{setting}: k=1 speed-up over k=0 {results[setting, 0]['step'] / results[setting, 1]['step']:.2f}x")
    if ("balanced", 0) in results and ("balanced", 1) in results:
        base, one = results["balanced", 0], results["balanced", 1]
        print(f"{base['step'] / one['step']:.2f}x: the k=1 speed-up over k=0 on the balanced setting (overlap "
              f"efficiency {one['overlap']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
