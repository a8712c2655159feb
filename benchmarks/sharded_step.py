"""Step time of the quick start's global batch in 1 process against 2 (DDP and FSDP2), side by side in one run.

    python benchmarks/sharded_step.py            # ~4 min on 2 idle cores; prints one line per launch, then the ratios

Each launch trains ``recipes/grpo/cpu_smoke.yaml`` for ``--steps`` steps (eval off) on the same global batch of 16
episodes: 1 process × 16 rows (``accelerate_configs/cpu.yaml``), then 2 processes × 8 rows with DDP
(``multi_gpu.yaml`` on gloo) and with FSDP2 (``accelerate_configs/cpu_fsdp2.yaml``). The step time is the median of
the trainer's per-step ``step_time`` after the first step (which includes warm-up). On a 2-core CPU two processes
share the same two cores, so the ratio says what the process group and sharding cost, not what a second GPU gains.
The last line starts with the two ratios. Nothing is asserted (machines are noisy); the weights' agreement is
tests/test_sharded.py's job.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = {
    "1 process × 16": (["--config_file", "accelerate_configs/cpu.yaml"], 16),
    "DDP 2 × 8": (["--config_file", "accelerate_configs/multi_gpu.yaml", "--num_processes", "2",
                   "--mixed_precision", "no"], 8),
    "FSDP2 2 × 8": (["--config_file", "accelerate_configs/cpu_fsdp2.yaml"], 8),
}  # fmt: skip


def step_seconds(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / "trainer_state.json").read_text(encoding="utf-8"))
    return [entry["step_time"] for entry in state["log_history"] if "step_time" in entry]


def launch(name: str, launcher: list[str], rows: int, steps: int, work: Path) -> float:
    out = work / name.split()[0].lower()
    argv = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "train_grpo.py",
            "--config", "recipes/grpo/cpu_smoke.yaml", "--per_device_train_batch_size", str(rows),
            "--max_steps", str(steps), "--save_steps", str(10 * steps), "--eval_strategy", "no",
            "--output_dir", str(out), "--run_name", out.name, "--hub_dir", str(work / "hub"),
            "--report_to", "none"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = work / f"{out.name}.log"
    with open(log, "w", encoding="utf-8") as handle:
        done = subprocess.run(argv, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}); its log: {log}")
    seconds = step_seconds(out)[1:] or step_seconds(out)
    median = statistics.median(seconds)
    print(f"{name}: median step {median:.2f} s over {len(seconds)} steps", flush=True)
    return median


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per launch (the first is not timed)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")
    print(f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, python {platform.python_version()}")
    with tempfile.TemporaryDirectory(prefix="sharded-step-") as tmp:
        times = {name: launch(name, launcher, rows, args.steps, Path(tmp)) for name, (launcher, rows) in
                 LAUNCHES.items()}  # fmt: skip
    one = times["1 process × 16"]
    ddp, fsdp = times["DDP 2 × 8"] / one, times["FSDP2 2 × 8"] / one
    print(f"{ddp:.2f}x DDP, {fsdp:.2f}x FSDP2: 2-process step time / 1-process on the same global batch of 16 "
          f"({one:.2f} s in 1 process)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
