"""The ablation driver: teacher trajectories → SFT → GRPO per variant → evaluation of chosen steps → comparison.

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

import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import yaml

ROOT = Path(__file__).resolve().parents[1]
ALL_VARIANTS = ("vanilla", "turn_discount", "prm_lite", "lata", "joint")
STAGE_KINDS = ("user_server", "collect", "sft", "grpo", "eval", "compare")
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
STATE_FILE = "ablation_state.json"
COMPARE_FILES = ("ablation.md", "ablation_bars.png", "pass1_by_step.png")


class ExperimentError(ValueError):
    """Bad driver arguments or a stage that cannot run; the message names the flag or the stage."""


# ---------------------------------------------------------------------------------------------------------------------
# profiles and arguments


@dataclass(frozen=True)
class Profile:
    """Defaults of one hardware setup; ``AblationArguments`` fields left unset take these values."""

    name: str
    description: str
    variants: tuple[str, ...]
    steps: tuple[int, ...]
    accelerate_config: str
    collect_recipe: str | None
    collect_flags: tuple[str, ...]
    sft_recipe: str
    grpo_recipe: str  # "{variant}" is replaced by the variant
    eval_recipe: str
    base_model: str | None = None  # None: the embedded tiny model (built by train_sft.py)
    llm_user: bool = False
    user_model_path: str | None = None
    user_base_url: str | None = None
    user_gpus: str | None = None
    train_gpus: str | None = None
    user_server_flags: tuple[str, ...] = ()


PROFILES: dict[str, Profile] = {
    "cpu-tiny": Profile(
        name="cpu-tiny",
        description="embedded default: tiny random Qwen2, scripted user, oracle teacher, CPU, a few steps",
        variants=("vanilla", "joint"),
        steps=(2, 4),
        accelerate_config="accelerate_configs/cpu.yaml",
        collect_recipe=None,
        collect_flags=tuple(
            "--teacher oracle --user_simulator scripted --split seed --tasks 0,3,11,14 --attempts 1 "
            "--progress false".split()
        ),
        sft_recipe="recipes/ablation/sft_cpu_tiny.yaml",
        grpo_recipe="recipes/ablation/grpo_cpu_tiny.yaml",
        eval_recipe="recipes/ablation/eval_cpu_tiny.yaml",
    ),
    "gpu-reference": Profile(
        name="gpu-reference",
        description="2 x 80 GB GPUs: Qwen2.5-7B-Instruct policy on GPU 0 (vLLM colocate), "
        "Qwen2.5-72B-Instruct-AWQ user simulator and teacher on GPU 1",
        variants=ALL_VARIANTS,
        steps=(200, 250, 300),
        accelerate_config="accelerate_configs/zero2_offload.yaml",  # fp32 master weights: airline_rl/precision.py
        collect_recipe="recipes/ablation/collect_gpu_reference.yaml",
        collect_flags=(),
        sft_recipe="recipes/sft/qwen2_5_7b.yaml",
        grpo_recipe="recipes/grpo/{variant}_2gpu.yaml",
        eval_recipe="recipes/ablation/eval_gpu_reference.yaml",
        base_model="/models/Qwen2.5-7B-Instruct",
        llm_user=True,
        user_model_path="/models/Qwen2.5-72B-Instruct-AWQ",
        user_base_url="http://127.0.0.1:8001/v1",
        user_gpus="1",
        train_gpus="0",
        # the teacher sends tool schemas: let vLLM parse Hermes <tool_call> blocks into structured tool calls
        user_server_flags=("--max-model-len", "32768", "--tool-call-parser", "hermes"),
    ),
}


@dataclass
class AblationArguments:
    """``run_ablation.py`` flags (a YAML file with the same keys can be passed with ``--config``)."""

    profile: Literal["cpu-tiny", "gpu-reference"] = field(
        default="cpu-tiny",
        metadata={"help": "Defaults for a hardware setup: 'cpu-tiny' (embedded tiny model, scripted user, CPU) or "
                  "'gpu-reference' (2 x 80 GB GPUs, 7B policy, 72B-AWQ user simulator and teacher)."},
    )  # fmt: skip
    output_dir: str | None = field(
        default=None, metadata={"help": "Everything goes here (default: outputs/ablation-<profile>)."}
    )
    variants: str | None = field(
        default=None,
        metadata={"help": f"Comma-separated GRPO variants among {', '.join(ALL_VARIANTS)} (default: the profile's; "
                  "'all' for every one)."},
    )  # fmt: skip
    steps: str | None = field(
        default=None,
        metadata={"help": "Comma-separated checkpoint steps to evaluate (default: the profile's, 200,250,300 on "
                  "gpu-reference); GRPO runs to the largest and saves every gcd of them."},
    )  # fmt: skip
    stages: str | None = field(
        default=None,
        metadata={"help": f"Comma-separated stage kinds to run among {', '.join(STAGE_KINDS)} (default: all)."},
    )
    dry_run: bool = field(default=False, metadata={"help": "Print every stage's command and status; run nothing."})
    keep_going: bool = field(
        default=False, metadata={"help": "After a failed stage, still run the stages that do not depend on it."}
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Base policy for SFT (local directory; default: the profile's, the embedded tiny model on "
                  "cpu-tiny)."},
    )  # fmt: skip
    user_base_url: str | None = field(
        default=None,
        metadata={"help": "LLM user simulator / teacher endpoint (gpu-reference: http://127.0.0.1:8001/v1)."},
    )
    user_model: str | None = field(
        default=None, metadata={"help": "Served model name (default: the name of --user_model_path's directory)."}
    )
    user_model_path: str | None = field(
        default=None,
        metadata={"help": "Model directory the driver serves on --user_gpus when --user_base_url is not up yet "
                  "('none': never start a server)."},
    )  # fmt: skip
    user_gpus: str | None = field(default=None, metadata={"help": "CUDA_VISIBLE_DEVICES of the user server."})
    user_server_args: str | None = field(
        default=None,
        metadata={"help": "Extra flags for scripts/serve_user_llm.py, e.g. '--tensor-parallel-size 4' with "
                  "--user_gpus 4,5,6,7."},
    )  # fmt: skip
    train_gpus: str | None = field(
        default=None, metadata={"help": "CUDA_VISIBLE_DEVICES of the SFT, GRPO and evaluation stages."}
    )
    accelerate_config: str | None = field(default=None, metadata={"help": "accelerate config of the training stages."})
    accelerate_args: str | None = field(
        default=None,
        metadata={"help": "Extra `accelerate launch` flags of the training stages, e.g. '--num_processes 1 "
                  "--offload_optimizer_device cpu' with --accelerate_config accelerate_configs/zero2.yaml."},
    )  # fmt: skip
    eval_sft: bool = field(default=True, metadata={"help": "Also evaluate the SFT model (a reference line)."})
    stop_user_server: bool = field(
        default=True, metadata={"help": "Stop the user server at the end if this run started it."}
    )
    collect_args: str | None = field(default=None, metadata={"help": "Extra flags for collect_trajectories.py."})
    sft_args: str | None = field(default=None, metadata={"help": "Extra flags for train_sft.py."})
    grpo_args: str | None = field(default=None, metadata={"help": "Extra flags for train_grpo.py (every variant)."})
    eval_args: str | None = field(default=None, metadata={"help": "Extra flags for evaluate.py (evaluations)."})


# ---------------------------------------------------------------------------------------------------------------------
# the resolved plan


@dataclass
class Settings:
    """``AblationArguments`` with every default filled in from the profile and checked."""

    profile: Profile
    output_dir: Path
    hub_dir: Path
    variants: list[str]
    steps: list[int]
    stages: list[str]
    model_name_or_path: str | None
    user_base_url: str | None
    user_model: str | None
    user_model_path: str | None
    user_gpus: str | None
    train_gpus: str | None
    accelerate_config: str
    eval_sft: bool
    extra: dict[str, list[str]]
    accelerate_args: list[str] = field(default_factory=list)

    @property
    def max_steps(self) -> int:
        return max(self.steps)

    @property
    def save_steps(self) -> int:
        return math.gcd(*self.steps)


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def resolve(args: AblationArguments) -> Settings:
    """Fills profile defaults in and validates; a bad value raises ``ExperimentError`` naming its flag."""
    if args.profile not in PROFILES:
        raise ExperimentError(f"--profile {args.profile!r} is unknown; profiles: {', '.join(PROFILES)}")
    profile = PROFILES[args.profile]
    variants = list(ALL_VARIANTS) if args.variants == "all" else _split(args.variants) or list(profile.variants)
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:
        raise ExperimentError(f"--variants: unknown variant(s) {unknown}; valid: {', '.join(ALL_VARIANTS)}")
    if len(set(variants)) != len(variants):
        raise ExperimentError(f"--variants lists a variant twice: {variants}")
    try:
        steps = [int(s) for s in _split(args.steps)] if args.steps else list(profile.steps)
    except ValueError:
        raise ExperimentError(f"--steps {args.steps!r} must be comma-separated positive integers") from None
    if not steps or any(s < 1 for s in steps):
        raise ExperimentError(f"--steps {args.steps!r} must be comma-separated positive integers")
    steps = sorted(set(steps))
    stages = _split(args.stages) or list(STAGE_KINDS)
    bad = [s for s in stages if s not in STAGE_KINDS]
    if bad:
        raise ExperimentError(f"--stages: unknown stage(s) {bad}; stages: {', '.join(STAGE_KINDS)}")
    output_dir = Path(args.output_dir or f"outputs/ablation-{profile.name}")
    if not output_dir.is_absolute() and Path.cwd().resolve() != ROOT:
        output_dir = Path.cwd() / output_dir  # stages run in the repository root
    user_model_path = args.user_model_path or profile.user_model_path
    if user_model_path == "none":
        user_model_path = None
    user_base_url = args.user_base_url or profile.user_base_url
    user_model = args.user_model or (Path(user_model_path).name if user_model_path else None)
    if profile.llm_user and not (user_base_url and user_model):
        raise ExperimentError(
            f"profile {profile.name} uses an LLM user simulator: pass --user_base_url and --user_model (or "
            "--user_model_path, whose directory name is the served model name)"
        )
    extra = {
        kind: shlex.split(value or "")
        for kind, value in (
            ("user_server", args.user_server_args),
            ("collect", args.collect_args),
            ("sft", args.sft_args),
            ("grpo", args.grpo_args),
            ("eval", args.eval_args),
        )
    }
    return Settings(
        profile=profile,
        output_dir=output_dir,
        hub_dir=output_dir / "hub",
        variants=variants,
        steps=steps,
        stages=stages,
        model_name_or_path=args.model_name_or_path or profile.base_model,
        user_base_url=user_base_url,
        user_model=user_model,
        user_model_path=user_model_path,
        user_gpus=args.user_gpus or profile.user_gpus,
        train_gpus=args.train_gpus or profile.train_gpus,
        accelerate_config=args.accelerate_config or profile.accelerate_config,
        eval_sft=args.eval_sft,
        extra=extra,
        accelerate_args=shlex.split(args.accelerate_args or ""),
    )


# ---------------------------------------------------------------------------------------------------------------------
# completeness of each stage's outputs


@dataclass
class Status:
    complete: bool
    reason: str

    def __bool__(self) -> bool:
        return self.complete


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def recipe_value(recipe: str | None, flags: Sequence[str], name: str, default: Any = None) -> Any:
    """What a script will see for ``name``: the last ``--name value`` in ``flags``, else the recipe's, else default."""
    value = default
    if recipe:
        data = yaml.safe_load((ROOT / recipe).read_text(encoding="utf-8")) if (ROOT / recipe).is_file() else None
        if isinstance(data, dict) and name in data:
            value = data[name]
    for index, flag in enumerate(flags):
        if flag in (f"--{name}", f"--{name.replace('_', '-')}") and index + 1 < len(flags):
            value = flags[index + 1]
        elif flag.startswith(f"--{name}="):
            value = flag.split("=", 1)[1]
    return value


