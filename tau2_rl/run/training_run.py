"""The guard sequence both training scripts run, in one object: ``train_grpo.py`` and ``train_sft.py`` start, claim,
guard, train and finish a run by the same rule.

1. ``TrainingRun.begin``: seed and logging (``start.setup_run``), the optional packages a flag needs
   (``dependencies``), a writable ``--hub_dir``;
2. ``claim_hub``: ``<hub_dir>/<run_name>`` is this run's, not another's (``hub.claim_hub_run``);
3. ``claim_output_dir``: rank 0 locks ``output_dir`` (``lock``: a second trainer there is refused), then resume
   this run's newest whole checkpoint, refuse another run's, or find the run already complete
   (``guard.claim_output_dir``, ``checkpoints``);
4. ``guard``: on the built trainer, bf16 updates that would round away are refused (``precision``), the fraction of
   weights that moved is watched (``update_monitor``), each checkpoint is sealed once whole (``checkpoints``), and
   two resume warnings that do not apply are kept off the console (``console``);
5. ``train``: ``trainer.train`` from the claimed checkpoint, which a stop signal ends with a checkpoint
   (``stop.train_or_stop``); then the metrics and the trainer state are saved;
6. ``complete``: the run is recorded as finished (rank 0), so a rerun is a no-op.

A failure a user can cause is a ``HubError`` / ``RunGuardError`` naming the flag, which ``cli.run_main`` prints as
one line (``train_sft.py`` lists them as its input errors); with ``exit_on_input_errors`` (``train_grpo.py``, whose
``main`` exits on every bad input itself) it is that line as ``SystemExit("error: ...")`` at once. A missing optional
package is always the ``SystemExit``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tau2_rl.run.checkpoints import CheckpointSeal, checkpoint_step
from tau2_rl.run.console import ratio_steps_are_no_mismatch, tied_missing_keys_are_expected
from tau2_rl.run.deepspeed_cpu import DeepSpeedLaunchError
from tau2_rl.run.dependencies import MissingDependencyError, require_for_training
from tau2_rl.run.guard import RunGuardError, RunRecord, claim_output_dir
from tau2_rl.run.hub import HubError, claim_hub_run, ensure_writable
from tau2_rl.run.lock import OutputDirLock, OutputDirLockedError
from tau2_rl.run.precision import check_update_precision
from tau2_rl.run.start import setup_run
from tau2_rl.run.stop import train_or_stop
from tau2_rl.run.update_monitor import add_update_monitor


class TrainingRun:
    """One training run's claims on its directories, and the guards around its trainer."""

    def __init__(
        self, training_args: Any, hub_dir: str, logger: logging.Logger, *, exit_on_input_errors: bool = False
    ) -> None:
        self.args = training_args
        self.hub_dir = hub_dir
        self.logger = logger
        self.exit_on_input_errors = exit_on_input_errors
        self.run_name: str = training_args.run_name or Path(training_args.output_dir).name
        self.record: RunRecord | None = None
        self.lock: OutputDirLock | None = None

    @classmethod
    def begin(
        cls, training_args: Any, hub_dir: str, logger: logging.Logger, *, exit_on_input_errors: bool = False
    ) -> TrainingRun:
        """Step 1: before anything is read or built, so a missing package or an unwritable hub costs nothing."""
        run = cls(training_args, hub_dir, logger, exit_on_input_errors=exit_on_input_errors)
        setup_run(training_args, logger)
        try:
            require_for_training(training_args)  # --use_vllm / DeepSpeed: here, where the run starts
        except (MissingDependencyError, DeepSpeedLaunchError) as err:
            raise SystemExit(f"error: {err}") from None
        with run._input_errors():
            ensure_writable(hub_dir)
        return run

    @contextlib.contextmanager
    def _input_errors(self) -> Iterator[None]:
        try:
            yield
        except (HubError, RunGuardError, OutputDirLockedError) as err:
            if self.exit_on_input_errors:
                raise SystemExit(f"error: {err}") from None
            raise

    def claim_hub(self, *, overwrite: bool) -> None:
        """``<hub_dir>/<run_name>`` of another run (the recipes fix ``run_name``) would be overwritten by this run."""
        with self._input_errors():
            claim_hub_run(self.hub_dir, self.run_name, self.args.output_dir, overwrite=overwrite)

    def claim_output_dir(self, fingerprint: dict[str, Any], *, overwrite: bool) -> bool:
        """Claims ``output_dir`` for the run ``fingerprint`` describes; False when that run is already complete
        (a rerun trains nothing and exports nothing; the reason is logged)."""
        with self._input_errors():
            if self.args.process_index == 0:  # one trainer per output_dir, held until this process ends
                self.lock = OutputDirLock(self.args.output_dir).acquire()
            self.record = claim_output_dir(self.args, fingerprint, overwrite_output_dir=overwrite)
        if self.record.decision.complete:
            self.logger.info("%s", self.record.decision.message)
            return False
        return True

    @property
    def resumed_step(self) -> int | None:
        """The step of the checkpoint this run resumes (None: it starts at step 0)."""
        checkpoint = self.record.decision.checkpoint if self.record is not None else None
        return checkpoint_step(checkpoint) if checkpoint else None

    @property
    def complete_message(self) -> str:
        return self.record.decision.message if self.record is not None else ""

    def guard(self, trainer: Any, *, allow_rounded_updates: bool) -> None:
        """The checks and hooks every trainer gets once it is built (its accelerator decides the precision)."""
        check_update_precision(trainer, allow_rounded_updates)  # refuses bf16 weights that would not move
        add_update_monitor(trainer)
        tied_missing_keys_are_expected(trainer)  # no lm_head.weight warning on resume for tied embeddings
        ratio_steps_are_no_mismatch(self.args.max_steps)  # "eval_steps: 0.5 != 3" on every resume
        trainer.add_callback(CheckpointSeal())  # last: a checkpoint is sealed once every rank wrote it

    def train(self, trainer: Any) -> Any:
        """Trains from the claimed checkpoint (SIGTERM, also to the launcher: checkpoint, then exit); returns TRL's
        ``TrainOutput`` after its metrics and the trainer state are saved."""
        if self.record is None:
            raise RuntimeError("TrainingRun.train before claim_output_dir")
        checkpoint = self.record.decision.checkpoint
        if checkpoint:
            self.logger.info("resuming from %s", checkpoint)
        return train_or_stop(trainer, checkpoint)

    @staticmethod
    def save_metrics(trainer: Any, result: Any) -> None:
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()

    def complete(self, global_step: int) -> None:
        """Rank 0: the run is finished; the same command again trains nothing."""
        if self.record is not None:
            self.record.mark_complete(global_step)
