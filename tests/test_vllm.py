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
import shlex
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

from scripts._launch import group_alive
from tests.vllm_cpu import GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, TINY_VLLM_MODEL, cpu_env, plugin_dir

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# What the GPU recipes set and CPU cannot do (no bf16 kernels worth it for a tiny model, no sleep mode), and the
# one-line system prompt the CPU quick start trains with: the full ~7k-token prompt (with the tiny tokenizer) made
# each 2-turn GRPO step 40-60 s of attention on CPU, what nothing checked here depends on (dd2178f: CI time).
GRPO_CPU_FLAGS = ["--use_cpu", "true", "--bf16", "false", "--dtype", "float32", "--vllm_enable_sleep_mode", "false",
                  "--gradient_checkpointing", "false", "--vllm_gpu_memory_utilization", str(GPU_MEMORY_UTILIZATION),
                  "--vllm_max_model_length", str(MAX_MODEL_LEN), "--compact_prompt", "true"]  # fmt: skip
# A small GRPO run: 2 steps of 2 tasks × 2 generations, 2 turns each.
GRPO_SMALL = ["--tasks", "0,1", "--task_repeats", "1", "--num_generations", "2", "--per_device_train_batch_size", "4",
              "--gradient_accumulation_steps", "1", "--max_turns", "2", "--max_turn_tokens", "16",
              "--max_completion_length", "512", "--mask_truncated_completions", "false", "--max_steps", "2",
              "--save_steps", "1"]  # fmt: skip
EVAL_SMALL = ["--tasks", "0,2", "--num_samples", "1", "--max_turns", "2", "--max_new_tokens", "256",
              "--max_turn_tokens", "16", "--compact_prompt", "true"]  # fmt: skip
# CPU: seeded requests (one sampling seed per episode) must not be chunked ("CPU Generator does not use offset")
EVAL_CPU_FLAGS = ["--vllm_gpu_memory_utilization", str(GPU_MEMORY_UTILIZATION), "--vllm_max_model_len",
                  str(MAX_MODEL_LEN), "--vllm_max_num_batched_tokens", str(MAX_MODEL_LEN)]  # fmt: skip
TIMEOUT = 1200  # seconds per command: vLLM's first compile on 2 busy cores takes minutes


