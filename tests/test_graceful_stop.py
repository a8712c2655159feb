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

from tau2_rl.run.guard import RUN_CONFIG_FILE

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


def wait_for_a_step(launcher: subprocess.Popen, log: Path) -> list[int]:
    """Waits for the first step line; returns the launcher's training processes."""
    deadline = time.monotonic() + 400
    while "| loss " not in log.read_text() and time.monotonic() < deadline:
        assert launcher.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    return children(launcher.pid)


def wait_until_gone(launcher: subprocess.Popen, trainers: list[int]) -> None:
    launcher.wait(timeout=120)
    deadline = time.monotonic() + 240
    while any(alive(pid) for pid in trainers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(pid) for pid in trainers), "a training process outlived its launcher"


def sigterm_after_a_step(launcher: subprocess.Popen, log: Path, pause: float = 0.0) -> None:
    """SIGTERM to the launcher once the first step line is logged (and ``pause`` seconds more); waits until the
    launcher and its training processes are gone, killing the launcher if anything fails on the way."""
    try:
        trainers = wait_for_a_step(launcher, log)
        time.sleep(pause)
        launcher.send_signal(signal.SIGTERM)
        wait_until_gone(launcher, trainers)
    finally:
        if launcher.poll() is None:
            launcher.kill()


LAUNCHERS = {
    "simple": ["--config_file", "accelerate_configs/cpu.yaml"],  # accelerate's own child process
    "torchrun": ["--config_file", "accelerate_configs/multi_gpu.yaml", "--num_processes", "2",
                 "--mixed_precision", "no"],  # torchrun's agent and two ranks (gloo on CPU)
}  # fmt: skip


# CI runs the two deliveries that reach a rank twice (the group's signal and the launcher's relay; torchrun's
# forwarding and a direct signal to each rank). SIGTERM to the launcher alone is CI's in tests/test_sharded.py (the
# simple launcher: the orphaned-trainer test; torchrun: FSDP2 stopped and resumed) and tests/test_generation_ahead.py
# (torchrun); the other four cases repeat those here (-m exhaustive).
DELIVERIES = [
    ("simple", "process_group"),
    ("torchrun", "every_process"),
    *(pytest.param(launch, target, marks=pytest.mark.exhaustive)
      for launch, target in (("simple", "launcher"), ("simple", "every_process"), ("torchrun", "launcher"),
                             ("torchrun", "process_group"))),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize(("launch", "target"), DELIVERIES)
def test_sigterm_checkpoints_and_stops_the_trainer(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
    launch: str,
    target: str,
) -> None:
    """``launcher``: ``kill <accelerate pid>``. ``process_group``: the launcher's process group, as the ablation driver
    and a terminal do (torchrun's ranks live in their own sessions). ``every_process``: the launcher and each rank, as
    SLURM's ``scancel`` and a container stop do. A rank then also gets the launcher's relayed SIGTERM (its
    parent-death signal, or torchrun's forwarding), which must not count as a second, "stop now" signal."""
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "accelerate.commands.launch", *LAUNCHERS[launch],
        "train_grpo.py", "--model_name_or_path", str(model_dir), "--output_dir", str(out),
        "--hub_dir", str(tmp_path / "hub"), "--tasks", "0", "--task_repeats", "64", "--num_generations", "2",
        "--per_device_train_batch_size", "2", "--max_steps", "40", "--save_steps", "1000", "--max_turns", "2",
        "--max_turn_tokens", "8", "--max_completion_length", "128", "--use_cpu", "true", "--bf16", "false",
        "--report_to", "none", "--variant", "vanilla", "--gradient_checkpointing", "false", "--logging_steps", "1",
    ]  # fmt: skip
    log = (tmp_path / "log.txt").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    launcher = subprocess.Popen(
        argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=target == "process_group"
    )
    try:
        trainers = wait_for_a_step(launcher, tmp_path / "log.txt")
        assert len(trainers) == (2 if launch == "torchrun" else 1), trainers
        if target == "process_group":
            os.killpg(launcher.pid, signal.SIGTERM)
        elif target == "every_process":
            for pid in [launcher.pid, *trainers]:
                os.kill(pid, signal.SIGTERM)
        else:
            launcher.send_signal(signal.SIGTERM)
        wait_until_gone(launcher, trainers)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = (tmp_path / "log.txt").read_text()
    assert "SIGTERM received: saving a checkpoint at the end of this step" in text
    assert "SIGTERM again" not in text, text[-3000:]  # the launcher's relays of the one signal say nothing
    assert "rerun the same command to resume" in text, text[-3000:]
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert checkpoints, text[-3000:]
    step = int(checkpoints[-1].name.split("-")[1])
    assert 1 <= step < 40
    assert (checkpoints[-1] / "trainer_state.json").is_file(), text[-3000:]  # the whole checkpoint, not a torso
    assert not json.loads((out / RUN_CONFIG_FILE).read_text())["completed"]


