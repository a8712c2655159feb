"""The benchmarks, at toy sizes: each mode still plays, and every mode plays the same transcripts.

The benchmarks run by hand (``.ci/run`` lists them; CI ran them until its 90 minutes ran short). A change to a
backend's signature once broke ``benchmarks/rollout_bench.py`` (its timing wrapper dropped the per-row ``seeds``)
while every test passed. These runs take seconds and fail on the same breakage in the default suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _bench(tiny_model_dir: Path, *args: str) -> str:
    command = [sys.executable, "benchmarks/rollout_bench.py", "--model-dir", str(tiny_model_dir)]
    command += ["--episodes", "2", "--turn-tokens", "4", *args]
    done = subprocess.run(
        command, cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_rollout_bench_modes_ci_runs_play_the_same_transcripts(tiny_model_dir: Path) -> None:
    modes = "plain-one,prefix-batched,trl-one,trl-prefix-batched"  # the modes .ci/run lists
    out = _bench(tiny_model_dir, "--modes", modes, "--batch-sizes", "1")
    lines = [line for line in out.splitlines() if "same transcripts as the first mode" in line]
    assert len(lines) == 4, out
    assert all(line.endswith(": 2/2") for line in lines), out
    assert "speed-up of the trainer's rollouts" in out


def test_rollout_bench_horizon_sweep_plays_the_same_transcripts_with_and_without_turn_caching(
    tiny_model_dir: Path,
) -> None:
    out = _bench(tiny_model_dir, "--horizon", "2,4")
    horizons = [line for line in out.splitlines() if line.startswith("horizon ")]
    assert len(horizons) == 2 and all(line.endswith("same transcripts: 2/2") for line in horizons), out
    assert out.strip().splitlines()[-1].endswith("transcripts equal in both modes at every horizon: yes"), out


def test_env_bench_measures_retail_beside_a_runs_step(tmp_path: Path) -> None:
    """benchmarks/env_bench.py --domain retail: our state under τ²'s tools hashes as τ²'s own environment (asserted
    inside), and --run reads a run's environment share of a step from its trainer_state.json."""
    import json

    run = tmp_path / "run" / "checkpoint-2"
    run.mkdir(parents=True)
    shares = ((1, 0.01), (2, 0.03))
    logs = [{"step": s, "step_time": 2.0, "timing/env_user_reward_share": share} for s, share in shares]
    (run / "trainer_state.json").write_text(json.dumps({"log_history": logs}), encoding="utf-8")
    command = [sys.executable, "benchmarks/env_bench.py", "--domain", "retail", "--reps", "1", "--tasks", "4",
               "--run", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, env={**os.environ, **OFFLINE, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "retail database: 1550 records" in done.stdout and "speed-up (naive / fast" in done.stdout
    assert "environment + user + reward 2.00% of a step (median over 2 steps; step 2.00 s" in done.stdout


def test_env_bench_measures_telecom_against_taus_harness() -> None:
    """benchmarks/env_bench.py --domain telecom: an episode in τ²'s own environment on copies of the databases
    (reset with the initialization actions, both sides' gold calls, the assertions) against τ²'s harness per episode;
    the two agree on every task's assertions (asserted inside) and the speed-up is printed last."""
    command = [sys.executable, "benchmarks/env_bench.py", "--domain", "telecom", "--reps", "1", "--tasks", "6"]
    done = subprocess.run(
        command, cwd=ROOT, env={**os.environ, **OFFLINE, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "telecom: 6 tasks" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("speed-up (τ²'s / ours, per-episode medians): ")
