"""The stages of an ablation run: each an entry script's exact command line, with its completeness check."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from tau2_rl.run.torchrun import SHUTDOWN_TIMEOUT_ENV

from .settings import OFFLINE_ENV, Settings, split_csv
from .status import (
    Status,
    all_complete,
    collect_status,
    compare_status,
    endpoint_status,
    grpo_status,
    recipe_value,
    results_status,
    sft_status,
)

# ---------------------------------------------------------------------------------------------------------------------
# stages


@dataclass
class Stage:
    """One step of the pipeline: a command, where its log goes, and how to tell its outputs are complete."""

    name: str
    kind: str
    command: list[str]
    check: Callable[[], Status]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    deps: list[str] = field(default_factory=list)
    stop_grace_s: float = 30.0
    """How long a stopped stage may take to exit before it is killed (training stages: finish the step, save)."""


def format_command(command: Sequence[str], env: dict[str, str] | None = None) -> str:
    prefix = [f"{key}={shlex.quote(value)}" for key, value in (env or {}).items()]
    return " ".join([*prefix, shlex.join([str(c) for c in command])])


def _log_path(settings: Settings, name: str) -> Path:
    return settings.output_dir / "logs" / f"{name.replace(':', '-')}.log"


def _accelerate(settings: Settings, script: str) -> list[str]:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", settings.accelerate_config]
    if settings.train_gpus is not None:  # accelerate sets CUDA_VISIBLE_DEVICES from a config's gpu_ids otherwise
        launch += ["--gpu_ids", settings.train_gpus]
    return [*launch, *settings.accelerate_args, script]


def _user_flags(settings: Settings, prefix: str = "user") -> list[str]:
    if not settings.profile.llm_user:
        return []
    return [
        f"--{prefix}_base_url",
        str(settings.user_base_url),
        f"--{prefix}_model",
        str(settings.user_model),
    ]


def build_stages(settings: Settings) -> list[Stage]:
    """Every stage of the run in order (those of unselected kinds included; ``run`` filters by kind)."""
    out, hub, profile = settings.output_dir, settings.hub_dir, settings.profile
    python = sys.executable
    train_env = dict(OFFLINE_ENV)
    if settings.train_gpus is not None:
        train_env["CUDA_VISIBLE_DEVICES"] = settings.train_gpus
    # torchrun (multi-process launches) SIGKILLs its ranks this long after forwarding a stop signal (default 30 s,
    # less than one GRPO step of a 7B policy): the ranks need it to finish the step and save (run/stop.py).
    training_env = {**train_env, SHUTDOWN_TIMEOUT_ENV: str(settings.stop_grace_s)}
    stages: list[Stage] = []
    server_deps: list[str] = []

    if profile.llm_user and settings.user_model_path:
        port = urlparse(str(settings.user_base_url)).port or 8001
        command = [python, "-m", "scripts.serve_user_llm", "--model", settings.user_model_path, "--port", str(port)]
        if settings.user_gpus is not None:
            command += ["--gpu-ids", settings.user_gpus]
        command += [
            "--served-model-name",
            str(settings.user_model),
            *profile.user_server_flags,
            "--log-file",
            str(out / "logs" / "user-server-vllm.log"),
            "--detach",
            "--pid-file",
            str(out / "user-server.pid"),
            *settings.extra["user_server"],
        ]
        base_url = str(settings.user_base_url)
        stages.append(
            Stage("user_server", "user_server", command, lambda: endpoint_status(base_url),
                  _log_path(settings, "user_server"), dict(OFFLINE_ENV))
        )  # fmt: skip
        server_deps = ["user_server"]

    trajectories = out / "trajectories"
    collect_cmd = [python, "collect_trajectories.py"]
    if profile.collect_recipe:
        collect_cmd += ["--config", profile.collect_recipe]
    collect_cmd += [*profile.collect_flags]
    if profile.llm_user:
        collect_cmd += [*_user_flags(settings), *_user_flags(settings, "teacher")]
    collect_cmd += ["--output_dir", str(trajectories), "--hub_dir", str(hub), *settings.extra["collect"]]
    attempts = recipe_value(profile.collect_recipe, collect_cmd, "attempts", 1)
    tasks = recipe_value(profile.collect_recipe, collect_cmd, "tasks")
    collect_tasks = split_csv(str(tasks)) if tasks not in (None, "") else None  # None: the split's covered tasks
    stages.append(
        Stage("collect", "collect", collect_cmd,
              lambda: collect_status(trajectories, hub, int(attempts), collect_tasks),
              _log_path(settings, "collect"), dict(OFFLINE_ENV), list(server_deps))
    )  # fmt: skip

    sft_dir = out / "sft"
    sft_cmd = [*_accelerate(settings, "train_sft.py"), "--config", profile.sft_recipe]
    if settings.model_name_or_path:
        sft_cmd += ["--model_name_or_path", settings.model_name_or_path]
    sft_cmd += ["--dataset_path", str(trajectories), "--output_dir", str(sft_dir), "--run_name", "sft"]
    sft_cmd += ["--hub_dir", str(hub), *settings.extra["sft"]]
    stages.append(
        Stage("sft", "sft", sft_cmd, lambda: sft_status(sft_dir, hub, "sft"), _log_path(settings, "sft"),
              dict(training_env), ["collect"], stop_grace_s=settings.stop_grace_s)
    )  # fmt: skip

    for variant in settings.variants:
        run = f"grpo-{variant}"
        recipe = profile.grpo_recipe.format(variant=variant)
        command = [*_accelerate(settings, "train_grpo.py"), "--config", recipe, "--variant", variant]
        command += ["--model_name_or_path", str(sft_dir), *_user_flags(settings)]
        command += ["--output_dir", str(out / run), "--run_name", run, "--hub_dir", str(hub)]
        command += ["--max_steps", str(settings.max_steps), "--save_steps", str(settings.save_steps)]
        if variant in settings.prm_rules:
            command += ["--prm_rules", settings.prm_rules[variant]]
        command += settings.extra["grpo"]
        stages.append(
            Stage(f"grpo:{variant}", "grpo", command,
                  lambda run=run: grpo_status(hub, run, settings.steps), _log_path(settings, f"grpo:{variant}"),
                  dict(training_env), ["sft", *server_deps], stop_grace_s=settings.stop_grace_s)
        )  # fmt: skip

    eval_dir = out / "eval"
    eval_recipe = profile.eval_recipe
    eval_base = [python, "evaluate.py", "--config", eval_recipe, "--hub_dir", str(hub), "--output_dir", str(eval_dir)]
    eval_base += _user_flags(settings)
    eval_flags = [*eval_base, *settings.extra["eval"]]
    tasks_value = recipe_value(eval_recipe, eval_flags, "tasks")
    eval_tasks = split_csv(str(tasks_value)) if tasks_value not in (None, "") else None
    num_samples = int(recipe_value(eval_recipe, eval_flags, "num_samples", 4))
    results: list[Path] = []
    labels: list[str] = []
    if settings.eval_sft:
        path = eval_dir / "sft" / "results.json"
        command = [*eval_base, "--model", str(sft_dir), "--eval_name", "sft", *settings.extra["eval"]]
        stages.append(
            Stage("eval:sft", "eval", command, lambda path=path: results_status(path, eval_tasks, num_samples),
                  _log_path(settings, "eval:sft"), dict(train_env), ["sft", *server_deps])
        )  # fmt: skip
        results.append(path)
        labels.append("sft")
    for variant in settings.variants:
        paths = [eval_dir / variant / f"step-{step:06d}" / "results.json" for step in settings.steps]
        command = [*eval_base, "--model", f"grpo-{variant}", "--steps", ",".join(map(str, settings.steps))]
        command += ["--eval_name", variant, *settings.extra["eval"]]
        stages.append(
            Stage(f"eval:{variant}", "eval", command,
                  lambda paths=paths: all_complete([results_status(p, eval_tasks, num_samples) for p in paths]),
                  _log_path(settings, f"eval:{variant}"), dict(train_env), [f"grpo:{variant}", *server_deps])
        )  # fmt: skip
        results += paths
        labels.append(variant)

    comparison = out / "comparison"
    specs = [f"{label}={eval_dir / label}" for label in labels]
    baseline = "vanilla" if "vanilla" in settings.variants else settings.variants[0]
    command = [python, "evaluate.py", "--compare", *specs, "--output_dir", str(comparison), "--baseline", baseline]
    stages.append(
        Stage("compare", "compare", command, lambda: compare_status(comparison, results, labels),
              _log_path(settings, "compare"), dict(OFFLINE_ENV), [s.name for s in stages if s.kind == "eval"])
    )  # fmt: skip
    return stages
