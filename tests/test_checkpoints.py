"""A checkpoint is whole or it is not resumed; one trainer per output_dir; saved files honour the umask."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tau2_rl.files import honour_umask
from tau2_rl.run.checkpoints import SEAL_FILE, checkpoint_problem, newest_complete_checkpoint, seal_checkpoint
from tau2_rl.run.guard import RunGuardError, decide_resume, write_run_config
from tau2_rl.run.lock import OutputDirLock, OutputDirLockedError


def _checkpoint(output_dir: Path, step: int, *, seal: bool = True) -> Path:
    """A checkpoint as the Trainer writes it (weights, trainer state), sealed as CheckpointSeal seals it."""
    path = output_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path / "model.safetensors"))
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if seal:
        seal_checkpoint(path, step)
    return path


def test_a_sealed_checkpoint_is_whole(tmp_path):
    assert checkpoint_problem(_checkpoint(tmp_path, 1)) is None


def test_a_truncated_safetensors_is_skipped_with_one_line_and_kept(tmp_path, caplog):
    older = _checkpoint(tmp_path, 2)
    newest = _checkpoint(tmp_path, 3)
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a disk that filled up
    with caplog.at_level(logging.WARNING):
        assert newest_complete_checkpoint(tmp_path) == str(older)
    assert [r.getMessage() for r in caplog.records] == [f"skipping {newest}: model.safetensors is truncated"]
    assert weights.is_file()  # never deleted


def test_a_truncated_safetensors_without_a_seal_is_caught_by_its_header(tmp_path):
    path = _checkpoint(tmp_path, 1, seal=False)  # a checkpoint written before seals existed
    assert checkpoint_problem(path) is None
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert checkpoint_problem(path) == "model.safetensors is truncated"


def test_a_half_written_sharded_checkpoint_is_skipped(tmp_path):
    """What a rank killed mid-save left: checkpoint-N/ holding only an empty pytorch_model_fsdp_0/."""
    older = _checkpoint(tmp_path, 1)
    half = tmp_path / "checkpoint-2" / "pytorch_model_fsdp_0"
    half.mkdir(parents=True)
    assert checkpoint_problem(half.parent) == "has no trainer_state.json (the save did not finish)"
    assert newest_complete_checkpoint(tmp_path) == str(older)


def test_an_unsealed_sharded_directory_without_metadata_is_refused(tmp_path):
    path = _checkpoint(tmp_path, 1, seal=False)
    (path / "pytorch_model_fsdp_0").mkdir()
    (path / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"x" * 10)
    assert checkpoint_problem(path) == "pytorch_model_fsdp_0 has no .metadata (the save did not finish on every rank)"


def test_a_dcp_directory_is_checked_against_its_metadata(tmp_path):
    """A real torch.distributed.checkpoint save (one process), then a shard cut short."""
    import torch.distributed.checkpoint as dcp

    path = _checkpoint(tmp_path, 1, seal=False)
    shard_dir = path / "pytorch_model_fsdp_0"
    dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(shard_dir), no_dist=True)
    assert checkpoint_problem(path) is None
    shard = next(shard_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert checkpoint_problem(path) == f"pytorch_model_fsdp_0 has a truncated {shard.name}"


def test_a_file_the_seal_lists_that_is_gone_or_shorter(tmp_path):
    path = _checkpoint(tmp_path, 1)
    (path / "optimizer.pt").write_bytes(b"0" * 100)
    seal_checkpoint(path, 1)
    (path / "optimizer.pt").write_bytes(b"0" * 40)
    assert checkpoint_problem(path) == "optimizer.pt is truncated"
    (path / "optimizer.pt").unlink()
    assert checkpoint_problem(path) == "lacks optimizer.pt"


def test_deepspeed_needs_its_latest_tag(tmp_path):
    path = _checkpoint(tmp_path, 1, seal=False)
    (path / "global_step1").mkdir()
    assert "no 'latest' tag" in checkpoint_problem(path)
    (path / "latest").write_text("global_step1")
    assert "no model states" in checkpoint_problem(path)
    (path / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert checkpoint_problem(path) is None


def test_resume_takes_the_newest_whole_checkpoint_and_refuses_a_broken_explicit_one(tmp_path):
    fingerprint, length = {"model": "m"}, {"max_steps": 4}
    write_run_config(tmp_path, fingerprint, length)
    whole = _checkpoint(tmp_path, 2)
    broken = _checkpoint(tmp_path, 3)
    (broken / SEAL_FILE).write_text("{")
    assert decide_resume(tmp_path, fingerprint, length).checkpoint == str(whole)
    with pytest.raises(RunGuardError, match=r"--resume_from_checkpoint .*checkpoint-3 has an unreadable"):
        decide_resume(tmp_path, fingerprint, length, resume_from_checkpoint=str(broken))
    for name in ("checkpoint-2", "checkpoint-3"):  # nothing deleted
        assert (tmp_path / name).is_dir()


def test_an_unsealed_checkpoint_of_a_sealing_run_is_skipped_even_with_its_trainer_state(tmp_path, caplog):
    """Rank 0 wrote trainer_state.json, another rank died before its part (its RNG state, say): never sealed."""
    fingerprint, length = {"model": "m"}, {"max_steps": 4}
    write_run_config(tmp_path, fingerprint, length)  # a run of this version: it seals from step 0
    whole = _checkpoint(tmp_path, 1)
    cut = _checkpoint(tmp_path, 2, seal=False)
    with caplog.at_level(logging.WARNING):
        assert decide_resume(tmp_path, fingerprint, length).checkpoint == str(whole)
    assert caplog.records[-1].getMessage() == (
        f"skipping {cut}: has no {SEAL_FILE} (a process stopped before every rank had finished writing it)"
    )


def test_a_run_begun_before_seals_resumes_its_unsealed_checkpoint_then_seals_from_there(tmp_path):
    fingerprint, length = {"model": "m"}, {"max_steps": 4}
    legacy = {"format": 1, "fingerprint": fingerprint, "length": length, "completed": False}
    (tmp_path / "run_config.json").write_text(json.dumps(legacy))
    old = _checkpoint(tmp_path, 2, seal=False)
    decision = decide_resume(tmp_path, fingerprint, length)
    assert decision.checkpoint == str(old) and decision.sealed_from_step == 2
    write_run_config(tmp_path, fingerprint, length, sealed_from_step=decision.sealed_from_step)
    cut = _checkpoint(tmp_path, 3, seal=False)  # written by this version and never sealed
    assert decide_resume(tmp_path, fingerprint, length).checkpoint == str(old)  # the old one still resumes
    assert cut.is_dir()


HOLDER = """
import sys, time
from tau2_rl.run.lock import OutputDirLock
OutputDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_trainer_in_one_output_dir_is_refused_until_the_first_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirLockedError) as err:
            OutputDirLock(tmp_path).acquire()
        line = str(err.value)
        assert "\n" not in line
        assert f"--output_dir {tmp_path} is in use by another run (pid {holder.pid} on host " in line
    finally:
        holder.kill()  # SIGKILL: no clean-up runs, yet the kernel drops the lock
        holder.wait()
    lock = OutputDirLock(tmp_path).acquire()  # the file left behind is no stale lock
    assert lock.held
    assert OutputDirLock(tmp_path).acquire() is lock  # a second run in the same process reuses it
    lock.release()


