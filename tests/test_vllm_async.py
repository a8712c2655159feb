"""Generation ahead in vLLM server mode (``--max_staleness 1 --use_vllm true --vllm_mode server``), run for real on
CPU with vLLM's CPU build (CI's vLLM stage: ``pytest -m vllm``).

The policy is served by ``scripts/serve_policy_vllm.py`` (TRL's ``trl vllm-serve`` command line); the rollout
worker samples on it through TRL's ``VLLMClient`` (``tau2_rl/backends/vllm_server.py``) while the trainer trains.
What CPU cannot run is the NCCL weight transfer into the server: the probe driver (``GRPO_PROBE_NO_WEIGHT_TRANSFER``)
opens no communicator and records each push instead of sending it, so the server keeps its first weights. The test
checks the plumbing around it: the worker's batches, their staleness, the pushes at batch boundaries, and that the
behaviour log-probs the server returns are the trainer's own at staleness 0 (before any update).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_vllm import GRPO_CPU_FLAGS, GRPO_SMALL, TIMEOUT, free_port, read_jsonl, run, smoke_commands
from tests.vllm_cpu import GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, cpu_env, plugin_dir

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
STEPS = 3


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-async")


@pytest.fixture(scope="module")
def plugin(work: Path) -> Path:
    return plugin_dir(work / "plugin")


@pytest.fixture(scope="module")
def smoke(work: Path) -> dict[str, list[str]]:
    return smoke_commands(work)


@pytest.fixture(scope="module")
def policy_server(work: Path, plugin: Path, smoke: dict[str, list[str]]) -> Iterator[dict[str, Any]]:
    """scripts/gpu_smoke.sh's tiny model, served as GRPO's server mode serves the policy (no tool-call parser)."""
    command = smoke["build_tiny_model"]
    run(command, cpu_env(plugin, ROOT), work / "build-model.log")
    model = Path(command[command.index("--output_dir") + 1])
    log = work / "policy-server.log"
    serve = [PY, "-m", "scripts.serve_policy_vllm", "--model", str(model), "--port", str(free_port()),
             "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION), "--max-model-len", str(MAX_MODEL_LEN),
             "--health-timeout", str(TIMEOUT), "--log-file", str(log), "--",
             "--max-num-batched-tokens", str(MAX_MODEL_LEN)]  # fmt: skip
    err_path = work / "policy-launcher.err"
    with open(err_path, "w", encoding="utf-8") as err:
        launcher = subprocess.Popen(serve, cwd=ROOT, env=cpu_env(plugin, ROOT, threads_bind="1"),
                                    stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
    url = launcher.stdout.readline().strip()
    if not url:
        launcher.wait(timeout=60)
        pytest.fail(f"the launcher exited with {launcher.returncode}: {err_path.read_text()[-3000:]}")
    yield {"url": url, "model": model}
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=120)


@pytest.fixture(scope="module")
def served_ahead_run(work: Path, plugin: Path, smoke: dict[str, list[str]], policy_server) -> dict[str, Any]:
    out, probe = work / "grpo-served-ahead", work / "probe-served-ahead"
    command = [*smoke["grpo:joint"], *GRPO_CPU_FLAGS, *GRPO_SMALL]
    command[command.index("--output_dir") + 1] = str(out)
    # six tasks of two episodes, two tasks a step: one epoch of three steps (the worker looks ahead within an epoch)
    command += ["--tasks", "0,1,2,3,4,5", "--max_steps", str(STEPS),
                "--vllm_mode", "server", "--vllm_server_base_url", policy_server["url"],
                "--max_staleness", "1", "--model_name_or_path", str(policy_server["model"]),
                "--learning_rate", "5e-3", "--report_to", "none"]  # fmt: skip
    env = cpu_env(plugin, ROOT) | {"GRPO_PROBE_DIR": str(probe), "GRPO_PROBE_REWARD": "length",
                                   "GRPO_PROBE_NO_WEIGHT_TRANSFER": "1"}  # fmt: skip
    log = work / "grpo-served-ahead.log"
    run(command, env, log)
    return {"out": out, "records": read_jsonl(probe / "rank0.jsonl"), "log": log.read_text(encoding="utf-8"),
            "command": command, "env": env}  # fmt: skip


def assert_pushed_whole_weights(records: list[dict]) -> None:
    """The start's push (the server must hold the trainer's weights, a resumed run's too), then one per optimiser
    step but the last (the worker has nothing left to play after it: announced batches stop at max_steps); each
    with whole tensors of the shapes announced to the server (``tests/grpo_probe.py``)."""
    pushes = [r for r in records if r["kind"] == "push"]
    assert [p["step"] for p in pushes][:1] == [0] and len(pushes) >= STEPS
    assert all(p["tensors"] > 0 for p in pushes)
    assert all(p["full"] for p in pushes)


def assert_played_ahead(records: list[dict]) -> None:
    """A rank's ``STEPS`` steps played one step ahead: staleness 0 then 1, a non-zero loss, a rollout per step."""
    logs = [r["logs"] for r in records if r["kind"] == "log" and "loss" in r["logs"]]
    assert len(logs) == STEPS
    assert [log["async/staleness_max"] for log in logs] == [0.0, 1.0, 1.0]
    # staleness 0, nothing trained yet: the server's sampled-token log-probs are the trainer's own (vLLM's CPU
    # kernels against transformers': close, not equal), so the behaviour weight is ~1 and the KL ~0
    assert abs(logs[0]["async/behaviour_weight"] - 1.0) < 0.05 and logs[0]["async/kl_behaviour"] < 0.01
    assert all(log["loss"] != 0.0 for log in logs)
    assert len([r for r in records if r["kind"] == "rollout"]) == STEPS