def collect_status(
    output_dir: Path, hub_dir: Path, attempts: int | None = None, tasks: Sequence[str] | None = None
) -> Status:
    info = _read_json(output_dir / "collect_info.json")
    if not isinstance(info, dict):
        return Status(False, f"no {output_dir}/collect_info.json")
    if tasks is not None and sorted(map(str, info.get("tasks") or [])) != sorted(map(str, tasks)):
        return Status(False, f"collected tasks {info.get('tasks')}, asked {list(tasks)}")
    expected = len(info.get("tasks") or []) * int(info.get("attempts_per_task") or 0)
    if attempts is not None and int(info.get("attempts_per_task") or 0) != int(attempts):
        return Status(False, f"collected with {info.get('attempts_per_task')} attempts per task, {attempts} asked")
    if not expected or int(info.get("attempts_finished") or 0) < expected:
        return Status(False, f"{info.get('attempts_finished')} of {expected} attempts finished")
    if not (output_dir / "dataset" / "state.json").is_file():
        return Status(False, f"no saved dataset in {output_dir}/dataset")
    exported = _read_json(hub_dir / "datasets" / output_dir.name / "collect_info.json")
    if not isinstance(exported, dict) or exported.get("attempts_finished") != info.get("attempts_finished"):
        return Status(False, f"dataset not exported to {hub_dir}/datasets/{output_dir.name} yet")
    return Status(True, f"{info['attempts_finished']} attempts, {sum((info.get('counts') or {}).values())} episodes")


