"""Resume only the same run (``tau2_rl/run/guard.py``): refuse another configuration's checkpoints, and make a rerun
of a finished run a no-op, for ``train_sft.py`` and ``train_grpo.py``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_sft import model_dir, run_train_sft, short_dataset  # noqa: F401 (fixtures)

import train_grpo
from tau2_rl.run.checkpoints import seal_checkpoint
from tau2_rl.run.guard import RUN_CONFIG_FILE, RunGuardError, claim_output_dir, decide_resume, write_run_config
from tau2_rl.run.hub import read_refs

FINGERPRINT = {"model": "/models/a", "variant": "joint", "tasks": ["0", "1"], "data_dir": None}
LENGTH = {"max_steps": 4, "num_train_epochs": 3.0}


def checkpoint(output_dir: Path, step: int) -> Path:
    """A whole checkpoint as far as resume checks (run/checkpoints.py): its trainer state and its seal."""
    path = output_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    seal_checkpoint(path, step)
    return path


def test_a_fresh_or_empty_output_dir_starts_fresh(tmp_path: Path) -> None:
    assert decide_resume(tmp_path / "missing", FINGERPRINT, LENGTH).checkpoint is None
    assert decide_resume(tmp_path, FINGERPRINT, LENGTH).checkpoint is None


def test_the_same_run_resumes_its_last_checkpoint(tmp_path: Path) -> None:
    write_run_config(tmp_path, FINGERPRINT, LENGTH)
    checkpoint(tmp_path, 2)
    last = checkpoint(tmp_path, 3)
    decision = decide_resume(tmp_path, dict(FINGERPRINT), LENGTH)
    assert decision.checkpoint == str(last) and not decision.complete


def test_another_configuration_is_refused_naming_fields_and_flags(tmp_path: Path) -> None:
    write_run_config(tmp_path, FINGERPRINT, LENGTH)
    checkpoint(tmp_path, 3)
    other = {**FINGERPRINT, "model": "outputs/sft", "variant": "lata"}
    with pytest.raises(RunGuardError) as err:
        decide_resume(tmp_path, other, LENGTH)
    message = str(err.value)
    assert "\n" not in message
    assert "model: /models/a → outputs/sft" in message and "variant: joint → lata" in message
    assert "tasks" not in message
    assert "--overwrite_output_dir true" in message and "--resume_from_checkpoint" in message
    assert "checkpoint-3" in message
    # the two ways out: start over, or resume that checkpoint explicitly (HF Trainer conventions)
    assert decide_resume(tmp_path, other, LENGTH, overwrite_output_dir=True).checkpoint is None
    explicit = str(tmp_path / "checkpoint-3")
    assert decide_resume(tmp_path, other, LENGTH, resume_from_checkpoint=explicit).checkpoint == explicit


def test_a_checkpoint_without_a_run_config_is_refused(tmp_path: Path) -> None:
    checkpoint(tmp_path, 1)
    with pytest.raises(RunGuardError, match=f"no {RUN_CONFIG_FILE}"):
        decide_resume(tmp_path, FINGERPRINT, LENGTH)


def test_a_missing_explicit_checkpoint_and_a_corrupt_run_config_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(RunGuardError, match="--resume_from_checkpoint"):
        decide_resume(tmp_path, FINGERPRINT, LENGTH, resume_from_checkpoint=str(tmp_path / "nope"))
    checkpoint(tmp_path, 1)
    (tmp_path / RUN_CONFIG_FILE).write_text("{not json")
    with pytest.raises(RunGuardError, match="unreadable"):
        decide_resume(tmp_path, FINGERPRINT, LENGTH)


def test_a_completed_run_is_complete_unless_asked_to_train_longer(tmp_path: Path) -> None:
    last = checkpoint(tmp_path, 4)
    write_run_config(tmp_path, FINGERPRINT, LENGTH, completed=True, global_step=4)
    decision = decide_resume(tmp_path, FINGERPRINT, LENGTH)
    assert decision.complete and "is complete (step 4, max_steps 4)" in decision.message
    longer = decide_resume(tmp_path, FINGERPRINT, {**LENGTH, "max_steps": 8})
    assert not longer.complete and longer.checkpoint == str(last)
    with pytest.raises(RunGuardError):  # complete or not, another configuration is refused
        decide_resume(tmp_path, {**FINGERPRINT, "variant": "vanilla"}, LENGTH)


def test_claim_output_dir_records_on_rank_0_only_and_marks_completion(tmp_path: Path) -> None:
    def args(rank: int, max_steps: int = 4) -> SimpleNamespace:
        return SimpleNamespace(output_dir=str(tmp_path), max_steps=max_steps, num_train_epochs=3.0,
                               resume_from_checkpoint=None, process_index=rank)  # fmt: skip

    record = claim_output_dir(args(rank=1), FINGERPRINT, overwrite_output_dir=False)
    assert record.decision.checkpoint is None and not (tmp_path / RUN_CONFIG_FILE).exists()
    record = claim_output_dir(args(rank=0), FINGERPRINT, overwrite_output_dir=False)
    stored = json.loads((tmp_path / RUN_CONFIG_FILE).read_text())
    assert stored["fingerprint"] == FINGERPRINT and stored["length"] == LENGTH and not stored["completed"]

    checkpoint(tmp_path, 4)
    record.mark_complete(4)
    again = claim_output_dir(args(rank=0), FINGERPRINT, overwrite_output_dir=False)
    assert again.decision.complete and "step 4" in again.decision.message
    assert json.loads((tmp_path / RUN_CONFIG_FILE).read_text())["completed"]  # a no-op rerun leaves the record
    longer = claim_output_dir(args(rank=0, max_steps=8), FINGERPRINT, overwrite_output_dir=False)
    assert longer.decision.checkpoint == str(tmp_path / "checkpoint-4") and not longer.decision.complete
    with pytest.raises(RunGuardError, match="variant"):
        claim_output_dir(args(rank=0), {**FINGERPRINT, "variant": "lata"}, overwrite_output_dir=False)


def test_train_sft_rerun_is_a_no_op_and_another_model_is_refused(tmp_path, model_dir, short_dataset) -> None:  # noqa: F811
    short_dataset.save_to_disk(str(tmp_path / "data"))
    first = run_train_sft(tmp_path, model_dir, tmp_path / "data", "--max_length", "1024")
    refs = read_refs(tmp_path / "hub" / "sft-test")
    stored = json.loads((tmp_path / "sft" / RUN_CONFIG_FILE).read_text())
    assert stored["completed"] and stored["global_step"] == 2 and first["hub_path"]
    again = run_train_sft(tmp_path, model_dir, tmp_path / "data", "--max_length", "1024")
    assert again["complete"] and "is complete (step 2, max_steps 2)" in again["message"]
    assert read_refs(tmp_path / "hub" / "sft-test") == refs  # the hub's main did not move
    with pytest.raises(RunGuardError, match="max_length: 1024 → 512"):
        run_train_sft(tmp_path, model_dir, tmp_path / "data", "--max_length", "512")


def grpo_argv(model: Path, output_dir: Path, hub_dir: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(model), "--output_dir", str(output_dir), "--hub_dir", str(hub_dir),
        "--tasks", "0", "--task_repeats", "2", "--num_generations", "2", "--per_device_train_batch_size", "2",
        "--max_steps", "2", "--save_steps", "1", "--max_turns", "2", "--max_turn_tokens", "8",
        "--max_completion_length", "128", "--use_cpu", "true", "--bf16", "false", "--report_to", "none",
        "--variant", "vanilla", "--gradient_checkpointing", "false", "--disable_tqdm", "true", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_train_grpo_rerun_is_a_no_op_and_another_run_is_refused(
    tmp_path: Path,
    model_dir: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The README's sequence: a run, the same command again (must not train step 3 of 2 nor move the hub's main), then
    GRPO from another model into the same output_dir (must not resume the first run's weights)."""
    out, hub = tmp_path / "grpo", tmp_path / "hub"
    train_grpo.main(*train_grpo.parse_args(grpo_argv(model_dir, out, hub)))
    refs = read_refs(hub / "grpo")
    state = json.loads((out / "trainer_state.json").read_text())
    assert refs["main"] == "step-000002" and state["global_step"] == 2
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train_grpo.main(*train_grpo.parse_args(grpo_argv(model_dir, out, hub)))
    assert any("is complete (step 2, max_steps 2): nothing to do" in r.getMessage() for r in caplog.records)
    assert read_refs(hub / "grpo") == refs
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    with pytest.raises(SystemExit, match=r"^error: --output_dir .* holds another run \(checkpoint-2\): model: "):
        train_grpo.main(*train_grpo.parse_args(grpo_argv(out, out, hub)))