@pytest.mark.slow
@pytest.mark.serial
def test_sigterm_with_user_requests_in_flight_checkpoints_and_stops(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    """The event-driven loop against the LLM user with reply delays (median 0.3 s, σ 1: requests are in flight at any
    moment of a rollout): SIGTERM to the launcher still ends the step, saves and exits 143 with the usual lines."""
    from openai_stub_server import StubServer

    out = tmp_path / "out"
    with StubServer("echo", latency=(0.3, 1.0)) as server:
        argv = [
            sys.executable, "-m", "accelerate.commands.launch", *LAUNCHERS["simple"],
            "train_grpo.py", "--model_name_or_path", str(model_dir), "--output_dir", str(out),
            "--hub_dir", str(tmp_path / "hub"), "--tasks", "0,1", "--task_repeats", "64", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--max_steps", "40", "--save_steps", "1000", "--max_turns", "3",
            "--max_turn_tokens", "8", "--max_completion_length", "256", "--use_cpu", "true", "--bf16", "false",
            "--report_to", "none", "--variant", "vanilla", "--gradient_checkpointing", "false", "--logging_steps", "1",
            "--user_simulator", "llm", "--user_base_url", server.base_url, "--user_model", server.model,
        ]  # fmt: skip
        log_path = tmp_path / "log.txt"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
        with log_path.open("w") as log:
            launcher = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        sigterm_after_a_step(launcher, log_path, pause=1.0)  # into the next step's rollout, replies on their way
    text = log_path.read_text()
    assert "SIGTERM received: saving a checkpoint at the end of this step" in text
    assert "SIGTERM again" not in text, text[-3000:]
    assert "rerun the same command to resume" in text, text[-3000:]
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert checkpoints and (checkpoints[-1] / "trainer_state.json").is_file(), text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_a_stop_signal_saves_and_stops_at_the_end_of_the_step() -> None:
    from transformers import TrainerControl, TrainerState

    from tau2_rl.run.stop import STOP_SIGNALS, GracefulStop

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
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher relays the same stop: absorbed, not fatal
        assert stop.signal_name == "SIGTERM" and stop.stopped_at == 3
        stop.on_train_end(None, state, control)
        assert all(signal.getsignal(sig) == previous[sig] for sig in STOP_SIGNALS)  # restored after training
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_one_signal_delivered_twice_reads_as_one_and_a_later_one_as_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 51.1: one ``kill -TERM <accelerate pid>`` printed "SIGTERM received" and, 4 ms later, "SIGTERM again".
    The trainer got the one stop twice (the launcher's parent-death signal, once per launcher thread: see the next
    test); whatever relays it, a copy within ``RELAY_WINDOW_S`` says nothing, and the user's own second signal, later,
    one line."""
    from tau2_rl.run import stop as graceful_stop
    from tau2_rl.run.stop import STOP_SIGNALS, GracefulStop

    clock = [100.0]
    monkeypatch.setattr(graceful_stop.time, "monotonic", lambda: clock[0])
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    caplog.set_level("WARNING", logger="tau2_rl.run.stop")
    try:
        stop = GracefulStop().install()
        os.kill(os.getpid(), signal.SIGTERM)
        clock[0] += 0.004  # the relayed copy, 4 ms later
        os.kill(os.getpid(), signal.SIGTERM)
        clock[0] += 0.05  # and one more by another path (a group signal and its relay, a SIGUSR1 whose launcher died)
        os.kill(os.getpid(), signal.SIGUSR1)
        lines = [record.getMessage() for record in caplog.records if record.name == "tau2_rl.run.stop"]
        assert len(lines) == 1 and lines[0].startswith("SIGTERM received: saving a checkpoint"), lines
        assert stop.signal_name == "SIGTERM"
        clock[0] += graceful_stop.RELAY_WINDOW_S  # the user's second signal
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        lines = [record.getMessage() for record in caplog.records if record.name == "tau2_rl.run.stop"]
        assert len(lines) == 2 and lines[1].startswith("SIGTERM again: already stopping"), lines
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


PARENT_DEATH_PER_THREAD = """
import ctypes, os, signal, threading, time
libc = ctypes.CDLL(None, use_errno=True)
ready_r, ready_w = os.pipe()
if os.fork() == 0:  # the trainer: counts its SIGTERMs, prints the count (the test reads stdout to its end)
    got = []
    signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG, as die_with_launcher
    os.write(ready_w, b"x")
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    print(len(got), flush=True)
    os._exit(0)
os.read(ready_r, 1)
def other_thread():  # the launcher's second thread ends a moment after the one that started the trainer
    time.sleep(0.3)
    os._exit(0)
threading.Thread(target=other_thread).start()
libc.pthread_exit(None)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launchers_death_relays_the_parent_death_signal_once_per_launcher_thread() -> None:
    """Why one ``kill <accelerate pid>`` reached the trainer twice: the kernel sends the parent-death signal when the
    thread that forked the trainer ends, and again when the launcher's last thread ends (accelerate's launcher has
    two). A two-thread "launcher" in plain Python (no torch: a fraction of a second) whose threads end 0.3 s apart."""
    done = subprocess.run([sys.executable, "-c", PARENT_DEATH_PER_THREAD], capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "2", (done.stdout, done.stderr)


def test_a_step_longer_than_half_of_torchruns_grace_warns_once_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tau2_rl.run.stop import GracefulStop

    for name in ("TORCHELASTIC_RUN_ID", "PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert GracefulStop().check_grace(1000.0) is None  # not under torchrun: nobody kills us after a deadline

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    stop = GracefulStop()
    assert stop.grace_s == 30.0 and stop.check_grace(14.0) is None
    warning = stop.check_grace(140.0)
    assert warning is not None and "took 140 s" in warning and "30 s after a stop signal" in warning
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=420" in warning  # about three steps, in whole minutes
    assert stop.check_grace(500.0) is None  # once

    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "900")
    assert GracefulStop().check_grace(400.0) is None
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "60")  # torchrun's --shutdown_timeout wins over the variable
    assert GracefulStop().grace_s == 60.0


def test_torch_reads_the_shutdown_timeout_this_project_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard for torch upgrades: the variable the docs and the ablation driver set is the one torchrun reads."""
    from torch.distributed.launcher.api import LaunchConfig

    from tau2_rl.run.torchrun import SHUTDOWN_TIMEOUT_ENV

    monkeypatch.setenv(SHUTDOWN_TIMEOUT_ENV, "900")
    assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2).shutdown_timeout == 900


def test_a_first_ctrl_c_stops_like_sigterm_and_a_second_stops_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 23.4: Ctrl-C printed two KeyboardInterrupt tracebacks and lost every step since the last checkpoint."""
    from transformers import TrainerControl, TrainerState

    from tau2_rl.run import stop as graceful_stop
    from tau2_rl.run.stop import EXIT_INTERRUPTED, STOP_SIGNALS, GracefulStop

    class StoppedNow(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise StoppedNow(code)

    monkeypatch.setattr(graceful_stop.os, "_exit", fake_exit)
    clock = [100.0]
    monkeypatch.setattr(graceful_stop.time, "monotonic", lambda: clock[0])
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        stop = GracefulStop().install()
        control, state = TrainerControl(), TrainerState(global_step=5)
        os.kill(os.getpid(), signal.SIGINT)  # handled: no KeyboardInterrupt
        stop.on_step_end(None, state, control)
        assert control.should_save and control.should_training_stop and stop.signal_name == "SIGINT"
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's relayed stop: absorbed
        clock[0] += graceful_stop.RELAY_WINDOW_S  # a person's second press
        with pytest.raises(StoppedNow) as stopped:
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C
        assert stopped.value.args == (EXIT_INTERRUPTED,)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.slow
@pytest.mark.serial
def test_ctrl_c_in_a_terminal_checkpoints_prints_one_line_and_a_second_stops_at_once(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
) -> None:
    """The README's command in a terminal (a pseudo-terminal here): Ctrl-C reaches the foreground process group.
    The first one: the trainer saves the step's checkpoint and says how to resume, no traceback; the launcher waits
    for it. Then a run with two Ctrl-C: it stops at once with one line."""
    import pty
    import select

    def launch(out: Path, presses: int) -> tuple[str, int]:
        argv = [
            sys.executable, "-m", "accelerate.commands.launch", *LAUNCHERS["simple"], "train_grpo.py",
            "--model_name_or_path", str(model_dir), "--output_dir", str(out), "--hub_dir", str(tmp_path / "hub"),
            "--run_name", out.name, "--tasks", "0", "--task_repeats", "64", "--num_generations", "2",
            "--per_device_train_batch_size", "2", "--max_steps", "40", "--save_steps", "1000", "--max_turns", "2",
            "--max_turn_tokens", "8", "--max_completion_length", "128", "--use_cpu", "true", "--bf16", "false",
            "--report_to", "none", "--variant", "vanilla", "--gradient_checkpointing", "false", "--logging_steps", "1",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
        pid, master = pty.fork()  # the child: a new session whose controlling terminal is the pty (a shell's job)
        if pid == 0:
            os.chdir(REPO_ROOT)
            os.execve(sys.executable, argv, env)
        text, sent, deadline = b"", 0, time.monotonic() + 500
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([master], [], [], 1.0)
                if ready:
                    try:
                        chunk = os.read(master, 65536)
                    except OSError:  # EIO: every process holding the terminal exited
                        break
                    if not chunk:
                        break
                    text += chunk
                if sent < presses and text.count(b"| loss ") >= 1 + sent:  # after a step line: Ctrl-C
                    os.write(master, b"\x1a\x03" if sent == 0 else b"\x03")  # Ctrl-Z first, the first time
                    sent += 1
            _, status = os.waitpid(pid, 0)
        finally:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(master)
        return text.decode(errors="replace"), os.waitstatus_to_exitcode(status)

    text, _ = launch(tmp_path / "once", 1)
    assert "Ctrl-Z: a training run started by accelerate launch holds the terminal and is not suspended" in text
    assert "KeyboardInterrupt" not in text and "SIGINT received: saving a checkpoint" in text, text[-3000:]
    assert "stopped by SIGINT at step" in text and "rerun the same command to resume" in text, text[-3000:]
    (checkpoint,) = sorted((tmp_path / "once").glob("checkpoint-*"))
    assert (checkpoint / "trainer_state.json").is_file()
    assert text.rstrip().splitlines()[-1].startswith("stopped by SIGINT"), text[-3000:]  # the last thing shown

    text, code = launch(tmp_path / "twice", 2)
    assert "KeyboardInterrupt" not in text, text[-3000:]
    assert "SIGINT again: stopped at once without a checkpoint" in text, text[-3000:]
    assert not list((tmp_path / "twice").glob("checkpoint-*")) and code != 0


def test_a_training_that_raises_gives_the_stop_signals_back() -> None:
    """``train_or_stop`` installs the graceful-stop handlers; a training that raises never reaches ``on_train_end``,
    and its handlers stayed on the process (f34312e's CI: a later in-process test's Ctrl-C became a stop flag)."""
    from tau2_rl.run.stop import STOP_SIGNALS, train_or_stop

    class Failing:
        accelerator = None

        def add_callback(self, callback: object) -> None:
            self.callback = callback

        def train(self, resume_from_checkpoint: str | None = None) -> None:
            assert signal.getsignal(signal.SIGINT) == self.callback._handle  # installed while training
            raise RuntimeError("the step failed")

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with pytest.raises(RuntimeError, match="the step failed"):
        train_or_stop(Failing(), None)
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == previous