def model_dir_status(path: Path) -> Status:
    if not (path / "config.json").is_file():
        return Status(False, f"no {path}/config.json")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        return Status(False, f"no weights in {path}")
    return Status(True, str(path))


def sft_status(output_dir: Path, hub_dir: Path, run_name: str) -> Status:
    model = model_dir_status(output_dir)
    if not model:
        return model
    if not (output_dir / "train_results.json").is_file():
        return Status(False, f"no {output_dir}/train_results.json (training did not finish)")
    refs = _read_json(hub_dir / run_name / "refs.json")
    if not isinstance(refs, dict) or not refs.get("main"):
        return Status(False, f"not exported to {hub_dir}/{run_name} yet")
    return Status(True, f"model in {output_dir}, hub revision {refs['main']}")


def grpo_status(hub_dir: Path, run_name: str, steps: Sequence[int]) -> Status:
    run_dir = hub_dir / run_name
    refs = _read_json(run_dir / "refs.json")
    if not isinstance(refs, dict):
        return Status(False, f"no {run_dir}/refs.json")
    have = {
        int(step) for name, step in (refs.get("revisions") or {}).items() if (run_dir / name / "config.json").is_file()
    }
    missing = [s for s in steps if s not in have]
    if missing:
        return Status(False, f"steps {missing} not exported yet (have {sorted(have)})")
    return Status(True, f"steps {sorted(steps)} exported to {run_dir}")


