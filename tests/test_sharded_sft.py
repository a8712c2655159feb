"""``train_sft.py`` sharded for real, on CPU (issue 36.4): two processes with gradient accumulation log the
one-process loss curve and end with its weights.

A module of its own (it was part of tests/test_sharded.py, whose GRPO runs share one reference run): under
``pytest -n 2 --dist loadfile`` it can start on the other worker while the GRPO runs go on (dd2178f).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_sharded import DDP, FSDP2, LAUNCH, ONE, ROOT, TOLERANCE, env, max_difference, run


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 oracle dialogues (train tasks 3 and 40, 2 attempts each), collected once for both SFT checks; the tiny model
    beside them is built by the first SFT run and reused by the rest (``--tiny_model_dir``)."""
    inputs = tmp_path_factory.mktemp("sft-inputs")
    collect = [sys.executable, "collect_trajectories.py", "--teacher", "oracle", "--tasks", "3,40", "--attempts", "2",
               "--output_dir", str(inputs / "trajectories"), "--hub_dir", str(inputs / "hub-data")]  # fmt: skip
    subprocess.run(collect, cwd=ROOT, env=env(), check=True, capture_output=True, timeout=300)
    return inputs


def sft_argv(launch: list[str], inputs: Path, out: Path, name: str, rows: int) -> list[str]:
    return [*LAUNCH, *launch, "train_sft.py", "--config", "recipes/sft/cpu_smoke.yaml",
            "--dataset_path", str(inputs / "trajectories" / "dataset"), "--per_device_train_batch_size", str(rows),
            "--gradient_accumulation_steps", "1", "--max_steps", "4", "--save_steps", "4",
            "--output_dir", str(out / name), "--run_name", name, "--hub_dir", str(out / f"hub-{name}"),
            "--report_to", "none", "--tiny_model_dir", str(inputs / "tiny")]  # fmt: skip


def losses(output_dir: Path, step: int) -> list[float]:
    state = json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text(encoding="utf-8"))
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def final_weights(output_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(output_dir)
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def sft_against_one_process(tmp_path: Path, sft_inputs: Path, launch: list[str], name: str) -> str:
    """Issue 36.4: 2 processes × 2 accumulation steps against 1 process × 4 (one dialogue a micro-batch, 3 steps):
    the loss is normalised by the tokens of the whole global batch (transformers' ``num_items_in_batch``, counted over
    the accumulation steps and, with ``average_tokens_across_devices``, over the processes), so the logged loss curve
    and the weights agree. The sharded launch's log."""
    steps = ["--max_steps", "3", "--save_steps", "3"]
    one = [*sft_argv(ONE, sft_inputs, tmp_path, "one", 1), "--gradient_accumulation_steps", "4", *steps]
    two = [*sft_argv(launch, sft_inputs, tmp_path, name, 1), "--gradient_accumulation_steps", "2", *steps]
    run(one, tmp_path / "one.log", tmp_path / "probe")
    text = run(two, tmp_path / f"{name}.log", tmp_path / "probe")
    first, sharded = losses(tmp_path / "one", 3), losses(tmp_path / name, 3)
    assert len(first) == len(sharded) == 3
    assert sharded == pytest.approx(first, abs=1e-4), (first, sharded)
    difference = max_difference(final_weights(tmp_path / name), final_weights(tmp_path / "one"))
    print(f"SFT {name}, 2 processes x 2 accumulation vs 1 x 4: max abs weight difference {difference:.3g}")
    assert difference <= TOLERANCE, difference
    return text


@pytest.mark.slow
def test_sft_under_fsdp2_with_accumulation_trains_what_one_process_trains(tmp_path: Path, sft_inputs: Path) -> None:
    """One sharded SFT pair checks what two pairs did: FSDP2 follows the one-process loss curve and ends with its
    weights, gradient accumulation included, and saves a sharded checkpoint."""
    text = sft_against_one_process(tmp_path, sft_inputs, FSDP2, "fsdp2")
    assert "sharding: FSDP2 (2 processes, cpu)" in text
    assert (tmp_path / "fsdp2" / "checkpoint-3" / "pytorch_model_fsdp_0").is_dir()


@pytest.mark.slow
@pytest.mark.exhaustive
def test_sft_under_ddp_with_accumulation_trains_what_one_process_trains(tmp_path: Path, sft_inputs: Path) -> None:
    """The same under DDP (CI runs FSDP2's, above)."""
    text = sft_against_one_process(tmp_path, sft_inputs, DDP, "ddp")
    assert "sharding: DDP (2 processes, cpu)" in text
