"""The whole ablation in one command: trajectories → SFT → GRPO per variant → evaluation → comparison table + plots.

    python run_ablation.py                                      # the embedded default on CPU (minutes)
    python run_ablation.py --profile gpu-reference --dry_run    # print the reference run's exact commands
    python run_ablation.py --profile gpu-reference              # 2 x 80 GB GPUs; rerun the same command to resume

Each stage is skipped when its outputs are complete, so an interrupted run resumes where it stopped. See
tau2_rl/experiment/ for the stages and docs/reproducing.md for the reference hardware.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

from tau2_rl.experiment import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
