"""The GPU path's vLLM pieces, run for real on CPU with vLLM's CPU build (CI's vLLM stage: ``pytest -m vllm``).

Each test runs the command a GPU user runs (the ones ``scripts/gpu_smoke.sh`` runs: the same recipes, launchers and
entry scripts) with CPU settings passed as flags or environment (``tests/vllm_cpu.py`` says which and why). What
CPU cannot cover: CUDA kernels, bf16 speed, sleep mode, NCCL weight sync to a ``trl vllm-serve`` server, memory
figures — ``scripts/gpu_smoke.sh`` checks those on a GPU.

vLLM compiles the model on its first start (minutes on 2 cores; later starts reuse ~/.cache/vllm), so the tests
share what they can: one GRPO run feeds the two-checkpoint evaluation, one user-simulator server serves an
evaluation, a GRPO run, and then dies under a third run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_cpu import GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, TINY_VLLM_MODEL, cpu_env, plugin_dir

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ACCELERATE = [PY, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml"]
# What the GPU recipes set and CPU cannot do (no bf16 kernels worth it for a tiny model, no sleep mode).
GRPO_CPU_FLAGS = ["--use_cpu", "true", "--bf16", "false", "--dtype", "float32", "--vllm_enable_sleep_mode", "false",
                  "--gradient_checkpointing", "false", "--vllm_gpu_memory_utilization", str(GPU_MEMORY_UTILIZATION),
                  "--vllm_max_model_length", str(MAX_MODEL_LEN)]  # fmt: skip
# A small GRPO run: 2 steps of 2 tasks × 2 generations, 2 turns each.
GRPO_SMALL = ["--tasks", "0,1", "--task_repeats", "1", "--num_generations", "2", "--per_device_train_batch_size", "4",
              "--gradient_accumulation_steps", "1", "--max_turns", "2", "--max_turn_tokens", "16",
              "--max_completion_length", "512", "--mask_truncated_completions", "false", "--max_steps", "2",
              "--save_steps", "1"]  # fmt: skip
EVAL_CPU_FLAGS = ["--vllm_gpu_memory_utilization", str(GPU_MEMORY_UTILIZATION), "--vllm_max_model_len",
                  str(MAX_MODEL_LEN)]  # fmt: skip
TIMEOUT = 1200  # seconds per command: vLLM's first compile on 2 busy cores takes minutes


def run(command: list[str], env: dict[str, str], log: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Runs ``command`` from the repository root with its output in ``log``; fails with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as out:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-40:])
        pytest.fail(f"{' '.join(command[:6])} ... exited with {done.returncode}; last lines of {log}:\n{tail}")
    return done


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def post_json(url: str, payload: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def plugin(work: Path) -> Path:
    return plugin_dir(work / "plugin")


@pytest.fixture(scope="module")
def vllm_model(work: Path, plugin: Path) -> Path:
    """The tiny model with heads of 64 (vLLM's CPU attention needs ≥ 32), built as scripts/gpu_smoke.sh builds it."""
    out = work / "tiny-qwen2-h256"
    sizes = [f"--{key}={value}" for key, value in TINY_VLLM_MODEL.items()]
    run(
        [PY, "-m", "scripts.build_tiny_model", "--output_dir", str(out), *sizes], cpu_env(plugin, ROOT), work / "b.log"
    )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# GRPO with vLLM colocated, then the evaluation of its two checkpoints through the vLLM backend


@pytest.fixture(scope="module")
def colocate_run(work: Path, plugin: Path, vllm_model: Path) -> dict[str, Any]:
    """scripts/gpu_smoke.sh's GRPO command (recipes/ablation/grpo_gpu_smoke.yaml) with CPU flags, through the probe
    driver, which records vLLM's and the trainer's log-probabilities of a fixed prompt after each weight sync."""
    out, probe = work / "grpo-colocate", work / "probe-colocate"
    env = cpu_env(plugin, ROOT) | {"GRPO_PROBE_DIR": str(probe), "GRPO_PROBE_REWARD": "length"}
    command = [*ACCELERATE, "tests/grpo_probe.py", "--config", "recipes/ablation/grpo_gpu_smoke.yaml",
               "--variant", "joint", "--model_name_or_path", str(vllm_model), "--output_dir", str(out),
               "--run_name", "colocate", "--hub_dir", str(work / "hub"), "--learning_rate", "5e-3",
               *GRPO_CPU_FLAGS, *GRPO_SMALL]  # fmt: skip
    start = time.monotonic()
    run(command, env, work / "grpo-colocate.log")
    return {"out": out, "records": read_jsonl(probe / "rank0.jsonl"), "seconds": time.monotonic() - start}


def test_grpo_colocate_generates_with_the_synced_weights(colocate_run: dict[str, Any]) -> None:
    records = colocate_run["records"]
    probes = {r["step"]: r for r in records if r["kind"] == "probe"}
    assert sorted(probes) == [0, 1]  # a probe after each step's generation (global_step 0, then 1)
    n = len(probes[0]["vllm"])
    assert n > 5 and all(len(p["vllm"]) == len(p["trainer"]) == n for p in probes.values())

    def mean_gap(a: list[float], b: list[float]) -> float:
        return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)

    gaps = {step: mean_gap(p["vllm"], p["trainer"]) for step, p in probes.items()}
    moved = mean_gap(probes[0]["trainer"], probes[1]["trainer"])  # what step 1's update changed
    vllm_moved = mean_gap(probes[0]["vllm"], probes[1]["vllm"])
    print(f"logprob gap vLLM vs trainer: {gaps}; trainer moved {moved:.4f}, vLLM moved {vllm_moved:.4f}")
    assert moved > 0.05  # the update changed the fixed prompt's log-probabilities ...
    assert abs(vllm_moved - moved) < 0.2 * moved  # ... and vLLM's moved with them: the sync happened
    assert all(gap < 0.02 for gap in gaps.values())  # vLLM and trainer agree before and after the sync
    logs = [r["logs"] for r in records if r["kind"] == "log" and "loss" in r["logs"]]
    assert len(logs) == 2
    assert all(log["sampling/sampling_logp_difference/mean"] < 0.05 for log in logs)  # TRL's own check, per step
    hub = colocate_run["out"].parent / "hub" / "colocate"
    assert sorted(json.loads((hub / "refs.json").read_text())["revisions"].values()) == [1, 2]