def results_status(path: Path, tasks: Sequence[str] | None = None, num_samples: int | None = None) -> Status:
    """A results.json holds a valid sample for every (task, sample index) it was asked for (and that we ask for)."""
    data = _read_json(path)
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("config"), dict)
        or not isinstance(data.get("tasks"), dict)
    ):
        return Status(False, f"no results in {path}")
    config = data["config"]
    wanted_tasks = [str(t) for t in config.get("tasks") or []]
    n = int(config.get("num_samples") or 0)
    if tasks is not None and sorted(map(str, tasks)) != sorted(wanted_tasks):
        return Status(False, f"{path} covers other tasks than asked")
    if num_samples is not None and int(num_samples) != n:
        return Status(False, f"{path} has {n} samples per task, {num_samples} asked")
    if not wanted_tasks or n < 1:
        return Status(False, f"{path} names no task")
    missing = 0
    for task_id in wanted_tasks:
        samples = (data["tasks"].get(task_id) or {}).get("samples") or []
        done = {s.get("sample") for s in samples if not s.get("user_error")}
        missing += sum(1 for i in range(n) if i not in done)
    if missing:
        return Status(False, f"{missing} of {len(wanted_tasks) * n} samples missing in {path}")
    return Status(True, f"{len(wanted_tasks) * n} samples")


