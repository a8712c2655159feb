"""Generation ahead of training: step time at --max_staleness 0, 1, 2, side by side in one run (issue 38).

    python benchmarks/async_step.py                      # every setting and user, k = 0, 1, 2
    python benchmarks/async_step.py --settings balanced --users llm --ks 0,1 --steps 5
    python benchmarks/async_step.py --settings balanced --users llm --ks 0,1 --repeats 3   # median of 3 ratios

Each (setting, k) is one ``train_grpo.py`` run of ``--steps`` steps; the first step (the worker's start, the first
batch nobody can overlap) is left out of the means. Per k it prints the step time, the generation seconds and the
training seconds, the idle shares, and the overlap efficiency (t_gen + t_train − t_step) / min(t_gen, t_train),
where 1.0 is perfect overlap and 0 none. For k = 0 generation is the rollout and training the rest of the step.
For k ≥ 1 generation is the worker's busy share of the step (1 − ``async/generator_idle_share``: its busy time per
batch can run across step boundaries) and training the trainer's own ``timing/optimisation``, without its wait.

Settings, each with two users: ``scripted`` (the recipe's) and ``llm``, the LLM user simulator against the stub
server (tests/openai_stub_server.py) with every reply delayed by a seeded log-normal time (``--user_latency
MEDIAN,SIGMA``, default 0.3,0.5 s, the event-driven loop's benchmark option), as when the user is a 72B model
served elsewhere:
- ``quick_start``: recipes/grpo/cpu_smoke.yaml with one group of 8 episodes per step;
- ``recipe``: the recipe as shipped, two groups (16 episodes) per step;
- ``balanced``: the recipe with six groups (48 episodes) per step, the heavier training phase the issue asks for
  (chosen over ``--num_iterations 2``, whose batch is needed every other step: at k = 1 admission lets it start only
  one step ahead, so it overlaps half its steps, 1.12×). With the LLM user its two phases are within 2× of each
  other at k = 0 (generation 9–11 s, training 5–6.5 s per step on 2 cores).
What overlap can win on a CPU is the time generation leaves a core idle: while it waits on the user, and while its
decoding (small batches, one thread) leaves the second core to the trainer. With the scripted user both phases are
CPU work on the same two cores and the sum of their work bounds the step: expect about 1× there, or less. With k ≥ 1
``train_grpo.py`` sets ``OMP_WAIT_POLICY=PASSIVE`` (tau2_rl/run/omp_wait.py): with libgomp's spinning default the
trainer's idle threads held both cores and generation ahead ran at 0.72× on ``balanced`` with the scripted user. The
last line starts with the k = 1 speed-up over k = 0 on ``balanced`` with the LLM user. Ratios are measured side by
side; absolute seconds depend on the machine and its load. On a small VM the same setting's step time drifts by
±20% between runs minutes apart: ``--repeats N`` plays the k values of a setting in turn N times (k = 0, 1, 2, then
again) and reports the median of the N speed-ups, each from adjacent runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SETTINGS = {
    "quick_start": ["--per_device_train_batch_size", "8"],
    "recipe": [],
    "balanced": ["--per_device_train_batch_size", "48"],
}
USERS = {"scripted": [], "llm": ["--user_simulator", "llm", "--user_model", "stub-model"]}


def run(
    setting: str, user: str, k: int, steps: int, workdir: Path, user_url: str | None, repeat: int = 0
) -> dict[str, float]:
    out = workdir / f"{setting}-{user}-k{k}-r{repeat}"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml",
        "train_grpo.py", "--config", "recipes/grpo/cpu_smoke.yaml", "--max_steps", str(steps),
        "--max_staleness", str(k), "--output_dir", str(out), "--run_name", out.name,
        "--hub_dir", str(workdir / "hub"), "--eval_strategy", "no", "--save_steps", str(steps), *SETTINGS[setting],
    ]  # fmt: skip
    if USERS[user]:
        command += [*USERS[user], "--user_base_url", str(user_url)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {setting} ({user} user) k={k} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    history = json.loads((out / f"checkpoint-{steps}" / "trainer_state.json").read_text())["log_history"]
    rows = [entry for entry in history if "step_time" in entry][1:]  # the first step overlaps nothing
    step = statistics.fmean(r["step_time"] for r in rows)
    if k == 0:
        gen = statistics.fmean(r.get("timing/rollout", 0.0) for r in rows)
        train = step - gen
        gen_idle, train_idle = 1.0 - gen / step, gen / step
    else:
        gen_idle = statistics.fmean(r["async/generator_idle_share"] for r in rows)
        gen = step * (1.0 - gen_idle)
        wait = statistics.fmean(r.get("async/trainer_wait_seconds", 0.0) for r in rows)
        train = statistics.fmean(r["timing/optimisation"] for r in rows)  # the trainer's own work, no waiting
        train_idle = wait / step
    overlap = (gen + train - step) / min(gen, train) if min(gen, train) > 0 else 0.0
    staleness = max((r.get("async/staleness_max", 0.0) for r in history if "step_time" in r), default=0.0)
    return {"step": step, "gen": gen, "train": train, "gen_idle": gen_idle, "train_idle": train_idle,
            "overlap": overlap, "staleness_max": staleness}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated: {', '.join(SETTINGS)}")
    parser.add_argument("--users", default="scripted,llm", help=f"comma-separated: {', '.join(USERS)}")
    parser.add_argument("--ks", default="0,1,2", help="comma-separated --max_staleness values (0 is the baseline)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1, help="play each setting's k values in turn this many times")
    parser.add_argument("--user_latency", default="0.3,0.5", metavar="MEDIAN,SIGMA",
                        help="llm user: the stub server's seeded log-normal reply delay, in seconds")  # fmt: skip
    args = parser.parse_args()
    settings = [s for s in args.settings.split(",") if s]
    users = [u for u in args.users.split(",") if u]
    for flag, names, valid in (("--settings", settings, SETTINGS), ("--users", users, USERS)):
        unknown = [name for name in names if name not in valid]
        if unknown or not names:
            raise SystemExit(f"error: {flag}: unknown {unknown or names}; valid: {sorted(valid)}")
    try:
        ks = [int(k) for k in args.ks.split(",")]
        median, sigma = (float(x) for x in args.user_latency.split(","))
        if median <= 0 or sigma < 0 or min(ks) < 0 or args.steps < 2 or args.repeats < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(
            "error: --ks takes integers >= 0, --user_latency MEDIAN,SIGMA (median > 0, sigma >= 0), --steps >= 2, "
            "--repeats >= 1"
        ) from None
    from tests.openai_stub_server import StubServer  # noqa: PLC0415 - the test tree's stub, as rollout_bench

    runs: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        url = stack.enter_context(StubServer("echo", latency=(median, sigma))).base_url if "llm" in users else None
        for setting in settings:
            for user in users:
                for repeat in range(args.repeats):
                    for k in ks:
                        r = run(setting, user, k, args.steps, tmp, url, repeat)
                        runs.setdefault((setting, user, k), []).append(r)
                        print(f"{setting:11s} {user:8s} k={k}: step {r['step']:6.2f} s | gen {r['gen']:6.2f} s | "
                              f"train {r['train']:6.2f} s | idle gen {r['gen_idle']:.2f} train {r['train_idle']:.2f} "
                              f"| overlap {r['overlap']:.2f} | staleness max {r['staleness_max']:.0f}",
                              flush=True)  # fmt: skip

    def gain(setting: str, user: str, k: int) -> tuple[float, list[float], dict[str, float]]:
        """The median speed-up of k over k = 0 (each repeat's adjacent runs), the speed-ups, the median run."""
        gains = [b["step"] / r["step"] for b, r in zip(runs[setting, user, 0], runs[setting, user, k], strict=True)]
        middle = sorted(range(len(gains)), key=gains.__getitem__)[(len(gains) - 1) // 2]
        return statistics.median(gains), gains, runs[setting, user, k][middle]

    def spread(gains: list[float]) -> str:
        return f" (median of {', '.join(f'{g:.2f}' for g in gains)})" if len(gains) > 1 else ""

    for setting, user, k in runs:
        if k > 0 and (setting, user, 0) in runs and (setting, user) != ("balanced", "llm"):
            median_gain, gains, r = gain(setting, user, k)
            print(f"{setting} ({user} user): k={k} speed-up over k=0 {median_gain:.2f}x{spread(gains)} "
                  f"(overlap {r['overlap']:.2f})")  # fmt: skip
    if ("balanced", "llm", 0) in runs and ("balanced", "llm", 1) in runs:
        one_gain, gains, one = gain("balanced", "llm", 1)
        base = runs["balanced", "llm", 0][gains.index(sorted(gains)[(len(gains) - 1) // 2])]
        also = f"; k=2 {gain('balanced', 'llm', 2)[0]:.2f}x" if ("balanced", "llm", 2) in runs else ""
        print(f"{one_gain:.2f}x: the k=1 speed-up over k=0 on the balanced setting{spread(gains)} (LLM stub user, "
              f"replies {median:g} s median; k=0 generation {base['gen']:.2f} s, training {base['train']:.2f} s per "
              f"step, {max(base['gen'], base['train']) / max(min(base['gen'], base['train']), 1e-9):.2f}x apart; "
              f"overlap efficiency {one['overlap']:.2f}{also})")  # fmt: skip


if __name__ == "__main__":
    main()
