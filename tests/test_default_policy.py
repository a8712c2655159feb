"""The default policy's cache (rebuilt when missing, half-written or from another builder version; never loaded
half-written), the per-step console line and the learning-curve plot. The real warm-up build (a minute or two) runs in
the slow tests/test_default_learning.py; here ``_build`` is replaced by a fast fake that writes the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tau2_rl.data import default_policy
from tau2_rl.data.tiny_model import BUILD_INFO_FILE
from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import DomainEnv
from tau2_rl.evaluation.learning_curve import heldout_tags, plot_learning_curve, quarter_gain, read_run_scalars
from tau2_rl.run.console import format_step_line

AIRLINE = get_domain("airline")


@pytest.fixture
def fake_build(monkeypatch):
    """Counts builds; each writes the files of a model directory with distinct content."""
    calls: list[Path] = []

    def build(work, tmp_dir, tasks, params, data_dir, specs):
        calls.append(tmp_dir)
        tmp_dir.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (tmp_dir / name).write_text(f"{name} build {len(calls)}")
        return {"params": params, "files": {p.name: p.stat().st_size for p in tmp_dir.iterdir()}}

    monkeypatch.setattr(default_policy, "_build", build)
    return calls


def test_cache_is_built_once_then_reused(tmp_path, fake_build):
    out = tmp_path / "policy"
    assert default_policy.build_default_policy(out, ["3"], epochs=2, specs=[AIRLINE]) == out
    assert default_policy.build_default_policy(out, ["3"], epochs=2, specs=[AIRLINE]) == out
    assert len(fake_build) == 1
    assert json.loads((out / BUILD_INFO_FILE).read_text())["params"]["tasks"] == ["3"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".policy.tmp") or ".work" in p.name]


@pytest.mark.parametrize("damage", ["no_build_info", "truncated_weights", "missing_file", "other_version"])
def test_damaged_or_foreign_cache_is_rebuilt(tmp_path, fake_build, damage):
    out = tmp_path / "policy"
    default_policy.build_default_policy(out, ["3"], epochs=2, specs=[AIRLINE])
    if damage == "no_build_info":  # interrupted before build_info.json was written
        (out / BUILD_INFO_FILE).unlink()
    elif damage == "truncated_weights":
        (out / "model.safetensors").write_text("half")
    elif damage == "missing_file":
        (out / "tokenizer.json").unlink()
    else:
        info = json.loads((out / BUILD_INFO_FILE).read_text())
        info["params"]["policy_builder_version"] = -1
        (out / BUILD_INFO_FILE).write_text(json.dumps(info))
    default_policy.build_default_policy(out, ["3"], epochs=2, specs=[AIRLINE])
    assert len(fake_build) == 2
    assert (out / "model.safetensors").read_text() == "model.safetensors build 2"


def test_other_settings_are_another_build(tmp_path, fake_build):
    out = tmp_path / "policy"
    default_policy.build_default_policy(out, ["3"], epochs=2, specs=[AIRLINE])
    default_policy.build_default_policy(out, ["3"], epochs=3, specs=[AIRLINE])
    assert len(fake_build) == 2


def test_a_failed_build_leaves_the_previous_one(tmp_path, fake_build, monkeypatch):
    out = tmp_path / "policy"
    default_policy.build_default_policy(out, ["3"], epochs=2, specs=[AIRLINE])

    def broken(work, tmp_dir, tasks, params, data_dir, specs):
        tmp_dir.mkdir(parents=True)
        (tmp_dir / "model.safetensors").write_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_policy, "_build", broken)
    with pytest.raises(KeyboardInterrupt):
        default_policy.build_default_policy(out, ["3"], epochs=2, force=True, specs=[AIRLINE])
    assert (out / "model.safetensors").read_text() == "model.safetensors build 1"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_foreign_directory_is_not_overwritten(tmp_path, fake_build):
    out = tmp_path / "policy"
    out.mkdir()
    (out / "my_notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="policy"):
        default_policy.build_default_policy(out, ["3"], epochs=2, specs=[AIRLINE])
    assert not fake_build


def test_bad_arguments_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--warmup_epochs"):
        default_policy.build_default_policy(tmp_path / "p", ["3"], epochs=0, specs=[AIRLINE])
    with pytest.raises(ValueError, match="--warmup_tasks"):
        default_policy.build_default_policy(tmp_path / "p", [], epochs=1, specs=[AIRLINE])


def test_step_line_is_one_readable_line():
    logs = {"episode/outcome_reward": 0.25, "reward_std": 0.4, "episode/truncation_rate": 0.125,
            "episode/group_saturation": 0.5, "episode/turns": 4.5, "episode/tool_calls": 2.0, "loss": 0.0123,
            "timing/rollout": 3.0, "clip_ratio/low_min": None}  # fmt: skip
    line = format_step_line(3, 16, logs, 21.44)
    assert line == (
        "step 3/16 | reward 0.250 | std 0.400 | trunc 0.12 | sat 0.50 | turns 4.5 | tool calls 2.0 | loss 0.0123 "
        "| 21.4 s"
    )
    assert "\n" not in line


def _write_events(directory: Path, series: dict[str, list[float]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory))
    for tag, values in series.items():
        for step, value in enumerate(values, start=1):
            writer.add_scalar(tag, value, step)
    writer.close()


def test_learning_curve_from_synthetic_events_with_heldout_pass1(tmp_path):
    run = tmp_path / "run"
    rewards = [0.1, 0.2, 0.2, 0.3, 0.4, 0.5, 0.5, 0.6]
    _write_events(
        run / "runs" / "a",
        {
            "train/episode/outcome_reward": rewards,
            "train/episode/process_reward": [-0.1] * 8,
            "train/episode/truncation_rate": [0.0] * 8,
            "train/episode/group_saturation": [0.5] * 8,
            "eval/pass^1": [0.2, 0.3, 0.4],
            "eval/pass^4": [0.0, 0.1, 0.1],
        },
    )
    scalars = read_run_scalars(run)
    assert [v for _, v in scalars["train/episode/outcome_reward"]] == pytest.approx(rewards)
    assert heldout_tags(scalars) == {"pass^1": "eval/pass^1", "pass^4": "eval/pass^4"}
    first, last, gain = quarter_gain(rewards)
    assert (first, last) == pytest.approx((0.15, 0.55)) and gain == pytest.approx(0.4)
    out = plot_learning_curve(scalars, run / "curve.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in run.iterdir() if p.suffix == ".png"] == ["curve.png"]  # no temporary file left


def test_resumed_run_events_are_merged_later_file_wins(tmp_path, capsys):
    run = tmp_path / "run"
    _write_events(run / "runs" / "first", {"train/episode/outcome_reward": [0.1, 0.2, 0.3]})
    import os
    import time

    later = run / "runs" / "second"
    _write_events(later, {"train/episode/outcome_reward": [0.1, 0.9]})  # steps 1-2 again (resumed at 1)
    for path in later.iterdir():
        os.utime(path, (time.time() + 10, time.time() + 10))
    values = dict(read_run_scalars(run)["train/episode/outcome_reward"])
    assert values == pytest.approx({1: 0.1, 2: 0.9, 3: 0.3})
    import plot_run

    plot_run.main([str(run)])
    assert "merged 2 event files (one per start of the run" in capsys.readouterr().out


def test_plot_run_errors_name_the_directory(tmp_path, capsys):
    """One line naming the directory, exit 2 as every other tool (issue 23.7: plot_run.py exited 1)."""
    import plot_run

    for argv, expected in (([str(tmp_path / "missing")], "does not exist"), ([], "run_dir"),
                           ([str(tmp_path), "--out", "x.png"], "--out")):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            plot_run.main(argv)
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and expected in err and "\n" not in err and "usage" not in err, err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        plot_run.main([str(tmp_path / "empty")])
    assert info.value.code == 2 and "no TensorBoard event file" in capsys.readouterr().err


def test_leftovers_of_a_killed_build_are_cleaned(tmp_path, fake_build):
    stale = [tmp_path / ".policy.work-dead0000", tmp_path / ".policy.tmp-dead0000"]
    for directory in stale:
        directory.mkdir()
        (directory / "model.safetensors").write_text("partial")
    default_policy.build_default_policy(tmp_path / "policy", ["3"], epochs=2, specs=[AIRLINE])
    assert not any(d.exists() for d in stale)


def test_warmup_data_mixes_the_teachers_and_steps_once_per_epoch(tmp_path, monkeypatch):
    """The real ``_build`` up to SFT: collect each teacher of WARMUP_TEACHERS (its rows repeated by its weight) into
    one dataset, then train_sft on all of it (``--min_reward 0``, one optimiser step per epoch over all rows)."""
    import train_sft as real_train_sft
    from tau2_rl.data import tiny_model
    from tau2_rl.data.collect import decode_rows, load_trajectories

    seen = {}

    def fake_main(script_args, training_args, model_args):
        seen["rows"] = decode_rows(load_trajectories(script_args.dataset_path))
        seen["args"] = (script_args, training_args)
        out = Path(training_args.output_dir)
        out.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (out / name).write_text(name)
        return {"metrics": {"train_loss": 0.5}}

    fake = type("FakeTrainSFT", (), {"make_parser": staticmethod(real_train_sft.make_parser),
                                     "main": staticmethod(fake_main)})  # fmt: skip
    monkeypatch.setattr(default_policy, "_load_train_sft", lambda: fake)
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda directory, **kwargs: directory)
    out = default_policy.build_default_policy(tmp_path / "policy", ["3", "40"], epochs=3, specs=[AIRLINE])
    rows = seen["rows"]
    per_teacher = {t: sorted(r["task_id"] for r in rows if r["teacher"] == t) for t in AIRLINE.warmup_teachers}
    assert per_teacher == {"oracle": ["3", "40"], "noop": ["3", "3", "40", "40"]}
    assert {r["reward"] for r in rows if r["teacher"] == "oracle"} == {1.0}
    assert {r["reward"] for r in rows if r["teacher"] == "noop"} == {0.0}
    assert all(r["messages"][0]["content"] == AIRLINE.compact_prompt for r in rows)
    script_args, training_args = seen["args"]
    assert script_args.min_reward == 0
    assert training_args.gradient_accumulation_steps == len(rows) == 6
    assert training_args.per_device_train_batch_size == 1
    assert training_args.num_train_epochs == 3
    info = json.loads((out / BUILD_INFO_FILE).read_text())
    assert info["params"]["teachers"] == {"oracle": 1, "noop": 2} and info["trajectories"] == 6
    # the policy records the prompt it was trained with, so evaluate.py and train_grpo.py prompt it the same way
    from tau2_rl.envs.prompt_style import PROMPT_STYLE_FILE, read_prompt_style

    assert read_prompt_style(out) == "compact" and PROMPT_STYLE_FILE in info["files"]


def test_a_real_build_leaves_the_callers_log_levels_and_random_state_alone(tmp_path) -> None:
    """Issue 23.5: after the default policy was built in-process (train_sft.main at --log_level warning), the
    caller's "held-out eval at step N" and "exported hub/..." INFO lines were never printed; the build also reseeded
    Python's and NumPy's generators. One warm-up epoch (shrunk from 96): a few seconds."""
    import logging
    import random

    import numpy as np
    import torch
    import transformers

    ours = logging.getLogger("tau2_rl")
    level, verbosity = ours.level, transformers.utils.logging.get_verbosity()
    ours.setLevel(logging.INFO)
    try:
        random.seed(123), np.random.seed(123), torch.manual_seed(123)
        default_policy.build_default_policy(tmp_path / "policy", ["3"], epochs=1, specs=[AIRLINE])
        assert ours.level == logging.INFO and logging.getLogger("tau2_rl.run.hub").isEnabledFor(logging.INFO)
        assert transformers.utils.logging.get_verbosity() == verbosity
        after = random.random(), float(np.random.random()), float(torch.rand(1))
        random.seed(123), np.random.seed(123), torch.manual_seed(123)
        assert after == (random.random(), float(np.random.random()), float(torch.rand(1)))
    finally:
        ours.setLevel(level)


def test_an_output_dir_outside_outputs_reuses_the_default_policy_cache(tmp_path, monkeypatch):
    """Issue 23.7: ``--output_dir /elsewhere/run`` built the default policy again in /elsewhere/."""
    import train_grpo

    built = []
    monkeypatch.setattr(default_policy, "build_default_policy", lambda directory, *a, **k: built.append(directory))
    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "grpo" / "cpu_smoke.yaml")
    for output_dir in ("outputs/grpo-cpu-smoke", str(tmp_path / "elsewhere" / "run")):
        argv = ["--config", recipe, "--output_dir", output_dir]
        script_args, training_args, model_args = train_grpo.parse_args(argv)
        train_grpo.resolve_model_path(model_args, script_args, training_args.output_dir, DomainEnv(AIRLINE))
    assert built == [Path("outputs") / "default-policy-t3_40-e96"] * 2
    argv = ["--config", recipe, "--warmup_cache_dir", str(tmp_path / "cache")]
    script_args, training_args, model_args = train_grpo.parse_args(argv)
    train_grpo.resolve_model_path(model_args, script_args, training_args.output_dir, DomainEnv(AIRLINE))
    assert built[-1] == tmp_path / "cache" / "default-policy-t3_40-e96"


def test_a_stop_during_the_build_says_the_build_is_discarded(tmp_path, monkeypatch, capsys):
    """Issue 31.5: a Ctrl-C in the build's SFT printed "checkpoint saved in …/.default-policy-….work-…/sft/…; rerun
    to resume", but that directory is removed with the stop and the rerun builds from scratch. The real build (task 3,
    2 epochs) with a stop signal at its first step."""
    import signal

    from tau2_rl.run import stop as graceful_stop

    original = graceful_stop.GracefulStop.on_step_begin

    def stop_at_first_step(self, args, state, control, **kwargs):
        original(self, args, state, control, **kwargs)
        if state.global_step == 0:
            self._handle(signal.SIGUSR1, None)  # what a kill -USR1 (or a Ctrl-C) would do

    monkeypatch.setattr(graceful_stop.GracefulStop, "on_step_begin", stop_at_first_step)
    out = tmp_path / "policy"
    with pytest.raises(SystemExit) as info:
        default_policy.build_default_policy(out, ["3"], epochs=2, specs=[AIRLINE])
    assert info.value.code == graceful_stop.EXIT_STOPPED
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        "stopped by SIGUSR1 at step 1 of the default-policy build (2 SFT epochs): it is discarded, not resumable; "
        "rerun the same command to build it again from the start"
    )
    assert not out.exists()  # nothing half-built is left to resume from (the lock file stays, as after any build)
    assert not [p for p in tmp_path.glob(".policy.*") if p.is_dir()]


def test_the_build_prints_no_summary_of_its_scratch_sft(tmp_path, capsys, caplog):
    """Issue 31.8: the quick start printed the build's SFT summary, ``done: 0 steps … final model
    outputs/.default-policy-…work-…/sft | hub revision …``: 96 epochs trained, both paths gone a moment later."""
    import logging

    out = tmp_path / "policy"
    with caplog.at_level(logging.WARNING, logger="tau2_rl.data.default_policy"):
        default_policy.build_default_policy(out, ["3"], epochs=2, specs=[AIRLINE])
    printed = capsys.readouterr().out
    assert "done:" not in printed and ".work-" not in printed, printed
    assert any(f"default policy: built {out} in" in r.getMessage() and "SFT: 2 epochs" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # a long build says each phase as it starts, with the time so far (issue 68: a three-domain build took 413 s)
    phases = [r.getMessage() for r in caplog.records if "so far)" in r.getMessage()]
    assert [p.split(" (")[0] for p in phases] == [
        "default policy: playing the oracle teacher on airline task(s) 3",
        "default policy: playing the noop teacher on airline task(s) 3",
        "default policy: SFT on 3 rows, 2 epochs",
    ], phases


def test_the_summary_counts_the_steps_done_not_the_last_logged_one(tmp_path):
    from tau2_rl.run.console import summary_line

    history = [{"step": 90, "loss": 0.5}]  # logging_steps 10 over a 96-step run
    assert summary_line(history, str(tmp_path), None, None, None, steps_done=96).startswith("done: 96 steps")
    assert summary_line([], str(tmp_path), None, None, None, steps_done=96).startswith("done: 96 steps")
