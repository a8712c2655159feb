"""GRPO in two processes for real: ``accelerate launch --multi_gpu --num_processes 2`` on CPU (torchrun, gloo).

The wave synchronisation (every rank joins each wave's generation; a rank whose episodes are over joins with a
dummy) is what keeps multi-process generation collectives in step. Here the two ranks really get different numbers
of turns: the user simulator is a local OpenAI-compatible stub that ends task 0's conversations after one reply and
task 1's after three, and the two tasks land on different ranks. Each rank records its episodes and the metrics it
logs (tests/grpo_probe.py); both must finish every step, agree on every gathered metric, and one checkpoint is saved.

Without vLLM: marked slow (CI's slow stage). With vLLM colocated (one engine per rank, a core each): marked vllm.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.openai_stub_server import StubServer

ROOT = Path(__file__).resolve().parents[1]
TWO_PROCESSES = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                 "accelerate_configs/multi_gpu.yaml", "--num_processes", "2", "--mixed_precision", "no"]  # fmt: skip
ONE_PROCESS = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml"]
# Task 0's user (Emma Kim) stops after one reply, task 1's (Raj Sanchez) after three.
STOP_AFTER = {"emma_kim_9957": 1, "raj_sanchez_7340": 3}


def grpo_command(model: Path, out: Path, user_url: str, extra: list[str]) -> list[str]:
    return [*TWO_PROCESSES, "tests/grpo_probe.py", "--config", "recipes/grpo/cpu_smoke.yaml",
            "--model_name_or_path", str(model), "--output_dir", str(out / "run"), "--run_name", "two-ranks",
            "--hub_dir", str(out / "hub"), "--use_cpu", "true", "--bf16", "false",
            "--tasks", "0,1", "--task_repeats", "1", "--num_generations", "2", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "1", "--shuffle_dataset", "false", "--max_turns", "6",
            "--max_turn_tokens", "8", "--max_completion_length", "1024", "--max_steps", "2", "--save_steps", "2",
            "--logging_steps", "1", "--user_simulator", "llm", "--user_base_url", user_url, "--user_model",
            "stub-model", "--user_timeout", "30", "--user_max_retries", "1", "--compact_prompt", "true",
            *extra]  # fmt: skip


def end_of_turn_id(model: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|im_end|>")


def run_two_ranks(
    tmp_path: Path,
    model: Path,
    env: dict[str, str],
    extra: list[str],
    errors: tuple[str, ...] = (),
    status: int = 0,
    launch: list[str] = TWO_PROCESSES,
    ranks: tuple[int, ...] = (0, 1),
) -> dict[int, list[dict]]:
    probe = tmp_path / "probe"
    tmp_path.mkdir(parents=True, exist_ok=True)
    with StubServer("stop", stop_after_by_text=STOP_AFTER, error_by_text=errors) as stub:
        command = [*launch, *grpo_command(model, tmp_path, stub.base_url, extra)[len(TWO_PROCESSES) :]]
        log = tmp_path / "grpo.log"
        with open(log, "w", encoding="utf-8") as out:
            done = subprocess.run(
                command, cwd=ROOT, env=env | {"GRPO_PROBE_DIR": str(probe)}, stdout=out, stderr=subprocess.STDOUT,
                timeout=1800,
            )  # fmt: skip
    assert done.returncode == status, log.read_text(errors="replace")[-5000:]
    found = {}
    for rank in ranks:
        lines = (probe / f"rank{rank}.jsonl").read_text(encoding="utf-8").splitlines()
        found[rank] = [json.loads(line) for line in lines]
    return found


def step_one_episodes(ranks: dict[int, list[dict]]) -> dict[int, list[int]]:
    """Episode seed → completion token ids of the first step, over every rank's rows."""
    played: dict[int, list[int]] = {}
    for records in ranks.values():
        for record in records:
            if record["kind"] == "rollout" and record["step"] == 0:
                played.update(zip(record["seeds"], record["completions"], strict=True))
    return played


def check_two_ranks(tmp_path: Path, ranks: dict[int, list[dict[str, Any]]], user_errors: float = 0.0) -> None:
    """Both ranks played both steps on different tasks with different numbers of turns (the idle rank joined the
    other's generation), logged the same gathered metrics (``user_errors`` failed episodes a step) and saved one
    checkpoint, once."""
    rollouts = {rank: [r for r in records if r["kind"] == "rollout"] for rank, records in ranks.items()}
    for rank in (0, 1):  # every rank played both steps
        assert [r["step"] for r in rollouts[rank]] == [0, 1], rank
    for step in (0, 1):  # ... on different tasks, with different numbers of turns
        first, second = rollouts[0][step], rollouts[1][step]
        assert set(first["tasks"]).isdisjoint(second["tasks"])
        assert max(first["turns"]) != max(second["turns"]), (first, second)
    logs = {rank: [r["logs"] for r in records if r["kind"] == "log" and "loss" in r["logs"]] for rank, records in
            ranks.items()}  # fmt: skip
    assert len(logs[0]) == len(logs[1]) == 2
    for mine, theirs in zip(logs[0], logs[1], strict=True):  # the gathered metrics are the same on both ranks
        assert mine.keys() == theirs.keys()
        for key in mine:
            a, b = mine[key], theirs[key]
            if key in ("step_time",) or key.startswith("timing/"):
                continue  # each rank's own clock
            same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-6))
            assert same, (key, a, b)
        assert mine["episode/user_sim_errors"] == user_errors
        assert mine["train/user_error_skip"] == 0.0  # not every episode of the global batch failed: no rank skips
    turns = [t for rank in (0, 1) for t in rollouts[rank][0]["turns"]]
    assert math.isclose(logs[0][0]["episode/turns"], sum(turns) / len(turns))  # both ranks' episodes gathered
    saved = sorted(p.name for p in (tmp_path / "hub" / "two-ranks").iterdir() if p.is_dir())
    assert saved == ["step-000002"]  # one checkpoint, written once
    assert (tmp_path / "run" / "checkpoint-2").is_dir()