def _all(statuses: Sequence[Status]) -> Status:
    for status in statuses:
        if not status:
            return status
    reasons = [s.reason for s in statuses]
    if len(set(reasons)) == 1 and len(reasons) > 1:
        return Status(True, f"{len(reasons)} × {reasons[0]}")
    return Status(True, "; ".join(reasons))


def compare_status(output_dir: Path, results: Sequence[Path], labels: Sequence[str]) -> Status:
    files = [output_dir / name for name in COMPARE_FILES]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        return Status(False, f"missing {', '.join(missing)} in {output_dir}")
    oldest = min(f.stat().st_mtime for f in files)
    stale = [str(r) for r in results if r.is_file() and r.stat().st_mtime > oldest]
    if stale:
        return Status(False, f"older than {stale[0]}")
    table = files[0].read_text(encoding="utf-8")
    absent = [label for label in labels if label not in table]
    if absent:
        return Status(False, f"{files[0]} does not show {absent}")
    return Status(True, f"{', '.join(COMPARE_FILES)} in {output_dir}")


def _health_url(base_url: str) -> str:
    parsed = urlparse(base_url)
    return f"{parsed.scheme or 'http'}://{parsed.hostname or '127.0.0.1'}:{parsed.port or 80}/health"


def endpoint_status(base_url: str) -> Status:
    url = _health_url(base_url)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            if response.status == 200:
                return Status(True, f"{url} is healthy")
    except (urllib.error.URLError, OSError):
        pass
    return Status(False, f"{url} does not answer")


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
    collect_tasks = _split(str(tasks)) if tasks not in (None, "") else None  # None: the split's covered tasks
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
              dict(train_env), ["collect"])
    )  # fmt: skip

    for variant in settings.variants:
        run = f"grpo-{variant}"
        recipe = profile.grpo_recipe.format(variant=variant)
        command = [*_accelerate(settings, "train_grpo.py"), "--config", recipe, "--variant", variant]
        command += ["--model_name_or_path", str(sft_dir), *_user_flags(settings)]
        command += ["--output_dir", str(out / run), "--run_name", run, "--hub_dir", str(hub)]
        command += ["--max_steps", str(settings.max_steps), "--save_steps", str(settings.save_steps)]
        command += settings.extra["grpo"]
        stages.append(
            Stage(f"grpo:{variant}", "grpo", command,
                  lambda run=run: grpo_status(hub, run, settings.steps), _log_path(settings, f"grpo:{variant}"),
                  dict(train_env), ["sft", *server_deps])
        )  # fmt: skip

    eval_dir = out / "eval"
    eval_recipe = profile.eval_recipe
    eval_base = [python, "evaluate.py", "--config", eval_recipe, "--hub_dir", str(hub), "--output_dir", str(eval_dir)]
    eval_base += _user_flags(settings)
    eval_flags = [*eval_base, *settings.extra["eval"]]
    tasks_value = recipe_value(eval_recipe, eval_flags, "tasks")
    eval_tasks = _split(str(tasks_value)) if tasks_value not in (None, "") else None
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
                  lambda paths=paths: _all([results_status(p, eval_tasks, num_samples) for p in paths]),
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
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
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
    data = _read_json(trainer_state)
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
    (args,) = make_parser().parse_args_and_config(argv)
    try:
        return run(args)
    except ExperimentError as err:
        print(f"run_ablation.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("run_ablation.py: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
