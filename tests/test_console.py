"""The console: the evaluation bar moves per episode, None-valued log entries never reach the reporters, TRL's luspo
advice is silenced (it does not apply to per-token advantages), other warnings are not."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tau2_rl.configs import EvalArguments
from tau2_rl.evaluation import evaluator as evaluator_module
from tau2_rl.evaluation import run_evaluation
from tau2_rl.run.console import DropNoneLogs, silence_known_warnings


class RecordingBar:
    updates: list[int] = []

    def __init__(self, *args, **kwargs) -> None:
        RecordingBar.updates = []

    def update(self, n: int = 1) -> None:
        RecordingBar.updates.append(n)

    def close(self) -> None:
        pass


def test_the_evaluation_bar_moves_per_episode_not_per_chunk(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(evaluator_module, "tqdm", RecordingBar)
    args = EvalArguments(output_dir=str(tmp_path), model="oracle", tasks="0,1,2,3,4,5,6,7", num_samples=1,
                         batch_size=0, progress=True, bootstrap_samples=100, protocol="tau2_rl")  # fmt: skip
    run_evaluation(args)
    assert sum(RecordingBar.updates) == 8
    assert len(RecordingBar.updates) > 1  # one chunk of 8 episodes, yet the bar moved as they finished


def test_none_values_are_dropped_from_logs() -> None:
    logs = {"loss": 0.5, "eval/pass1": None, "step": 3}
    DropNoneLogs().on_log(None, None, None, logs=logs)
    assert logs == {"loss": 0.5, "step": 3}


def test_only_the_luspo_advice_is_silenced(caplog: pytest.LogCaptureFixture) -> None:
    silence_known_warnings()
    trl_logger = logging.getLogger("trl.trainer.grpo_trainer")
    with caplog.at_level(logging.WARNING, logger="trl.trainer.grpo_trainer"):
        trl_logger.warning(
            "[RANK 0] When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to "
            "mirror the paper's setup."
        )
        trl_logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_a_step_line_says_when_its_time_includes_an_evaluation_and_a_save(monkeypatch, capsys) -> None:
    """Issue 23.6: step 17's 184 s (an evaluation and a save after step 16) read as a slow step. The Trainer logs a
    step, then evaluates, then saves, so their time lands in the next step's line; it now says how much, and (issue
    51.3) names the step they belong to."""
    from types import SimpleNamespace

    from tau2_rl.run import console

    clock = iter([0.0, 5.0, 155.0, 158.0, 184.0, 190.0])
    monkeypatch.setattr(console.time, "perf_counter", lambda: next(clock))
    lines = console.StepLineCallback()
    state = SimpleNamespace(is_world_process_zero=True, global_step=16, max_steps=32)
    args = SimpleNamespace(output_dir="out", save_steps=16)
    lines.on_train_begin(args, state, None)  # 0.0
    capsys.readouterr()
    lines.on_log(args, state, None, logs={"loss": 0.1})  # 5.0: step 16
    lines.on_evaluate(args, state, None)  # 155.0: a 150 s evaluation
    lines.on_save(args, state, None)  # 158.0: a 3 s save
    state.global_step = 17
    lines.on_log(args, state, None, logs={"loss": 0.2})  # 184.0: step 17
    state.global_step = 18
    lines.on_log(args, state, None, logs={"loss": 0.3})  # 190.0: step 18
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("| 5.0 s")
    assert out[1].endswith("| 179.0 s incl. step 16's eval 150.0 s + save 3.0 s")
    assert out[2].endswith("| 6.0 s")
    # with --logging_steps > 1 a line's interval can hold the evaluations and saves of several steps
    extras = [("eval", 16, 1.0), ("save", 16, 2.0), ("save", 18, 3.0)]
    assert console.named_steps(extras) == [("step 16's eval", 1.0), ("save", 2.0), ("step 18's save", 3.0)]


def test_the_run_ends_with_one_summary_line(tmp_path: Path) -> None:
    """Issue 23.5: the run's last line says where everything is and how the reward moved."""
    from tau2_rl.run.console import summary_line

    (tmp_path / "checkpoint-8").mkdir()
    rewards = [0, 0, 1, 1, 1, 1, 1, 1]
    history = [{"loss": 0.1, "step": s, "episode/outcome_reward": r} for s, r in enumerate(rewards, start=1)]
    line = summary_line(history + [{"train_runtime": 9.0, "step": 8}], str(tmp_path), "hub/r/step-000008",
                        str(tmp_path / "runs" / "x"), 245.0)  # fmt: skip
    assert "\n" not in line and line.startswith("done: 8 steps in 4 min 5 s")
    assert "reward 0.000 → 1.000 (+1.000, first → last quarter)" in line
    assert f"last checkpoint {tmp_path / 'checkpoint-8'}" in line and "hub revision hub/r/step-000008" in line
    assert f"TensorBoard {tmp_path / 'runs' / 'x'}" in line and f"python plot_run.py {tmp_path}" in line


def test_a_resumed_runs_summary_says_its_time_covers_the_resumed_steps_only(tmp_path: Path) -> None:
    """Issue 36.6: after a resume the summary read ``done: 32 steps in 7 min 25 s`` for 16 steps' time."""
    from tau2_rl.run.console import summary_line

    history = [{"loss": 0.1, "step": s, "episode/outcome_reward": 0.5} for s in range(1, 33)]
    line = summary_line(history, str(tmp_path), None, None, 445.0, steps_done=32, resumed_from=16)
    assert line.startswith("done: 32 steps (resumed at step 16: the last 16 in 7 min 25 s) | reward 0.500"), line


def test_a_ratio_of_max_steps_is_not_reported_as_a_mismatch_on_resume(caplog) -> None:
    """Issue 23.7: every resume printed transformers' "eval_steps: 0.5 (from args) != 3 (from trainer_state.json)"."""
    from types import SimpleNamespace

    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import compare_trainer_and_checkpoint_args

    from tau2_rl.run.console import ratio_steps_are_no_mismatch

    ratio_steps_are_no_mismatch(max_steps=6)
    state = TrainerState(logging_steps=1, eval_steps=3, save_steps=2, train_batch_size=4)
    same = SimpleNamespace(logging_steps=1, eval_steps=0.5, save_steps=2, per_device_train_batch_size=4, n_gpu=0)
    with caplog.at_level(logging.WARNING, logger="transformers.trainer_utils"):
        compare_trainer_and_checkpoint_args(same, state)
        assert "do not match" not in caplog.text
        other = SimpleNamespace(**{**vars(same), "save_steps": 5, "logging_steps": 0.5})  # a real change stays
        compare_trainer_and_checkpoint_args(other, state)
    assert "save_steps: 5 (from args) != 2" in caplog.text and "eval_steps" not in caplog.text
    assert "logging_steps: 0.5 (from args) != 1" in caplog.text  # ceil(0.5 × 6) = 3, not the stored 1
