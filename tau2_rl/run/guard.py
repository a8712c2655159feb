"""Resume only the same run: a small run-config fingerprint next to the checkpoints of ``output_dir``.

The HF Trainer convention is that a rerun into the same ``output_dir`` resumes its last checkpoint. That silently
resumed the *wrong* run when the directory held a checkpoint of another configuration (GRPO from an SFT model into
the quick start's ``output_dir`` restored the random model and threw the SFT weights away), and a rerun of a finished
run trained past ``max_steps`` and moved the hub's ``main``. So every training run writes ``run_config.json`` into
``output_dir``: the fields that make it *this* run (model, variant, tasks, data), the training length, and, once it
finished, ``completed``. A rerun then

- resumes the newest *whole* checkpoint when the fingerprint matches (the HF convention; ``run/checkpoints.py``
  skips, with one line each, those a crash left half-written or a disk left truncated),
- refuses with one line naming the differing fields when it does not (``--overwrite_output_dir true`` starts over,
  ``--resume_from_checkpoint <dir>`` resumes a whole checkpoint of any run, or pick another ``--output_dir``),
- is a no-op that says so when the same run already completed the same length (a larger ``--max_steps`` continues).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tau2_rl.run.checkpoints import checkpoint_problem, checkpoint_step, newest_complete_checkpoint
from tau2_rl.run.hub import write_json_atomic

logger = logging.getLogger(__name__)

RUN_CONFIG_FILE = "run_config.json"
FORMAT = 1


class RunGuardError(ValueError):
    """``output_dir`` holds a checkpoint of another run (the message is the one line a user sees)."""


@dataclass
class ResumeDecision:
    """What to do: resume ``checkpoint`` (None: start fresh), or nothing at all when the run is ``complete``."""

    checkpoint: str | None
    complete: bool = False
    message: str = ""
    sealed_from_step: int = 0  # checkpoints after this step are sealed (run/checkpoints.py); kept across reruns


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."


def differing_fields(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``field: stored → current`` for every field that differs (a field missing on one side counts)."""
    return [
        f"{key}: {_short(stored.get(key))} → {_short(current.get(key))}"
        for key in sorted(set(stored) | set(current))
        if stored.get(key) != current.get(key)
    ]