def test_evaluate_two_checkpoints_in_one_command_releases_each_engine(
    work: Path, plugin: Path, colocate_run: dict[str, Any]
) -> None:
    """evaluate.py --steps 1,2 --backend vllm: the first engine is shut down before the second starts."""
    out = work / "eval-steps"
    command = [PY, "evaluate.py", "--config", "recipes/ablation/eval_gpu_smoke.yaml", "--model", "colocate",
               "--steps", "1,2", "--hub_dir", str(work / "hub"), "--output_dir", str(out), "--tasks", "0,2",
               "--num_samples", "1", "--max_turns", "2", "--max_new_tokens", "256", "--max_turn_tokens", "16",
               *EVAL_CPU_FLAGS]  # fmt: skip
    log = work / "eval-steps.log"
    with open(log, "w", encoding="utf-8") as handle:
        process = subprocess.Popen(command, cwd=ROOT, env=cpu_env(plugin, ROOT), stdout=handle, stderr=handle)
    import psutil

    most, deadline = 0, time.monotonic() + TIMEOUT
    try:
        while process.poll() is None and time.monotonic() < deadline:
            try:
                engines = [c for c in psutil.Process(process.pid).children(recursive=True) if _is_engine(c)]
            except psutil.Error:
                engines = []
            most = max(most, len(engines))
            time.sleep(0.5)
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text(encoding="utf-8", errors="replace")
    assert process.wait() == 0, text[-4000:]
    assert text.count("Initializing a V1 LLM engine") == 2
    assert most == 1  # never two engines alive at once: the first was shut down (its memory went with it)
    for step in (1, 2):
        results = json.loads((out / "colocate" / f"step-{step}" / "results.json").read_text())
        assert results["config"]["backend"] == "vllm" and results["config"]["step"] == step
        assert len(samples(results)) == 2