def launch_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(ROOT)}  # fmt: skip


@pytest.fixture(scope="module")
def default_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train_grpo.py's default tiny model (4k vocabulary: the real prompt fits), built once for the module."""
    model = tmp_path_factory.mktemp("model") / "tiny-qwen2"
    subprocess.run([sys.executable, "-m", "scripts.build_tiny_model", "--output_dir", str(model)], cwd=ROOT,
                   env=launch_env(), check=True, capture_output=True, timeout=600)  # fmt: skip
    return model


@pytest.mark.slow
def test_two_process_grpo_with_ranks_on_different_turn_counts_and_user_errors_skipping_on_every_rank_or_none(
    tmp_path: Path, default_tiny_model: Path
) -> None:
    """Two launches (it was three: a run without user errors served the turn-count checks alone). First, task 0's
    user endpoint answers HTTP 500 (rank 0's episodes end at their first user turn) while task 1's answers three
    times (rank 1's last longer): the ranks play different numbers of turns, agree on every gathered metric, and,
    since the global batch is not all user errors, neither skips its update. Then both tasks fail: both ranks skip
    and stop together (exit 1) with a checkpoint."""
    env, model = launch_env(), default_tiny_model
    bias = ["--generation_kwargs", json.dumps({"sequence_bias": [[[end_of_turn_id(model)], 10.0]]}),
            "--max_user_error_steps", "2"]  # fmt: skip
    mixed = run_two_ranks(tmp_path / "mixed", model, env, bias, errors=("emma_kim_9957",))
    check_two_ranks(tmp_path / "mixed", mixed, user_errors=2.0)  # task 0's two episodes, every step
    dead = run_two_ranks(tmp_path / "dead", model, env, [*bias, "--save_steps", "100"],
                         errors=("emma_kim_9957", "raj_sanchez_7340"), status=1)  # fmt: skip
    logs = {rank: [r["logs"] for r in records if r["kind"] == "log" and "loss" in r["logs"]] for rank, records in
            dead.items()}  # fmt: skip
    for rank in (0, 1):
        assert [e["train/user_error_skip"] for e in logs[rank]] == [1.0, 1.0], rank
    log = (tmp_path / "dead" / "grpo.log").read_text(errors="replace")
    assert "failed every episode of 2 consecutive step(s)" in log and "HTTP 500" in log
    assert (tmp_path / "dead" / "run" / "checkpoint-2").is_dir()


@pytest.mark.serial  # an engine per rank, a core each
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_two_process_grpo_with_vllm_colocated(tmp_path: Path) -> None:
    """The same with one colocated vLLM engine per rank (TP 1): each engine on its own core."""
    from tests.vllm_cpu import GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, TINY_VLLM_MODEL, cpu_env, plugin_dir

    plugin = plugin_dir(tmp_path / "plugin")
    env = cpu_env(plugin, ROOT, threads_bind="0|1")
    model = tmp_path / "tiny-qwen2-h256"
    sizes = [f"--{key}={value}" for key, value in TINY_VLLM_MODEL.items()]
    subprocess.run([sys.executable, "-m", "scripts.build_tiny_model", "--output_dir", str(model), *sizes], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=600)  # fmt: skip
    extra = ["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization",
             str(GPU_MEMORY_UTILIZATION / 2), "--vllm_max_model_length", str(MAX_MODEL_LEN), "--generation_kwargs",
             json.dumps({"logit_bias": {str(end_of_turn_id(model)): 10.0}})]  # fmt: skip
    ranks = run_two_ranks(tmp_path, model, env, extra)
    check_two_ranks(tmp_path, ranks)
    # One process playing both ranks' rows (per_device_train_batch_size 4): the same episodes of step 1, token for
    # token, as each turn samples with its own vLLM request seed (tau2_rl/backends/vllm_seeds.py).
    one = run_two_ranks(tmp_path / "one", model, cpu_env(plugin, ROOT, threads_bind="0"),
                        [*extra, "--per_device_train_batch_size", "4"], launch=ONE_PROCESS, ranks=(0,))  # fmt: skip
    assert step_one_episodes(one) == step_one_episodes(ranks) and len(step_one_episodes(ranks)) == 4
    for records in ranks.values():  # each rank's engine scores a fixed prompt as its trainer does, at every step
        probes = [r for r in records if r["kind"] == "probe"]
        assert [r["step"] for r in probes] == [0, 1]
        for probe in probes:
            gap = sum(abs(a - b) for a, b in zip(probe["vllm"], probe["trainer"], strict=True)) / len(probe["vllm"])
            assert gap < 0.02, (probe["rank"], probe["step"], gap)
