"""A training run's learning curve: TensorBoard scalars → one PNG, and the quarter-over-quarter reward gain.

Why: the per-step numbers of a short CPU run are noisy (16 episodes a step); a picture of outcome reward, process
reward, truncation and group saturation over steps shows at a glance whether the run learned, and the gain of the
last quarter of steps over the first is the one number ``benchmarks/cpu_learning.py`` and the README quote. When the
run also logged held-out evaluations (``eval/pass^1``, ``eval/pass^k``), pass^1 is drawn beside the training reward.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from tau2_rl.learning_gain import CURVE_FILE, quarter_gain

__all__ = ["CURVE_FILE", "PANELS", "heldout_tags", "plot_learning_curve", "quarter_gain", "read_run_scalars"]

# (title, TensorBoard tag) of the four panels; the trainer logs them under train/ (MultiTurnGRPOTrainer).
PANELS: tuple[tuple[str, str], ...] = (
    ("outcome reward (τ²)", "train/episode/outcome_reward"),
    ("process reward (PRM-Lite)", "train/episode/process_reward"),
    ("truncation rate", "train/episode/truncation_rate"),
    ("group saturation", "train/episode/group_saturation"),
)

Series = list[tuple[int, float]]


def event_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The TensorBoard event files under ``run_dir``, oldest first (a resumed run adds one per restart)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"{run_dir} does not exist (pass a run's output_dir, e.g. outputs/grpo-cpu-smoke)")
    files = sorted(run_dir.rglob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, str(p)))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event file under {run_dir} (was the run started with report_to "
                                "tensorboard?)")  # fmt: skip
    return files


def read_run_scalars(run_dir: str | os.PathLike[str]) -> dict[str, Series]:
    """Every scalar under ``run_dir`` (all event files below it, e.g. ``<output_dir>/runs/*``), sorted by step.

    A resumed run writes a second event file that repeats some steps: the later file's value wins.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[str, dict[int, float]] = {}
    for path in event_files(run_dir):
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags().get("scalars", []):
            series = merged.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                series[int(event.step)] = float(event.value)
    return {tag: sorted(values.items()) for tag, values in merged.items()}


def heldout_tags(scalars: dict[str, Series]) -> dict[str, str]:
    """{'pass^1': tag, 'pass^k': tag} for held-out evaluation tags (``eval/pass^1``, with or without a prefix)."""
    found = {}
    for tag in scalars:
        name = tag.removeprefix("train/")
        if name.startswith("eval/pass^"):
            found[name.removeprefix("eval/")] = tag
    return found


def plot_learning_curve(
    scalars: dict[str, Series], output: str | os.PathLike[str], title: str = "learning curve"
) -> Path:
    """Draws the four panels (plus held-out pass^1 beside the training reward) to ``output``, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    missing = [tag for _, tag in PANELS if tag not in scalars]
    if len(missing) == len(PANELS):
        raise ValueError(f"none of the curve's tags {[t for _, t in PANELS]} is in the events: not a GRPO run?")
    figure, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for axis, (label, tag) in zip(axes.flat, PANELS, strict=True):
        series = scalars.get(tag, [])
        if series:
            steps, values = zip(*series, strict=True)
            axis.plot(steps, values, marker="o", markersize=3, label="training episodes")
        axis.set_title(label)
        axis.grid(alpha=0.3)
    reward_axis = axes.flat[0]
    heldout = heldout_tags(scalars)
    for name in ("pass^1", "pass^k"):
        if name in heldout and scalars[heldout[name]]:
            steps, values = zip(*scalars[heldout[name]], strict=True)
            style = "s-" if name == "pass^1" else "^:"
            reward_axis.plot(steps, values, style, markersize=4, label=f"held-out {name}")
    outcome = [v for _, v in scalars.get(PANELS[0][1], [])]
    if outcome:
        first, last, gain = quarter_gain(outcome)
        reward_axis.set_title(f"{PANELS[0][0]}: first quarter {first:.2f} → last {last:.2f} ({gain:+.2f})")
    reward_axis.legend(loc="best", fontsize=8)
    for axis in axes[1]:
        axis.set_xlabel("step")
    figure.suptitle(title)
    figure.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{uuid.uuid4().hex[:8]}.png")
    try:
        figure.savefig(tmp, dpi=110)
        os.replace(tmp, output)
    finally:
        plt.close(figure)
        tmp.unlink(missing_ok=True)
    return output
