"""The ablation driver: teacher trajectories → SFT → GRPO per variant → evaluation of chosen steps → comparison.

Modules: ``settings`` (profiles, arguments, the resolved plan), ``status`` (completeness checks), ``stages`` (the
command lines), ``driver`` (running them, resuming, the summary).

    python run_ablation.py                                   # cpu-tiny: the embedded default, CPU, minutes
    python run_ablation.py --profile gpu-reference --dry_run # the reference run (7B policy, 72B user): print commands
    python run_ablation.py --profile gpu-reference           # run it (resumes where it stopped)

Every stage is one of the project's entry scripts (``collect_trajectories.py``, ``train_sft.py``, ``train_grpo.py``,
``evaluate.py``; the user-simulator server through ``scripts/serve_user_llm.py``) run as a subprocess with its output
in ``<output_dir>/logs/<stage>.log``. Before running a stage the driver decides from its outputs whether it is
complete, and skips it if so; so an interrupted or failed run is resumed by running the same command again (and the
scripts themselves resume inside a stage: collection attempts, trainer checkpoints, evaluation samples).

What "complete" means, per stage (``<hub>`` is ``<output_dir>/hub``):

- ``user_server``: the user-simulator endpoint answers ``/health`` (gpu-reference only);
- ``collect``: ``trajectories/collect_info.json`` records every (task, attempt) as finished, the dataset is saved
  (``trajectories/dataset/state.json``) and exported (``<hub>/datasets/trajectories/collect_info.json``);
- ``sft``: ``sft/`` holds config.json, weights and ``train_results.json`` (written after training) and
  ``<hub>/sft/refs.json`` names a revision (exported last);
- ``grpo:<variant>``: ``<hub>/grpo-<variant>/refs.json`` lists every requested step as an exported revision;
- ``eval:<variant>`` / ``eval:sft``: ``eval/<variant>/step-<N>/results.json`` (``eval/sft/results.json``) holds a
  valid sample (no user-simulator failure) for every task × sample index it was asked for;
- ``compare``: ``comparison/ablation.md`` and both plots exist, are newer than every results file they summarise
  and name every variant.

``--dry_run`` prints every stage's exact command (environment included) and whether it would run or be skipped.
Profiles (``--profile``) hold the defaults; every flag overrides its profile value, and ``--<stage>_args`` appends
flags to one stage's command (e.g. ``--grpo_args "--use_peft true --lora_r 64"``).
"""

from __future__ import annotations

from .driver import Outcome, main, run, run_stages, summary_table
from .settings import (
    ALL_VARIANTS,
    PROFILES,
    STAGE_KINDS,
    STATE_FILE,
    AblationArguments,
    ExperimentError,
    Profile,
    Settings,
    resolve,
)
from .stages import Stage, build_stages, format_command
from .status import (
    Status,
    collect_status,
    compare_status,
    endpoint_status,
    grpo_status,
    model_dir_status,
    results_status,
    sft_status,
)

__all__ = [
    "ALL_VARIANTS",
    "PROFILES",
    "STAGE_KINDS",
    "STATE_FILE",
    "AblationArguments",
    "ExperimentError",
    "Outcome",
    "Profile",
    "Settings",
    "Stage",
    "Status",
    "build_stages",
    "collect_status",
    "compare_status",
    "endpoint_status",
    "format_command",
    "grpo_status",
    "main",
    "model_dir_status",
    "resolve",
    "results_status",
    "run",
    "run_stages",
    "sft_status",
    "summary_table",
]