def read_run_config(output_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    path = Path(output_dir) / RUN_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise RunGuardError(f"{path} is unreadable ({err}); delete it or pass --overwrite_output_dir true") from None
    if not isinstance(stored, dict) or not isinstance(stored.get("fingerprint"), dict):
        raise RunGuardError(f"{path} is not a run configuration; delete it or pass --overwrite_output_dir true")
    return stored


def decide_resume(
    output_dir: str | os.PathLike[str],
    fingerprint: dict[str, Any],
    length: dict[str, Any],
    *,
    resume_from_checkpoint: str | None = None,
    overwrite_output_dir: bool = False,
    report: bool = True,
) -> ResumeDecision:
    """Whether this run resumes a checkpoint of ``output_dir``, starts fresh, or is already complete.

    ``fingerprint`` must match the stored one for a resume; ``length`` (``max_steps``, ``num_train_epochs``) may grow.
    An explicit ``resume_from_checkpoint`` is resumed whatever its run, as in the HF Trainer, but only when whole.
    """
    if resume_from_checkpoint:
        if not Path(resume_from_checkpoint).is_dir():
            raise RunGuardError(f"--resume_from_checkpoint {resume_from_checkpoint} is not a checkpoint directory")
        sealed_from = _sealed_from_step(_readable_run_config(Path(resume_from_checkpoint).parent))
        step = checkpoint_step(resume_from_checkpoint) or 0
        why = checkpoint_problem(resume_from_checkpoint, require_seal=sealed_from is not None and step > sealed_from)
        if why is not None:
            raise RunGuardError(f"--resume_from_checkpoint {resume_from_checkpoint} {why}: pass a whole checkpoint")
        own = _sealed_from_step(_readable_run_config(Path(output_dir)))  # this run's output_dir, if it has a record
        return ResumeDecision(
            checkpoint=resume_from_checkpoint, sealed_from_step=step if own is None else min(own, step)
        )
    if overwrite_output_dir or not Path(output_dir).is_dir():
        return ResumeDecision(checkpoint=None)
    stored = read_run_config(output_dir)
    sealed_from = _sealed_from_step(stored)
    # a half-written or damaged checkpoint is skipped, not deleted
    checkpoint = newest_complete_checkpoint(output_dir, sealed_from_step=sealed_from, report=report)
    if sealed_from is None:  # a run begun before seals existed: this run seals from the step it resumes
        sealed_from = (checkpoint_step(checkpoint) or 0) if checkpoint else 0
    if checkpoint is None and (stored is None or not stored.get("completed")):
        return ResumeDecision(checkpoint=None)  # nothing to resume: a fresh run (it rewrites the fingerprint)
    flags = "pass --overwrite_output_dir true to start over, or another --output_dir"
    if stored is None:
        raise RunGuardError(
            f"--output_dir {output_dir} holds {Path(checkpoint).name} of a run with no {RUN_CONFIG_FILE}, so it may "
            f"be another configuration; {flags} (--resume_from_checkpoint {checkpoint} resumes it anyway)"
        )
    differences = differing_fields(stored["fingerprint"], fingerprint)
    if differences:
        where = f" ({Path(checkpoint).name})" if checkpoint else ""
        resume = f" (--resume_from_checkpoint {checkpoint} resumes it anyway)" if checkpoint else ""
        raise RunGuardError(
            f"--output_dir {output_dir} holds another run{where}: {'; '.join(differences)}; {flags}{resume}"
        )
    if stored.get("completed") and not _longer(length, stored.get("length", {})):
        step = stored.get("global_step")
        return ResumeDecision(
            checkpoint=checkpoint,
            complete=True,
            message=f"{output_dir} is complete (step {step}, {_describe(stored.get('length', {}))}): nothing to do; "
            "pass --overwrite_output_dir true to train it again, or a larger --max_steps to continue",
            sealed_from_step=sealed_from,
        )
    return ResumeDecision(checkpoint=checkpoint, sealed_from_step=sealed_from)


def _sealed_from_step(stored: dict[str, Any] | None) -> int | None:
    value = (stored or {}).get("sealed_from_step")
    return value if isinstance(value, int) else None


def _readable_run_config(output_dir: Path) -> dict[str, Any] | None:
    try:
        return read_run_config(output_dir)
    except RunGuardError:
        return None


def _longer(current: dict[str, Any], stored: dict[str, Any]) -> bool:
    """Whether the requested training length goes past the completed one (``max_steps`` ≤ 0 means epochs)."""
    for key, value in current.items():
        before = stored.get(key)
        if isinstance(value, int | float) and isinstance(before, int | float) and value > before:
            if key == "max_steps" or current.get("max_steps", -1) <= 0:
                return True
    return False


def _describe(length: dict[str, Any]) -> str:
    if isinstance(length.get("max_steps"), int) and length["max_steps"] > 0:
        return f"max_steps {length['max_steps']}"
    return ", ".join(f"{k} {v}" for k, v in sorted(length.items())) or "its configured length"


def write_run_config(
    output_dir: str | os.PathLike[str],
    fingerprint: dict[str, Any],
    length: dict[str, Any],
    *,
    completed: bool = False,
    global_step: int | None = None,
    sealed_from_step: int = 0,
) -> Path:
    """Records the run's fingerprint (at the start) and, with ``completed``, that it finished (at the end)."""
    path = Path(output_dir) / RUN_CONFIG_FILE
    payload = {"format": FORMAT, "fingerprint": fingerprint, "length": length, "completed": completed,
               "sealed_from_step": sealed_from_step}  # fmt: skip
    if global_step is not None:
        payload["global_step"] = global_step
    write_json_atomic(path, payload)
    return path


@dataclass
class RunRecord:
    """A training run's claim on its ``output_dir``: the resume decision and what ``run_config.json`` records."""

    output_dir: str
    fingerprint: dict[str, Any]
    length: dict[str, Any]
    decision: ResumeDecision

    def mark_complete(self, global_step: int) -> None:
        """Records that the run finished (rank 0 only), so a rerun of the same length is a no-op."""
        write_run_config(self.output_dir, self.fingerprint, self.length, completed=True, global_step=global_step,
                         sealed_from_step=self.decision.sealed_from_step)  # fmt: skip


def claim_output_dir(args: Any, fingerprint: dict[str, Any], *, overwrite_output_dir: bool) -> RunRecord:
    """``decide_resume`` for a ``TrainingArguments``; unless the run is already complete, rank 0 records it.

    One call for both training scripts, so SFT and GRPO resume, refuse and finish by the same rule.
    """
    length = {"max_steps": args.max_steps, "num_train_epochs": args.num_train_epochs}
    decision = decide_resume(
        args.output_dir,
        fingerprint,
        length,
        resume_from_checkpoint=args.resume_from_checkpoint,
        overwrite_output_dir=overwrite_output_dir,
        report=args.process_index == 0,
    )
    if not decision.complete and args.process_index == 0:
        write_run_config(args.output_dir, fingerprint, length, sealed_from_step=decision.sealed_from_step)
    return RunRecord(str(args.output_dir), fingerprint, length, decision)


def model_identity(path: str) -> str:
    """A model path as the fingerprint stores it: absolute for a local directory, so ``./x`` and ``x`` match."""
    return str(Path(path).resolve()) if Path(path).exists() else path
