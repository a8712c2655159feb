"""Compare mode: several results files (variants × checkpoint steps) → ablation table and two plots.

Inputs are results.json files or folders searched for them; ``label=path`` names a variant explicitly, otherwise an
entry is labelled by its config (``label``: the local-hub run name, the model folder name, ``oracle``, ``noop``).
Entries with the same label are one variant at several checkpoint steps.

Outputs in ``--output_dir``:
- ``ablation.md``: rows = metrics, columns = variants (each at its last step), then the noop floor (what refusing
  everything scores on the same tasks) and a last column with the change of every other variant relative to the
  baseline variant (``--baseline``; default ``vanilla`` when present, else the first variant); pass^k rows up to
  pass^4 (τ²-bench's; the whole curve is in each results.json); then a table of overall pass^1 per step and variant;
- ``ablation_bars.png``: grouped bars of overall pass^1, generalization pass^1, error rate and reasoning depth per
  variant (pass^1 panels with their 95% CIs and the noop floor);
- ``pass1_by_step.png``: overall pass^1 against checkpoint step, one line (and CI band) per variant; entries without
  a step (oracle, noop, a plain model folder) are horizontal reference lines.

Metrics are recomputed from each file's samples with ``tau2_rl.evaluation.metrics`` (one implementation).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .results import RESULTS_FILE, ResultsError, fmt, metrics_of, read_results

logger = logging.getLogger(__name__)

TABLE_FILE = "ablation.md"
BARS_FILE = "ablation_bars.png"
STEPS_FILE = "pass1_by_step.png"


class CompareError(ValueError):
    """Bad compare-mode input; the message names the file or label."""


@dataclass
class Entry:
    label: str
    step: int | None
    path: Path
    data: dict[str, Any]
    metrics: dict[str, Any]


def _find_files(target: Path) -> list[Path]:
    if target.is_dir():
        files = sorted(target.rglob(RESULTS_FILE))
        if not files:
            raise CompareError(f"--compare: folder {target} holds no {RESULTS_FILE}")
        return files
    if not target.exists():
        raise CompareError(f"--compare: {target} does not exist")
    return [target]


def load_entries(specs: Sequence[str]) -> list[Entry]:
    """One entry per results file named (directly, in a folder, or as label=path); duplicates are refused."""
    entries: list[Entry] = []
    for spec in specs:
        label, sep, raw = str(spec).partition("=")
        if not sep or Path(spec).exists():
            label, raw = "", str(spec)
        for path in _find_files(Path(raw)):
            try:
                data = read_results(path)
            except ResultsError as err:
                raise CompareError(f"--compare: {err}") from err
            config = data["config"]
            name = label or str(config.get("label") or config.get("model") or path.parent.name)
            entries.append(Entry(name, config.get("step"), path, data, metrics_of(data)))
    if not entries:
        raise CompareError("--compare needs at least one results file")
    seen: dict[tuple[str, int | None], Path] = {}
    for entry in entries:
        key = (entry.label, entry.step)
        if key in seen:
            raise CompareError(
                f"--compare: {seen[key]} and {entry.path} are both variant {entry.label!r} at step {entry.step}; "
                "rename one with label=path"
            )
        seen[key] = entry.path
    return entries


def _step_key(entry: Entry) -> int:
    return -1 if entry.step is None else int(entry.step)


def final_entries(entries: Sequence[Entry]) -> dict[str, Entry]:
    """Per variant (in order of appearance), its entry at the last checkpoint step."""
    result: dict[str, Entry] = {}
    for entry in entries:
        current = result.get(entry.label)
        if current is None or _step_key(entry) > _step_key(current):
            result[entry.label] = entry
    return result


def _pass1(metrics: dict[str, Any], key: str) -> float | None:
    return ((metrics.get("pass1") or {}).get(key) or {}).get("value")


ROWS: list[tuple[str, str, Any]] = [
    ("pass^1 overall", "pass1", "overall"),
    ("pass^1 covered_seen", "pass1", "covered_seen"),
    ("pass^1 uncovered_seen", "pass1", "uncovered_seen"),
    ("pass^1 unseen", "pass1", "unseen"),
    ("generalization pass^1 (uncovered_seen + unseen)", "pass1", "generalization"),
    ("pass^1 on tasks whose gold writes", "pass1", "write"),
    ("pass^1 on tasks that need no write", "pass1", "no_write"),
    ("error rate (episodes with ≥ 1 tool error)", "metric", "error_rate"),
    ("tool-call error rate", "metric", "tool_call_error_rate"),
    ("reasoning depth (p50 policy tokens / turn)", "metric", "reasoning_depth_p50"),
    ("turns per episode", "metric", "turns_per_episode"),
    ("truncation rate", "metric", "truncation_rate"),
    ("user-simulator failures", "metric", "user_errors"),
    ("PRM-Lite within-group AUC (process vs outcome, tasks with both)", "metric", "prm_within_group_auc"),
]


def _value(metrics: dict[str, Any], kind: str, key: Any) -> float | None:
    if kind == "pass1":
        return _pass1(metrics, key)
    if kind == "pass_k":
        return (metrics.get("pass_hat_k") or {}).get(str(key))
    return metrics.get(key)


def _cell(metrics: dict[str, Any], kind: str, key: Any) -> str:
    value = _value(metrics, kind, key)
    if kind == "pass1" and value is not None:
        entry = metrics["pass1"][key]
        if entry.get("ci_low") is not None:
            return f"{value:.3f} [{entry['ci_low']:.2f}, {entry['ci_high']:.2f}]"
    return fmt(value, 1 if key == "reasoning_depth_p50" else 3)


def _delta(value: float | None, base: float | None, key: Any = None) -> str:
    if value is None or base is None:
        return "—"
    digits = 1 if key == "reasoning_depth_p50" else 0 if key == "user_errors" else 3
    return f"{value - base:+.{digits}f}"


DEFAULT_BASELINE = "vanilla"
MAX_TABLE_K = 4  # pass^k rows up to τ²-bench's pass^4; the whole curve stays in each results.json (pass_hat_k)


def ablation_table(entries: Sequence[Entry], baseline: str | None = None) -> str:
    """The markdown ablation table (and the pass^1-by-step table when any entry has a step). ``baseline`` (None:
    ``vanilla`` when present, else the first variant) is what the change column is relative to; only a baseline
    that was asked for and is missing gets a note."""
    finals = final_entries(entries)
    labels = list(finals)
    wanted = baseline or DEFAULT_BASELINE
    base_label = wanted if wanted in finals else None
    if base_label is None:
        base_label = next((lab for lab, e in finals.items() if e.data["config"].get("variant") == wanted), None)
    note = ""
    if base_label is None:
        base_label = labels[0]
        if baseline is not None:
            note = f"Baseline {baseline!r} is not among the variants; changes are relative to {base_label!r}.\n\n"
    max_k = max(int(e.data["config"]["num_samples"]) for e in finals.values())
    rows = list(ROWS)
    rows[1:1] = [(f"pass^{k} overall", "pass_k", k) for k in range(2, min(max_k, MAX_TABLE_K) + 1)]
    floor_source = finals[base_label].metrics.get("refusal_floor") or {}
    # the change column is about policies: the scripted baselines (oracle, noop) only get their own column, unless
    # nothing else is there to compare (oracle against noop)
    rest = [lab for lab in labels if lab != base_label]
    others = [lab for lab in rest if finals[lab].data["config"].get("agent") in (None, "model")] or rest
    note += _task_set_note(finals)
    header = ["metric", *(_column_name(finals[lab]) for lab in labels), "noop floor", f"Δ vs {base_label}"]
    lines = [
        "# Ablation",
        "",
        note + "Cells: value [95% CI]. The noop floor is what refusing everything (no write, nothing said) scores on "
        "the same tasks: pass^1 on no-write tasks is only informative above it.",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
    ]
    rules = [str(finals[lab].data["config"].get("prm_rules") or "—") for lab in labels]
    if any(r != "—" for r in rules):  # the process reward's rule set each policy was trained with
        lines.append("| PRM rule set (training) | " + " | ".join(rules) + " | — | — |")
    for name, kind, key in rows:
        cells = [_cell(finals[lab].metrics, kind, key) for lab in labels]
        floor = fmt(floor_source.get(key)) if kind == "pass1" else "—"
        base_value = _value(finals[base_label].metrics, kind, key)
        deltas = [_delta(_value(finals[lab].metrics, kind, key), base_value, key) for lab in others]
        if len(others) == 1:
            delta = deltas[0]
        elif not others:
            delta = "—"
        else:
            delta = ", ".join(f"{lab} {d}" for lab, d in zip(others, deltas, strict=True)) or "—"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {floor} | {delta} |")
    lines += ["", "Files:", ""]
    lines += [f"- {_column_name(e)}: `{e.path}`" for e in finals.values()]
    shadowed = [e for e in entries if finals[e.label] is not e]
    if shadowed:
        lines += ["", "Earlier results of the same variants (in the by-step table and plot only):", ""]
        lines += [f"- {_column_name(e)}: `{e.path}`" for e in shadowed]
    stepped = sorted({e.step for e in entries if e.step is not None})
    if stepped:
        by_step = {(e.label, e.step): e for e in entries}
        lines += ["", "## pass^1 by checkpoint step", "", "| step | " + " | ".join(labels) + " |"]
        lines.append("|---:|" + "---:|" * len(labels))
        for step in stepped:
            cells = [fmt(_pass1(by_step[(lab, step)].metrics, "overall")) if (lab, step) in by_step else "—"
                     for lab in labels]  # fmt: skip
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def task_sets(finals: dict[str, Entry]) -> dict[str, tuple[str, ...]]:
    """The tasks each variant's final results file was evaluated on (``config.tasks``; all tasks when absent)."""
    return {lab: tuple(str(t) for t in (e.data["config"].get("tasks") or ["all"])) for lab, e in finals.items()}