def smoke_commands(out: Path) -> dict[str, list[str]]:
    """scripts/gpu_smoke.sh's commands (``--dry-run``, joint variant only), by check name, for CPU: CPU accelerate
    config instead of the single-GPU one, and GRPO through the probe driver (it runs ``train_grpo.main`` as is)."""
    done = subprocess.run(
        ["bash", "scripts/gpu_smoke.sh", "--dry-run", "--variants", "joint", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHON": PY}, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    commands, name = {}, None
    for line in done.stdout.splitlines():
        found = re.match(r"# \[([^\]]+)\] (timeout|background)", line)
        if found:
            name = found.group(1)
        elif name is not None and line.strip():
            commands[name], name = shlex.split(line), None
    for command in commands.values():
        if "accelerate.commands.launch" in command:
            at = command.index("--config_file")
            assert command[at + 1 : at + 4] == ["accelerate_configs/single_gpu.yaml", "--gpu_ids", "0"], command
            command[at + 1 : at + 4] = ["accelerate_configs/cpu.yaml"]
        if "train_grpo.py" in command:
            command[command.index("train_grpo.py")] = "tests/grpo_probe.py"
    return commands


def with_port(command: list[str], old: str, new: str) -> list[str]:
    """``command`` with the smoke check's fixed port replaced (CI picks a free one)."""
    return [word.replace(f":{old}/", f":{new}/") if word != old else new for word in command]


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
def smoke(work: Path) -> dict[str, list[str]]:
    return smoke_commands(work)


@pytest.fixture(scope="module")
def vllm_model(work: Path, plugin: Path, smoke: dict[str, list[str]]) -> Path:
    """The tiny model with heads of 64 (vLLM's CPU attention needs ≥ 32): scripts/gpu_smoke.sh's build."""
    command = smoke["build_tiny_model"]
    for key, value in TINY_VLLM_MODEL.items():
        assert command[command.index(f"--{key}") + 1] == str(value)
    run(command, cpu_env(plugin, ROOT), work / "build-model.log")
    return Path(command[command.index("--output_dir") + 1])


# ---------------------------------------------------------------------------------------------------------------------
# GRPO with vLLM colocated, then the evaluation of its two checkpoints through the vLLM backend


@pytest.fixture(scope="module")
def colocate_run(work: Path, plugin: Path, vllm_model: Path, smoke: dict[str, list[str]]) -> dict[str, Any]:
    """scripts/gpu_smoke.sh's GRPO check (recipes/ablation/grpo_gpu_smoke.yaml, vLLM colocated) with CPU flags,
    through the probe driver, which records vLLM's and the trainer's log-probabilities of a fixed prompt after each
    weight sync."""
    out, probe = work / "grpo-joint", work / "probe-colocate"
    env = cpu_env(plugin, ROOT) | {"GRPO_PROBE_DIR": str(probe), "GRPO_PROBE_REWARD": "length"}
    command = [*smoke["grpo:joint"], "--learning_rate", "5e-3", *GRPO_CPU_FLAGS, *GRPO_SMALL]
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
    assert all(r["seeded_vllm"] for r in records if r["kind"] == "rollout")  # per-request seeds (vllm_seeds.py)
    hub = colocate_run["out"].parent / "hub" / "gpu-smoke-joint"
    assert sorted(json.loads((hub / "refs.json").read_text())["revisions"].values()) == [1, 2]


def test_trainer_rollouts_on_vllm_do_not_depend_on_their_generation_batch(
    work: Path, plugin: Path, vllm_model: Path
) -> None:
    """The trainer's vLLM path (TrainerBackend → TRL's ``_generate_single_turn`` → ``VLLMGeneration.generate``,
    colocate) with per-request seeds: the same 16 episodes played as one batch and as two of 8 give the same
    transcripts, token for token (tests/vllm_seeds_probe.py)."""
    out = work / "vllm-seeds.json"
    run([PY, "tests/vllm_seeds_probe.py", str(vllm_model), str(out)], cpu_env(plugin, ROOT), work / "vllm-seeds.log")
    found = json.loads(out.read_text())
    schedules = found.pop("schedules")
    played = {k: {int(row): ids for row, ids in v.items()} for k, v in found.items()}
    assert sorted(played["whole"]) == list(range(16)) and all(played["whole"].values())
    assert played["halves"] == played["whole"]
    differ = sum(played["unseeded_halves"][row] != played["unseeded_whole"][row] for row in range(16))
    print(f"batch-seeded (TRL's call without per-request seeds): {differ} of 16 episodes differ between the layouts")
    # the event-driven loop on vLLM against the LLM user with reply delays: the same episodes as under waves, on the
    # trainer's colocated path and through the evaluator's VLLMBackend, in more (smaller) policy calls
    for path in ("trainer", "evaluator"):
        waves, events = schedules[f"{path}_waves"], schedules[f"{path}_events"]
        assert events["ids"] == waves["ids"] and events["messages"] == waves["messages"], path
        assert all(waves["ids"].values()) and waves["calls"] == 4 and events["calls"] > waves["calls"], path


# LoRA: TRL merges the adapter into the base weights for each sync (``VLLMGeneration._iter_named_params``: merge,
# push the merged base-layer weights under vLLM's names, unmerge), so the engine serves base + adapter. The rank and
# learning rate are shrunk/raised so that two steps of a random tiny model move the fixed prompt's log-probabilities
# well past the vLLM/trainer numerical gap (lora_B starts at zero: step 0 is the base model).
LORA_FLAGS = ["--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16", "--learning_rate", "2e-2"]


@pytest.fixture(scope="module")
def lora_colocate_run(work: Path, plugin: Path, vllm_model: Path, smoke: dict[str, list[str]]) -> dict[str, Any]:
    """The same GRPO check with LoRA (``--use_peft true``): its own output dir and hub run."""
    out, probe = work / "grpo-lora", work / "probe-lora"
    command = list(smoke["grpo:joint"])
    command[command.index("--output_dir") + 1] = str(out)
    command[command.index("--run_name") + 1] = "gpu-smoke-lora"
    env = cpu_env(plugin, ROOT) | {"GRPO_PROBE_DIR": str(probe), "GRPO_PROBE_REWARD": "length"}
    start = time.monotonic()
    run([*command, *GRPO_CPU_FLAGS, *GRPO_SMALL, *LORA_FLAGS], env, work / "grpo-lora.log")
    hub = work / "hub" / "gpu-smoke-lora"
    return {"hub": hub, "records": read_jsonl(probe / "rank0.jsonl"), "seconds": time.monotonic() - start}


def test_grpo_colocate_lora_generates_with_the_updated_adapter(lora_colocate_run: dict[str, Any]) -> None:
    records = lora_colocate_run["records"]
    probes = {r["step"]: r for r in records if r["kind"] == "probe"}
    assert sorted(probes) == [0, 1]
    gaps = {step: _mean_gap(p["vllm"], p["trainer"]) for step, p in probes.items()}
    moved = _mean_gap(probes[0]["trainer"], probes[1]["trainer"])  # what step 1's adapter update changed
    vllm_moved = _mean_gap(probes[0]["vllm"], probes[1]["vllm"])
    print(f"LoRA: logprob gap vLLM vs trainer: {gaps}; trainer moved {moved:.4f}, vLLM moved {vllm_moved:.4f}")
    assert moved > 0.05  # the adapter changed the fixed prompt's log-probabilities ...
    assert abs(vllm_moved - moved) < 0.2 * moved  # ... and vLLM's moved with them: the merged adapter was synced
    assert all(gap < 0.02 for gap in gaps.values())
    logs = [r["logs"] for r in records if r["kind"] == "log" and "loss" in r["logs"]]
    assert len(logs) == 2
    assert all(log["sampling/sampling_logp_difference/mean"] < 0.05 for log in logs)


def test_grpo_colocate_lora_hub_revision_is_the_adapter(lora_colocate_run: dict[str, Any], vllm_model: Path) -> None:
    """The revision holds the adapter only (not merged weights), and base + adapter loaded in this process give the
    trained policy's log-probabilities (the probe's ``final`` record)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.grpo_probe import PROBE_TEXT

    hub = lora_colocate_run["hub"]
    assert sorted(json.loads((hub / "refs.json").read_text())["revisions"].values()) == [1, 2]
    revision = hub / "step-000002"
    assert (revision / "adapter_config.json").is_file() and (revision / "adapter_model.safetensors").is_file()
    assert not (revision / "model.safetensors").exists() and not (revision / "config.json").exists()
    adapter_config = json.loads((revision / "adapter_config.json").read_text())
    assert Path(adapter_config["base_model_name_or_path"]).resolve() == vllm_model.resolve()
    base = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32, local_files_only=True)
    model = PeftModel.from_pretrained(base, revision).eval()
    ids = AutoTokenizer.from_pretrained(revision)(PROBE_TEXT)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    loaded = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()
    (final,) = [r for r in lora_colocate_run["records"] if r["kind"] == "final"]
    gap = max(abs(a - b) for a, b in zip(loaded, final["trainer"], strict=True))
    print(f"LoRA: hub revision (base + adapter) vs the trained policy: max abs logprob difference {gap:.3g}")
    assert gap < 1e-4
    with model.disable_adapter(), torch.no_grad():  # and the adapter is not a no-op: the base alone differs
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    base_only = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()
    assert _mean_gap(base_only, loaded) > 0.05


def _mean_gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_evaluate_two_checkpoints_in_one_command_releases_each_engine(
    work: Path, plugin: Path, colocate_run: dict[str, Any], smoke: dict[str, list[str]]
) -> None:
    """evaluate.py --steps 1,2 --backend vllm: the first engine is shut down before the second starts."""
    out = work / "eval"
    command = [*smoke["eval:vllm-two-steps"], *EVAL_SMALL, *EVAL_CPU_FLAGS]
    log = work / "eval-vllm-two-steps.log"
    with open(log, "w", encoding="utf-8") as handle:
        process = subprocess.Popen(command, cwd=ROOT, env=cpu_env(plugin, ROOT), stdout=handle, stderr=handle)
    import psutil

    most, seen, deadline = 0, set(), time.monotonic() + TIMEOUT
    try:
        while process.poll() is None and time.monotonic() < deadline:
            try:
                engines = [c for c in psutil.Process(process.pid).children(recursive=True) if _is_engine(c)]
            except psutil.Error:
                engines = []
            most = max(most, len(engines))
            seen.update(engine.pid for engine in engines)
            time.sleep(0.5)
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text(encoding="utf-8", errors="replace")
    assert process.wait() == 0, text[-4000:]
    assert len(seen) == 2  # one engine (vLLM's engine-core process) per checkpoint ...
    assert most == 1  # ... never two alive at once: the first was shut down (its memory went with it)
    for step in (1, 2):
        results = json.loads((out / "gpu-smoke-joint" / f"step-{step:06d}" / "results.json").read_text())
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
def user_server(work: Path, plugin: Path, vllm_model: Path, smoke: dict[str, list[str]]) -> Iterator[dict[str, Any]]:
    """gpu_smoke.sh's ``python -m scripts.serve_user_llm`` in the foreground (as a user runs it), on its own core."""
    port = free_port()
    command = with_port(smoke["serve:user-llm"], "8011", str(port))
    log = Path(command[command.index("--log-file") + 1])
    command += ["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION), "--health-timeout", str(TIMEOUT),
                "--", "--max-num-batched-tokens", command[command.index("--max-model-len") + 1]]  # fmt: skip
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


# Sampled replies: at temperature 0 (the default) the random tiny model's first token can be its end token, an empty
# reply, which the LLM user (rightly) counts as a failure.
USER_FLAGS = ["--user_timeout", "60", "--user_max_retries", "1", "--user_temperature", "1.0"]


def user_flags(server: dict[str, Any]) -> list[str]:
    return ["--user_simulator", "llm", "--user_base_url", server["url"], "--user_model", "user-sim", *USER_FLAGS]


def test_evaluation_with_the_served_user_simulator(work: Path, plugin: Path, user_server, smoke) -> None:
    command = with_port(smoke["eval:llm-user"], "8011", str(user_server["port"]))
    assert command[command.index("--user_base_url") + 1] == user_server["url"]
    run([*command, *EVAL_SMALL, *USER_FLAGS], cpu_env(plugin, ROOT), work / "eval-llm-user.log")
    results = json.loads((work / "eval" / "llm-user" / "results.json").read_text())
    assert results["config"]["user"]["simulator"] == "llm"
    played = samples(results)
    assert len(played) == 2 and not any(s["user_error"] for s in played)
    stats = results["user_simulator"]
    assert stats["replies"] >= 2 and stats["failures"] == 0  # the served model answered every user turn


def test_grpo_with_the_served_user_simulator(work: Path, plugin: Path, user_server, smoke) -> None:
    probe = work / "probe-user"
    command = with_port(smoke["grpo:llm-user"], "8011", str(user_server["port"]))
    command += [*GRPO_CPU_FLAGS, *GRPO_SMALL, *USER_FLAGS]
    run(command, cpu_env(plugin, ROOT) | {"GRPO_PROBE_DIR": str(probe)}, work / "grpo-llm-user.log")
    logs = [r["logs"] for r in read_jsonl(probe / "rank0.jsonl") if r["kind"] == "log" and "loss" in r["logs"]]
    assert len(logs) == 2
    assert all(log["episode/user_sim_errors"] == 0 for log in logs)
    assert (work / "hub" / "gpu-smoke-llm-user" / "step-000002" / "config.json").is_file()


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
    # The server is frozen (SIGSTOP: connections are still accepted, nothing answers) right after the evaluation's
    # endpoint check, long before its first user request (the policy engine starts in between), and killed once the
    # episodes run: their requests fail whatever the machine's speed. (Killing it after its first answer raced short
    # episodes that need a single user message.)
    server_group = os.getpgid(user_server["server_pid"])
    log_size = user_server["log"].stat().st_size
    eval_log = work / "eval-dies.log"
    with open(eval_log, "w", encoding="utf-8") as handle:
        evaluation = subprocess.Popen(command, cwd=ROOT, env=cpu_env(plugin, ROOT), stdout=handle, stderr=handle)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and evaluation.poll() is None:  # until the endpoint check has been answered
        with open(user_server["log"], "rb") as server_log:
            server_log.seek(log_size)
            if b"GET /v1/models" in server_log.read():
                break
        time.sleep(0.2)
    os.killpg(server_group, signal.SIGSTOP)
    while time.monotonic() < deadline and evaluation.poll() is None:  # until the episodes are being played
        if "eval server-dies:" in eval_log.read_text(encoding="utf-8", errors="replace"):
            break
        time.sleep(0.5)
    time.sleep(2)  # the first wave's user requests are sent (and hang)
    assert evaluation.poll() is None, eval_log.read_text(encoding="utf-8", errors="replace")[-3000:]
    os.killpg(server_group, signal.SIGKILL)
    # episodes whose user failed are not scored, so the results are incomplete: evaluate.py says so with exit 1
    assert evaluation.wait(timeout=TIMEOUT) == 1, (work / "eval-dies.log").read_text()[-4000:]
    results = json.loads((out / "server-dies" / "results.json").read_text())
    errors = [s for s in samples(results) if s["user_error"]]
    assert errors and all(not s["success"] for s in errors)
    assert results["user_simulator"]["failures"] > 0
    launcher = user_server["launcher"]
    assert launcher.wait(timeout=60) != 0  # the foreground launcher returns the server's exit code
    assert "exited with code" in user_server["launcher_err"].read_text()


# ---------------------------------------------------------------------------------------------------------------------
# trl vllm-serve through the project's launcher


def test_trl_vllm_serve_launcher_serves_a_generation_and_stops(
    work: Path, plugin: Path, vllm_model: Path, smoke: dict[str, list[str]]
) -> None:
    """gpu_smoke.sh's scripts/serve_policy_vllm.py: healthy, answers a completion, stops its server on SIGTERM.

    Server-mode training pushes weights over NCCL (TRL's VLLMClient): CUDA only, not run here."""
    port = free_port()
    command = with_port(smoke["serve:trl-vllm-serve"], "8010", str(port))
    log = Path(command[command.index("--log-file") + 1])
    command += ["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION), "--health-timeout", str(TIMEOUT),
                "--", "--max-num-batched-tokens", command[command.index("--max-model-len") + 1]]  # fmt: skip
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
    assert not group_alive(server_pid)  # the server's whole process group is gone (engine core included)
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
