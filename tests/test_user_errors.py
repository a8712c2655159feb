"""GRPO with a user simulator that fails: checked where the run starts, no update from a step of nothing but user
errors, and a stop (checkpoint kept, exit 1, one line naming the endpoint) after ``max_user_error_steps`` such steps.

The command-line tests run ``train_grpo.py`` against the local OpenAI stub (tests/openai_stub_server.py) with the
tiny model; shrunk as in tests/test_trainer.py (one group of 4 episodes per step, 8-token turns, the compact prompt).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from openai_stub_server import StubServer
from test_trainer import REPO_ROOT, make_trainer
from transformers import AutoModelForCausalLM, TrainerCallback

from tau2_rl.envs.users import get_user_simulator
from tau2_rl.envs.users.base import UserReply, UserSimulator
from tau2_rl.run.console import format_step_line, summary_line

pytestmark = pytest.mark.usefixtures("single_thread")


class FailingAfterFirstStep(UserSimulator):
    """The scripted user until the first optimiser step is done, then an endpoint that fails every request."""

    name = "failing"

    def __init__(self) -> None:
        self.scripted = get_user_simulator("scripted")
        self.failing = False

    def reply(self, episode) -> UserReply:
        if self.failing:
            return UserReply(error="LLM user simulator (stub at http://127.0.0.1:1/v1) failed: HTTP 500: down")
        return self.scripted.reply(episode)


class Snapshot(TrainerCallback):
    """Keeps the weights after step 1 and turns the user off from then on."""

    def __init__(self, user: FailingAfterFirstStep) -> None:
        self.user = user
        self.after_first: list[torch.Tensor] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.after_first = [p.detach().clone() for p in model.parameters()]
            self.user.failing = True


def test_a_user_error_step_leaves_weights_and_optimizer_alone(tmp_path, tiny_model, tiny_tokenizer, short_env):
    # weight decay and Adam's momentum from step 1 would both move the weights at step 2 if the optimiser stepped
    trainer = make_trainer(
        tmp_path, "vanilla", tiny_model, tiny_tokenizer, short_env, max_steps=4, max_user_error_steps=2,
        weight_decay=0.1,
    )  # fmt: skip
    user = FailingAfterFirstStep()
    trainer.user = user
    snapshot = Snapshot(user)
    trainer.add_callback(snapshot)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()

    assert any(not torch.equal(b, a) for b, a in zip(before, snapshot.after_first, strict=True))  # step 1 trained
    for after_first, now in zip(snapshot.after_first, trainer.model.parameters(), strict=True):
        assert torch.equal(after_first, now.detach())  # steps 2 and 3 did not move anything
    steps = {int(state["step"]) for state in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {1}  # Adam stepped once: the user-error steps did not touch its state either
    assert trainer.user_error_stop.stopped_at == 3 and trainer.state.global_step == 3  # 2 in a row: stop
    # The choice this pins (README, "Training"): a step without update still counts as a step of --max_steps and of
    # the LR schedule, as a step of the Trainer's clock; only the optimiser's own state (Adam's step) skips it.
    assert trainer.lr_scheduler.last_epoch == 3
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["train/user_error_skip"] for e in logged] == [0.0, 1.0, 1.0]
    assert [e["episode/user_sim_errors"] for e in logged] == [0.0, 4.0, 4.0]
    assert (trainer.user_error_episodes, trainer.episodes_played) == (8, 12)
    assert "HTTP 500: down" in trainer.last_user_error


def test_step_line_and_summary_show_user_errors() -> None:
    logs = {"episode/outcome_reward": 0.0, "loss": 0.0, "episode/user_sim_errors": 16.0, "train/user_error_skip": 1.0}
    line = format_step_line(2, 4, logs, 1.5)
    assert "user errors 16" in line and "no update (every episode a user error)" in line
    clean = format_step_line(1, 4, {"episode/outcome_reward": 0.5, "loss": 0.1, "episode/user_sim_errors": 0.0}, 1.0)
    assert "user errors" not in clean and "no update" not in clean
    history = [{"step": 1, "loss": 0.1, "train/user_error_skip": 0.0}, {"step": 2, "loss": 0.0, **logs}]
    summary = summary_line(history, "/nonexistent", None, None, None, user_errors=(16, 32))
    assert summary.startswith("done: 2 steps (1 without update: every episode a user error; each counts in "
                              "--max_steps and in the LR schedule)")  # fmt: skip
    assert "user errors 16 of 32 episodes" in summary
    assert "user errors" not in summary_line(history[:1], "/nonexistent", None, None, None, user_errors=(0, 16))


# ---------------------------------------------------------------------------------------------------------------------
# the command line


def grpo_command(tmp_path: Path, model_dir: Path, base_url: str, *extra: str) -> list[str]:
    return [
        sys.executable, str(REPO_ROOT / "train_grpo.py"),
        "--config", str(REPO_ROOT / "recipes/grpo/cpu_smoke.yaml"),
        "--model_name_or_path", str(model_dir),
        "--compact_prompt", "true",  # a one-line system prompt: every forward is cheap
        "--output_dir", str(tmp_path / "run"),
        "--run_name", "user-errors",
        "--hub_dir", str(tmp_path / "hub"),
        "--user_simulator", "llm", "--user_base_url", base_url, "--user_model", "stub-model",
        "--user_max_retries", "0", "--user_timeout", "5",  # a failed request is a user error at once
        "--tasks", "3", "--task_repeats", "8",
        "--num_generations", "4", "--per_device_train_batch_size", "4",  # shrunk from 8 × 16: one group per step
        "--max_turns", "2", "--max_turn_tokens", "8", "--max_completion_length", "256",  # shrunk
        "--max_steps", "6", "--save_steps", "100",
        "--max_user_error_steps", "2",
        "--eval_strategy", "no", "--report_to", "none",
        *extra,
    ]  # fmt: skip


def child_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def test_an_unreachable_user_endpoint_fails_before_training(tmp_path, tiny_model_dir) -> None:
    command = grpo_command(tmp_path, tiny_model_dir, "http://127.0.0.1:9/v1")
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    expected = "train_grpo.py: error: The LLM user simulator endpoint http://127.0.0.1:9/v1/models is unreachable"
    assert last.startswith(expected), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()  # no model loaded, nothing claimed


def assert_stopped_for_user_errors(done: subprocess.CompletedProcess, tmp_path: Path, base_url: str, step: int):
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: the user simulator at --user_base_url {base_url} failed every episode of 2 "
                           "consecutive step(s)"), last  # fmt: skip
    assert f"stopped at step {step}" in last and f"checkpoint saved in {tmp_path / 'run'}/checkpoint-{step}" in last
    assert "Traceback" not in done.stderr
    assert (tmp_path / "run" / f"checkpoint-{step}").is_dir()
    assert "done:" not in done.stdout  # no summary of a finished run
    assert not list((tmp_path / "hub").glob("user-errors/step-*"))  # nothing published as a trained model
    state = json.loads((tmp_path / "run" / f"checkpoint-{step}" / "trainer_state.json").read_text())
    logged = [e for e in state["log_history"] if "loss" in e]
    assert [e["train/user_error_skip"] for e in logged][-2:] == [1.0, 1.0]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == step and all("user errors 4 | no update" in line for line in lines[-2:]), lines
    return last, lines


def test_an_endpoint_answering_http_500_stops_the_run_without_updates(tmp_path, tiny_model_dir) -> None:
    with StubServer("error") as server:  # GET /models answers, every chat request is an HTTP 500
        base_url = server.base_url
        done = subprocess.run(
            grpo_command(tmp_path, tiny_model_dir, base_url),
            env=child_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    last, _ = assert_stopped_for_user_errors(done, tmp_path, base_url, step=2)
    assert "HTTP 500" in last and "8 of 8 episodes of this run were user errors" in last
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoint-2").state_dict()
    assert all(torch.equal(initial[name], tensor) for name, tensor in saved.items())  # no step updated anything


def test_an_endpoint_that_dies_mid_run_stops_the_run(tmp_path, tiny_model_dir) -> None:
    server = StubServer("stop", stop_after=1).start()  # answers, and ends each conversation after one reply
    base_url = server.base_url
    child = subprocess.Popen(
        grpo_command(tmp_path, tiny_model_dir, base_url),
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.append(child.stderr.read()), daemon=True)
    reader.start()
    out: list[str] = []
    try:
        for line in child.stdout:
            out.append(line)
            if line.startswith("step 1/"):
                server.stop()  # the endpoint goes away after the first step: connection refused from now on
        child.wait(timeout=600)
    finally:
        server.stop()
        if child.poll() is None:
            child.kill()
    reader.join(timeout=10)
    done = subprocess.CompletedProcess(child.args, child.returncode, "".join(out), "".join(errors))
    _, lines = assert_stopped_for_user_errors(done, tmp_path, base_url, step=3)
    assert "user errors" not in lines[0]  # step 1 played real episodes