def samples(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [sample for task in results["tasks"].values() for sample in task["samples"]]


def _is_engine(process: Any) -> bool:
    try:
        return "EngineCore" in process.name() or "EngineCore" in " ".join(process.cmdline())
    except Exception:  # gone between listing and asking
        return False


# ---------------------------------------------------------------------------------------------------------------------
# the user simulator served by vLLM through the project's launcher


@pytest.fixture(scope="module")
def user_server(work: Path, plugin: Path, vllm_model: Path) -> Iterator[dict[str, Any]]:
    """``python -m scripts.serve_user_llm`` in the foreground (as a user runs it), bound to its own core."""
    port = free_port()
    log = work / "user-server.log"
    command = [PY, "-m", "scripts.serve_user_llm", "--model", str(vllm_model), "--port", str(port),
               "--served-model-name", "user-sim", "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
               "--max-model-len", str(MAX_MODEL_LEN), "--health-timeout", str(TIMEOUT), "--log-file", str(log),
               "--", "--max-num-batched-tokens", str(MAX_MODEL_LEN)]  # fmt: skip
    launcher_err = work / "user-launcher.err"
    with open(launcher_err, "w", encoding="utf-8") as err:
        launcher = subprocess.Popen(
            command,
            cwd=ROOT,
            env=cpu_env(plugin, ROOT, threads_bind="1"),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    start = time.monotonic()
    url = launcher.stdout.readline().strip()  # the launcher prints the base URL once the server is healthy
    if not url:
        launcher.wait(timeout=60)
        pytest.fail(f"the launcher exited with {launcher.returncode}: {launcher_err.read_text()[-3000:]}")
    server_pid = int(re.search(r"healthy after .* \(pid (\d+)\)", launcher_err.read_text()).group(1))
    info = {"url": url, "port": port, "launcher": launcher, "server_pid": server_pid, "log": log,
            "launcher_err": launcher_err, "start_seconds": time.monotonic() - start}  # fmt: skip
    yield info
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)


def user_flags(server: dict[str, Any]) -> list[str]:
    return ["--user_simulator", "llm", "--user_base_url", server["url"], "--user_model", "user-sim",
            "--user_timeout", "60", "--user_max_retries", "1"]  # fmt: skip


def test_evaluation_with_the_served_user_simulator(work: Path, plugin: Path, vllm_model: Path, user_server) -> None:
    out = work / "eval-user"
    command = [PY, "evaluate.py", "--config", "recipes/eval/cpu_tiny.yaml", "--model", str(vllm_model),
               "--eval_name", "served-user", "--output_dir", str(out), "--tasks", "0,2", "--num_samples", "1",
               "--max_turns", "2", "--max_new_tokens", "256", "--max_turn_tokens", "16",
               *user_flags(user_server)]  # fmt: skip
    run(command, cpu_env(plugin, ROOT), work / "eval-user.log")
    results = json.loads((out / "served-user" / "results.json").read_text())
    assert results["config"]["user"]["simulator"] == "llm"
    played = samples(results)
    assert len(played) == 2 and not any(s["user_error"] for s in played)
    stats = results["user_simulator"]
    assert stats["replies"] >= 2 and stats["failures"] == 0  # the served model answered every user turn


def test_grpo_with_the_served_user_simulator(work: Path, plugin: Path, vllm_model: Path, user_server) -> None:
    out, probe = work / "grpo-user", work / "probe-user"
    command = [*ACCELERATE, "tests/grpo_probe.py", "--config", "recipes/grpo/cpu_smoke.yaml",
               "--model_name_or_path", str(vllm_model), "--output_dir", str(out), "--run_name", "grpo-user",
               "--hub_dir", str(work / "hub"), *GRPO_SMALL, *user_flags(user_server)]  # fmt: skip
    run(command, cpu_env(plugin, ROOT) | {"GRPO_PROBE_DIR": str(probe)}, work / "grpo-user.log")
    logs = [r["logs"] for r in read_jsonl(probe / "rank0.jsonl") if r["kind"] == "log" and "loss" in r["logs"]]
    assert len(logs) == 2
    assert all(log["episode/user_sim_errors"] == 0 for log in logs)
    assert (work / "hub" / "grpo-user" / "step-000002" / "config.json").is_file()


def test_a_user_server_that_dies_mid_run_ends_episodes_as_user_errors(
    work: Path, plugin: Path, vllm_model: Path, user_server
) -> None:
    """The real server is killed while an evaluation talks to it: its episodes end as user_error, the run finishes,
    and the foreground launcher reports the server's exit."""
    out = work / "eval-dies"
    command = [PY, "evaluate.py", "--config", "recipes/eval/cpu_tiny.yaml", "--model", str(vllm_model),
               "--eval_name", "server-dies", "--output_dir", str(out), "--tasks", "0,2,5,7", "--num_samples", "1",
               "--max_turns", "8", "--max_new_tokens", "1024", "--max_turn_tokens", "16",
               *user_flags(user_server)]  # fmt: skip
    log_size = user_server["log"].stat().st_size
    with open(work / "eval-dies.log", "w", encoding="utf-8") as handle:
        evaluation = subprocess.Popen(command, cwd=ROOT, env=cpu_env(plugin, ROOT), stdout=handle, stderr=handle)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and evaluation.poll() is None:  # until the server has answered a user turn
        with open(user_server["log"], "rb") as server_log:
            server_log.seek(log_size)
            if b"POST /v1/chat/completions" in server_log.read():
                break
        time.sleep(0.5)
    assert evaluation.poll() is None, "the evaluation ended before the server answered it"
    os.killpg(os.getpgid(user_server["server_pid"]), signal.SIGKILL)
    assert evaluation.wait(timeout=TIMEOUT) == 0, (work / "eval-dies.log").read_text()[-4000:]
    results = json.loads((out / "server-dies" / "results.json").read_text())
    errors = [s for s in samples(results) if s["user_error"]]
    assert errors and all(not s["success"] for s in errors)
    assert results["user_simulator"]["failures"] > 0
    launcher = user_server["launcher"]
    assert launcher.wait(timeout=60) != 0  # the foreground launcher returns the server's exit code
    assert "exited with code" in user_server["launcher_err"].read_text()


# ---------------------------------------------------------------------------------------------------------------------
# trl vllm-serve through the project's launcher


def test_trl_vllm_serve_launcher_serves_a_generation_and_stops(work: Path, plugin: Path, vllm_model: Path) -> None:
    """scripts/serve_policy_vllm.py: healthy, answers a generation, and stops its server on SIGTERM.

    Server-mode training pushes weights over NCCL (TRL's VLLMClient): CUDA only, not run here."""
    port = free_port()
    log = work / "policy-server.log"
    command = [PY, "-m", "scripts.serve_policy_vllm", "--model", str(vllm_model), "--port", str(port),
               "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION), "--max-model-len", str(MAX_MODEL_LEN),
               "--health-timeout", str(TIMEOUT), "--log-file", str(log), "--", "--max-num-batched-tokens",
               str(MAX_MODEL_LEN)]  # fmt: skip
    err_path = work / "policy-launcher.err"
    with open(err_path, "w", encoding="utf-8") as err:
        launcher = subprocess.Popen(
            command, cwd=ROOT, env=cpu_env(plugin, ROOT), stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        url = launcher.stdout.readline().strip()
        assert url == f"http://127.0.0.1:{port}", err_path.read_text()[-3000:] + log.read_text()[-3000:]
        server_pid = int(re.search(r"\(pid (\d+)\)", err_path.read_text()).group(1))
        answer = post_json(
            f"{url}/v1/completions",
            {"model": str(vllm_model), "prompt": "Hello, my reservation", "max_tokens": 8, "temperature": 0.0},
        )
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] > 0
    finally:
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=120)
    assert code == 0 and "stopping" in err_path.read_text()
    with pytest.raises(ProcessLookupError):
        os.killpg(server_pid, 0)  # the server's whole process group is gone
    with socket.socket() as sock:  # and its port is free again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_launchers_do_not_need_the_vllm_console_script() -> None:
    """vllm-cpu installs the module `vllm` under another distribution name; the launchers never call `vllm`."""
    from scripts import serve_policy_vllm, serve_user_llm

    for module in (serve_user_llm, serve_policy_vllm):
        args = module.make_parser().parse_args(["--model", "/m"])
        command = module.build_command(args)
        assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