def assert_finished(out: Path) -> None:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    assert state["global_step"] == STEPS


def test_generation_ahead_samples_on_the_vllm_server_and_pushes_between_batches(served_ahead_run) -> None:
    records, text = served_ahead_run["records"], served_ahead_run["log"]
    assert "sampling on the vLLM server http://" in text
    assert_pushed_whole_weights(records)
    assert_played_ahead(records)
    rollouts = [r for r in records if r["kind"] == "rollout"]
    assert all(any(len(c) for c in r["completions"]) for r in rollouts)
    assert_finished(served_ahead_run["out"])


def test_a_resumed_server_mode_run_pushes_the_checkpoints_weights_first(work: Path, served_ahead_run) -> None:
    """The same command with more steps resumes from the last checkpoint: the server (which may hold any weights)
    gets the checkpoint's before the fresh worker plays, so the first resumed batch has staleness 0."""
    probe = work / "probe-served-resumed"
    command = [*served_ahead_run["command"], "--max_steps", str(STEPS + 2)]
    log = work / "grpo-served-resumed.log"
    run(command, served_ahead_run["env"] | {"GRPO_PROBE_DIR": str(probe)}, log)
    assert f"resuming from {served_ahead_run['out'] / f'checkpoint-{STEPS}'}" in log.read_text(encoding="utf-8")
    records = read_jsonl(probe / "rank0.jsonl")
    pushes = [r["step"] for r in records if r["kind"] == "push"]
    assert pushes[0] == STEPS
    logs = [r for r in records if r["kind"] == "log" and "loss" in r["logs"]]
    assert [r["step"] for r in logs] == [STEPS + 1, STEPS + 2]
    assert logs[0]["logs"]["async/staleness_max"] == 0.0  # replayed on the checkpoint's weights
    assert all(r["logs"]["async/staleness_max"] <= 1 for r in logs)


NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None


@pytest.mark.serial  # two ranks and the server: the three need both cores (staleness is timed)
@pytest.mark.parametrize(
    "sharding",
    [pytest.param("zero3", marks=pytest.mark.skipif(NO_DEEPSPEED, reason="DeepSpeed is not installed")), "fsdp2"],
)
def test_two_sharded_ranks_play_ahead_on_one_server_and_push_together(
    work: Path, served_ahead_run, sharding: str
) -> None:
    """The reference layout's sharding: two training processes under ZeRO-3 or FSDP2 (the CPU twins of zero3.yaml
    and fsdp2.yaml), each with its own worker sampling its rows on the one server. TRL's push gathers the shards (a
    collective on both ranks, only the main process sends), so the ranks push together, at batch boundaries: the
    main process records the pushes, both ranks log the same bounded staleness, and the server's log-probs are the
    trainer's own before any update."""
    from tests.test_deepspeed_cpu import DEEPSPEED_CPU_FLAGS

    out, probe = work / f"grpo-served-{sharding}", work / f"probe-served-{sharding}"
    command = list(served_ahead_run["command"])
    at = command.index("--config_file")
    command[at + 1] = f"accelerate_configs/cpu_{sharding}.yaml"  # 2 processes
    command[command.index("--output_dir") + 1] = str(out)
    if sharding == "zero3":
        command[command.index("--use_cpu") + 1] = DEEPSPEED_CPU_FLAGS[1]
        command += [DEEPSPEED_CPU_FLAGS[2], DEEPSPEED_CPU_FLAGS[3]]
    command += ["--per_device_train_batch_size", "2",  # one task's two episodes per rank: three steps an epoch
                "--run_name", f"served-{sharding}"]  # fmt: skip
    log = work / f"grpo-served-{sharding}.log"
    run(command, served_ahead_run["env"] | {"GRPO_PROBE_DIR": str(probe)}, log)
    text = log.read_text(encoding="utf-8")
    assert "sampling on the vLLM server http://" in text
    assert ("sharding: DeepSpeed ZeRO-3" if sharding == "zero3" else "sharding: FSDP2") in text
    ranks = [read_jsonl(probe / f"rank{rank}.jsonl") for rank in (0, 1)]
    assert_pushed_whole_weights(ranks[0])  # gathered whole tensors, as the server was told, not rank 0's shards
    assert not [r for r in ranks[1] if r["kind"] == "push"]  # only the main process sends
    for records in ranks:
        assert_played_ahead(records)
        assert all(len(r["completions"]) == 2 for r in records if r["kind"] == "rollout")
    assert_finished(out)
