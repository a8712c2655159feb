"""Runs the stages in order, skipping complete ones, and records the outcome; ``main`` is run_ablation.py's."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .settings import ROOT, STAGE_KINDS, STATE_FILE, AblationArguments, ExperimentError, Settings, resolve
from .stages import Stage, build_stages, format_command
from .status import read_json

# ---------------------------------------------------------------------------------------------------------------------
# running


@dataclass
class Outcome:
    name: str
    status: str  # "skipped", "done", "failed", "blocked", "would run", "would skip", "not selected"
    reason: str = ""
    seconds: float = 0.0
    log: str = ""
    command: str = ""


def log_tail(path: Path, lines: int = 20) -> str:
    if not path.is_file():
        return ""
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    return "\n".join("    " + line for line in text)


def _execute(stage: Stage, cwd: Path) -> int:
    stage.log.parent.mkdir(parents=True, exist_ok=True)
    with open(stage.log, "a", encoding="utf-8") as log:
        log.write(
            f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {stage.name}\n{format_command(stage.command, stage.env)}\n"
        )
        log.flush()
        process = subprocess.Popen(
            stage.command, cwd=cwd, env={**os.environ, **stage.env}, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            return process.wait()
        except BaseException:  # Ctrl-C / SIGTERM: stop the stage's whole process group, then re-raise
            print(f"[stop] {stage.name}: stopping it (up to {stage.stop_grace_s:g} s to exit)", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            # A training stage finishes its step and saves (run/stop.py); under torchrun the agent kills its
            # ranks after the same grace, so it gets a little longer to do that first.
            try:
                process.wait(timeout=stage.stop_grace_s + (30 if stage.stop_grace_s > 30 else 0))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            raise


def run_stages(
    stages: Sequence[Stage],
    *,
    selected: Sequence[str] = STAGE_KINDS,
    dry_run: bool = False,
    keep_going: bool = False,
    cwd: Path = ROOT,
    print_fn: Callable[[str], None] = print,
    execute: Callable[[Stage, Path], int] | None = None,
    outcomes: list[Outcome] | None = None,
) -> list[Outcome]:
    """Runs the stages in order, skipping complete ones; stops at the first failure unless ``keep_going``.

    ``outcomes`` (appended to as stages finish, so it is up to date even when an interrupt escapes) is returned.
    """
    outcomes = [] if outcomes is None else outcomes
    execute = execute or _execute
    refreshed: set[str] = set()  # stages that ran (or would run) in this invocation
    state: dict[str, str] = {}  # name → "ok" (complete now) or "bad" (failed / blocked / incomplete, not selected)
    for stage in stages:
        status = stage.check()
        command = format_command(stage.command, stage.env)
        if stage.kind not in selected:
            state[stage.name] = "ok" if status else "bad"
            outcomes.append(Outcome(stage.name, "not selected", status.reason, command=command))
            continue
        if status:
            state[stage.name] = "ok"
            rerun = [dep for dep in stage.deps if dep in refreshed]
            if rerun:
                print_fn(
                    f"{'# ' if dry_run else ''}[warn] {stage.name} is complete but {', '.join(rerun)} "
                    f"{'would run' if dry_run else 'ran'} before it: its outputs may be stale (a new --output_dir "
                    "redoes everything)"
                )
            outcomes.append(
                Outcome(stage.name, "would skip" if dry_run else "skipped", status.reason, command=command)
            )
            print_fn(f"# [{stage.name}] complete, skipped: {status.reason}" if dry_run else
                     f"[skip] {stage.name}: complete ({status.reason})")  # fmt: skip
            if dry_run:
                print_fn(command)
            continue
        refreshed.add(stage.name)
        if dry_run:
            state[stage.name] = "ok"  # later stages are shown as they would run after this one
            outcomes.append(Outcome(stage.name, "would run", status.reason, log=str(stage.log), command=command))
            print_fn(f"# [{stage.name}] would run ({status.reason}); log: {stage.log}")
            print_fn(command)
            continue
        blocked = [dep for dep in stage.deps if state.get(dep) != "ok"]
        if blocked:
            state[stage.name] = "bad"
            reason = f"needs {', '.join(blocked)}, which did not complete"
            outcomes.append(Outcome(stage.name, "blocked", reason, command=command))
            print_fn(f"[blocked] {stage.name}: {reason}")
            continue
        print_fn(f"[run] {stage.name} ({status.reason}); log: {stage.log}")
        start = time.monotonic()
        code = execute(stage, cwd)
        seconds = time.monotonic() - start
        after = stage.check()
        if code == 0 and after:
            state[stage.name] = "ok"
            outcomes.append(Outcome(stage.name, "done", after.reason, seconds, str(stage.log), command))
            print_fn(f"[done] {stage.name} in {seconds:.0f} s: {after.reason}")
            continue
        state[stage.name] = "bad"
        reason = f"exit code {code}" if code != 0 else f"exit code 0 but its outputs are incomplete: {after.reason}"
        outcomes.append(Outcome(stage.name, "failed", reason, seconds, str(stage.log), command))
        tail = log_tail(stage.log)
        print_fn(f"[failed] {stage.name} after {seconds:.0f} s ({reason}); last lines of {stage.log}:\n{tail}")
        if not keep_going:
            print_fn("stopping; rerun the same command to resume from this stage (completed stages are skipped)")
            break
    return outcomes


def step_times(trainer_state: Path) -> list[float]:
    """The per-step wall times the trainer logged (``step_time``) in a trainer_state.json."""
    data = read_json(trainer_state)
    if not isinstance(data, dict):
        return []
    return [
        float(e["step_time"]) for e in data.get("log_history") or [] if isinstance(e.get("step_time"), int | float)
    ]


def summary_table(settings: Settings, outcomes: Sequence[Outcome]) -> str:
    lines = ["| stage | status | seconds | note |", "|---|---|---:|---|"]
    for outcome in outcomes:
        note = outcome.reason
        if outcome.name.startswith("grpo:"):
            times = step_times(settings.output_dir / f"grpo-{outcome.name[5:]}" / "trainer_state.json")
            if times:
                note += f"; step time mean {sum(times) / len(times):.1f} s over {len(times)} steps"
        lines.append(f"| {outcome.name} | {outcome.status} | {outcome.seconds:.0f} | {note} |")
    return "\n".join(lines)


def _stop_started_server(settings: Settings, started: bool, print_fn: Callable[[str], None]) -> None:
    pid_file = settings.output_dir / "user-server.pid"
    if not started or not pid_file.is_file():
        return
    try:
        pid = int(pid_file.read_text().strip())
        os.killpg(pid, signal.SIGTERM)
        print_fn(f"[stop] user server (pid {pid})")
    except (ValueError, ProcessLookupError, PermissionError):
        pass
    pid_file.unlink(missing_ok=True)


def run(args: AblationArguments, print_fn: Callable[[str], None] = print) -> int:
    """The driver: resolve the settings, build the stages, run (or print) them; 0 when every selected stage is done."""
    settings = resolve(args)
    stages = build_stages(settings)
    header = (
        f"ablation ({settings.profile.name}: {settings.profile.description})\n"
        f"output: {settings.output_dir}; variants: {', '.join(settings.variants)}; evaluated steps: "
        f"{', '.join(map(str, settings.steps))} "
        f"(GRPO to step {settings.max_steps}, saving every {settings.save_steps})"
    )
    print_fn(("# " + header.replace("\n", "\n# ")) if args.dry_run else header)
    for stage in stages:
        missing = [arg for arg in stage.command if arg.endswith((".yaml", ".py")) and not (ROOT / arg).exists()]
        if missing and stage.kind in settings.stages:
            raise ExperimentError(f"stage {stage.name}: {', '.join(missing)} does not exist in {ROOT}")
    outcomes: list[Outcome] = []
    try:
        run_stages(
            stages,
            selected=settings.stages,
            dry_run=args.dry_run,
            keep_going=args.keep_going,
            print_fn=print_fn,
            outcomes=outcomes,
        )
    finally:
        started_server = any(o.name == "user_server" and o.status == "done" for o in outcomes)
        if not args.dry_run:
            settings.output_dir.mkdir(parents=True, exist_ok=True)
            state = {
                "profile": settings.profile.name,
                "variants": settings.variants,
                "steps": settings.steps,
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "stages": [asdict(o) for o in outcomes],
            }
            (settings.output_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
            if args.stop_user_server:
                _stop_started_server(settings, started_server, print_fn)
    if args.dry_run:
        return 0
    print_fn("\n" + summary_table(settings, outcomes))
    comparison = settings.output_dir / "comparison" / "ablation.md"
    failed = [o for o in outcomes if o.status in ("failed", "blocked")]
    if failed:
        print_fn(f"\n{len(failed)} stage(s) did not complete: {', '.join(o.name for o in failed)}")
        return 1
    if comparison.is_file() and "compare" in settings.stages:
        print_fn(f"\nablation table: {comparison}")
    return 0


def make_parser() -> Any:
    from trl import TrlParser

    return TrlParser((AblationArguments,))


def main(argv: list[str] | None = None) -> int:
    from tau2_rl.run.cli import parse_or_exit

    (args,) = parse_or_exit(make_parser(), argv, prog="run_ablation.py")
    try:
        return run(args)
    except ExperimentError as err:
        print(f"run_ablation.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("run_ablation.py: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
