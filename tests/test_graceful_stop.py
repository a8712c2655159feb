"""SIGTERM to the ``accelerate launch`` process reaches the trainer: it saves a checkpoint and exits (status 143),
nothing keeps running, and the run is not marked complete. A real launcher and a real short GRPO run (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sft import model_dir  # noqa: F401 (fixture)

from airline_rl.run_guard import RUN_CONFIG_FILE

REPO_ROOT = Path(__file__).resolve().parent.parent


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_and_stops_the_trainer(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml",
        "train_grpo.py", "--model_name_or_path", str(model_dir), "--output_dir", str(out),
        "--hub_dir", str(tmp_path / "hub"), "--tasks", "0", "--task_repeats", "64", "--num_generations", "2",
        "--per_device_train_batch_size", "2", "--max_steps", "40", "--save_steps", "1000", "--max_turns", "2",
        "--max_turn_tokens", "8", "--max_completion_length", "128", "--use_cpu", "true", "--bf16", "false",
        "--report_to", "none", "--variant", "vanilla", "--gradient_checkpointing", "false", "--logging_steps", "1",
    ]  # fmt: skip
    log = (tmp_path / "log.txt").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    launcher = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 400
        while "| loss " not in (tmp_path / "log.txt").read_text() and time.monotonic() < deadline:  # a step line
            assert launcher.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(1)
        (trainer,) = children(launcher.pid)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 240
        while alive(trainer) and time.monotonic() < deadline:
            time.sleep(1)
        assert not alive(trainer), "the training process outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = (tmp_path / "log.txt").read_text()
    assert "SIGTERM received: saving a checkpoint at the end of this step" in text
    assert "rerun the same command to resume" in text
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert checkpoints, text[-3000:]
    step = int(checkpoints[-1].name.split("-")[1])
    assert 1 <= step < 40
    assert not json.loads((out / RUN_CONFIG_FILE).read_text())["completed"]


def test_a_stop_signal_saves_and_stops_at_the_end_of_the_step() -> None:
    from transformers import TrainerControl, TrainerState

    from airline_rl.graceful_stop import STOP_SIGNALS, GracefulStop

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        stop = GracefulStop().install()
        control, state = TrainerControl(), TrainerState(global_step=3)
        stop.on_step_end(None, state, control)
        assert not control.should_save and not control.should_training_stop and not stop.stopped
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the test process keeps running
        stop.on_step_end(None, state, control)
        assert control.should_save and control.should_training_stop
        assert stop.stopped_at == 3 and stop.signal_name == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second signal stops at once
        stop.on_train_end(None, state, control)
        assert all(signal.getsignal(sig) == previous[sig] for sig in STOP_SIGNALS)  # restored after training
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
