"""Plot a training run's learning curve from its TensorBoard events.

    python plot_run.py outputs/grpo-cpu-smoke            # → outputs/grpo-cpu-smoke/learning_curve.png
    python plot_run.py outputs/grpo-cpu-smoke --output curve.png

Panels: outcome reward (with held-out pass^1 when the run logged ``eval/pass^1``), process reward, truncation rate,
group saturation, over training steps. Prints where the PNG went and the outcome-reward gain of the last quarter of
steps over the first.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tau2_rl.evaluation.learning_curve import (
    CURVE_FILE,
    PANELS,
    event_files,
    plot_learning_curve,
    quarter_gain,
    read_run_scalars,
)
from tau2_rl.run.cli import exit_with_error, one_line_argparse_errors


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    one_line_argparse_errors(parser, "plot_run.py")
    parser.add_argument("run_dir", help="a run's output_dir (its TensorBoard events are under <run_dir>/runs/)")
    parser.add_argument("--output", default=None, help=f"PNG path (default: <run_dir>/{CURVE_FILE})")
    args = parser.parse_args(argv)
    try:
        scalars = read_run_scalars(args.run_dir)
        output = plot_learning_curve(scalars, args.output or Path(args.run_dir) / CURVE_FILE, Path(args.run_dir).name)
    except (FileNotFoundError, ValueError) as err:
        exit_with_error(str(err), prog="plot_run.py")  # exit 2, as every other tool on bad input
    print(f"learning curve: {output}")
    files = event_files(args.run_dir)
    if len(files) > 1:  # a resumed (or stopped and rerun) run: one event file per start
        print(f"merged {len(files)} event files (one per start of the run; a step logged twice keeps the later value)")
    outcome = [v for _, v in scalars.get(PANELS[0][1], [])]
    if outcome:
        first, last, gain = quarter_gain(outcome)
        print(f"outcome reward: first quarter {first:.3f}, last quarter {last:.3f}, gain {gain:+.3f}")
    return output


if __name__ == "__main__":
    main()