def _task_set_note(finals: dict[str, Entry]) -> str:
    """A warning line when the variants were evaluated on different tasks: their values are then not comparable."""
    sets = task_sets(finals)
    if len(set(sets.values())) <= 1:
        return ""
    sizes = ", ".join(f"{lab}: {len(tasks) if tasks != ('all',) else 'all'} tasks" for lab, tasks in sets.items())
    message = (
        f"**Not comparable: the variants were evaluated on different tasks** ({sizes}); evaluate them with "
        "the same --tasks and --split to compare them."
    )
    logger.warning("%s", message.replace("**", ""))
    return message + "\n\n"


def _column_name(entry: Entry) -> str:
    return f"{entry.label} @ {entry.step}" if entry.step is not None else entry.label


# ---------------------------------------------------------------------------------------------------------------------
# plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


BAR_PANELS = [
    ("overall pass^1", "pass1", "overall"),
    ("generalization pass^1", "pass1", "generalization"),
    ("error rate\n(episodes with ≥ 1 tool error)", "metric", "error_rate"),
    ("reasoning depth\n(p50 policy tokens / turn)", "metric", "reasoning_depth_p50"),
]


def plot_bars(entries: Sequence[Entry], path: Path) -> Path:
    """Grouped bars: one panel per metric, one bar per variant (at its last step)."""
    plt = _pyplot()
    finals = final_entries(entries)
    labels = list(finals)
    colors = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, len(BAR_PANELS), figsize=(4.2 * len(BAR_PANELS), 4.6))
    for axis, (title, kind, key) in zip(axes, BAR_PANELS, strict=True):
        for index, label in enumerate(labels):
            metrics = finals[label].metrics
            value = _value(metrics, kind, key)
            color = colors[index % len(colors)]
            if value is None:
                axis.text(index, 0, "n/a", ha="center", va="bottom", fontsize=9, color="gray")
                continue
            error = None
            if kind == "pass1":
                entry = metrics["pass1"][key]
                if entry.get("ci_low") is not None:
                    error = [[value - entry["ci_low"]], [entry["ci_high"] - value]]
            axis.bar(index, value, color=color, yerr=error, capsize=4, label=label)
            top = value + (error[1][0] if error else 0.0)  # above the whisker, so the two never overlap
            text = f"{value:.0f}" if key == "reasoning_depth_p50" else f"{value:.2f}"
            axis.annotate(text, (index, top), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                          fontsize=8)  # fmt: skip
        if kind == "pass1":
            floor = (finals[labels[0]].metrics.get("refusal_floor") or {}).get(key)
            if floor is not None:
                axis.axhline(floor, color="black", linestyle="--", linewidth=1, label="noop floor")
            axis.set_ylim(0, 1.05)
        elif key == "error_rate":
            axis.set_ylim(0, 1.05)
        else:
            values = [v for v in (_value(finals[lab].metrics, kind, key) for lab in labels) if v is not None]
            axis.set_ylim(0, max(values, default=1.0) * 1.15 or 1.0)
        axis.set_title(title, fontsize=10)
        axis.set_xticks(range(len(labels)))
        axis.set_xticklabels(labels, rotation=30, ha="right", fontsize=9)
        axis.grid(axis="y", alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=min(len(names), 6), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_steps(entries: Sequence[Entry], path: Path) -> Path:
    """Overall pass^1 against checkpoint step, one line per variant; step-less entries as reference lines."""
    plt = _pyplot()
    colors = plt.get_cmap("tab10").colors
    fig, axis = plt.subplots(figsize=(7.5, 4.8))
    labels = list(final_entries(entries))
    for index, label in enumerate(labels):
        color = colors[index % len(colors)]
        points = sorted((e for e in entries if e.label == label and e.step is not None), key=lambda e: e.step)
        if points:
            steps = [e.step for e in points]
            values = [_pass1(e.metrics, "overall") for e in points]
            lows = [e.metrics["pass1"]["overall"].get("ci_low") for e in points]
            highs = [e.metrics["pass1"]["overall"].get("ci_high") for e in points]
            axis.plot(steps, values, marker="o", color=color, label=label)
            if all(v is not None for v in lows + highs):
                axis.fill_between(steps, lows, highs, color=color, alpha=0.15)
        else:
            value = _pass1(final_entries(entries)[label].metrics, "overall")
            if value is not None:
                axis.axhline(value, color=color, linestyle=":", linewidth=1.5, label=f"{label} (no step)")
    first = entries[0].metrics.get("refusal_floor") or {}
    if first.get("overall") is not None:
        axis.axhline(first["overall"], color="black", linestyle="--", linewidth=1, label="noop floor")
    stepped = sorted({int(e.step) for e in entries if e.step is not None})
    if stepped and len(stepped) <= 12:
        axis.set_xticks(stepped)
    if not stepped:
        axis.text(
            0.5, 0.5, "no checkpoint steps among the inputs", transform=axis.transAxes, ha="center", color="gray"
        )
    axis.set_xlabel("checkpoint step")
    axis.set_ylabel("overall pass^1")
    axis.set_ylim(0, 1.05)
    axis.set_title("pass^1 by checkpoint step")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=9, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_compare(specs: Sequence[str], output_dir: str | Path, baseline: str | None = None) -> dict[str, Path]:
    """Writes the ablation table and both plots; returns their paths."""
    entries = load_entries(specs)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / TABLE_FILE
    tmp = out / f".{TABLE_FILE}.tmp"
    tmp.write_text(ablation_table(entries, baseline), encoding="utf-8")
    tmp.replace(table)
    return {
        "table": table,
        "bars": plot_bars(entries, out / BARS_FILE),
        "steps": plot_steps(entries, out / STEPS_FILE),
    }
