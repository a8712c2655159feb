"""The console: the evaluation bar moves per episode, None-valued log entries never reach the reporters, TRL's luspo
advice is silenced (it does not apply to per-token advantages), other warnings are not."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from airline_rl.configs import EvalArguments
from airline_rl.console import DropNoneLogs, silence_known_warnings
from airline_rl.evaluation import evaluator as evaluator_module
from airline_rl.evaluation import run_evaluation


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
                         batch_size=0, progress=True, bootstrap_samples=100, protocol="airline_rl")  # fmt: skip
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