@pytest.mark.parametrize("umask,expected", [(0o022, 0o644), (0o077, 0o600)])
def test_saved_weights_honour_the_umask(tmp_path, umask, expected):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    previous = os.umask(umask)
    try:
        config = Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=32, vocab_size=64)  # fmt: skip
        Qwen2ForCausalLM(config).save_pretrained(tmp_path / "model")
        assert (tmp_path / "model" / "model.safetensors").stat().st_mode & 0o777 == 0o600  # transformers 5.17
        honour_umask(tmp_path / "model")
        path = _checkpoint(tmp_path / "out", 1)  # the seal applies it to a checkpoint
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [*(tmp_path / "model").iterdir(), *path.iterdir()]}
    assert set(modes.values()) == {expected}, modes


def test_lock_file_names_its_holder(tmp_path):
    lock = OutputDirLock(tmp_path).acquire()
    try:
        info = json.loads((tmp_path / ".run.lock").read_text())
        assert info["pid"] == os.getpid() and abs(info["started"] - time.time()) < 60
    finally:
        lock.release()


def test_an_explicit_resume_keeps_the_output_dirs_seal_rule(tmp_path):
    fingerprint, length = {"model": "m"}, {"max_steps": 4}
    other = _checkpoint(tmp_path / "other", 3)  # another run's whole checkpoint
    fresh = decide_resume(tmp_path / "new", fingerprint, length, resume_from_checkpoint=str(other))
    assert fresh.checkpoint == str(other) and fresh.sealed_from_step == 3  # this run writes steps 4.. sealed
    write_run_config(tmp_path / "own", fingerprint, length)  # a sealing run: from step 0
    own = decide_resume(tmp_path / "own", fingerprint, length, resume_from_checkpoint=str(other))
    assert own.sealed_from_step == 0
