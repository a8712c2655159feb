"""Profiles, driver arguments and the resolved plan of an ablation run."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tau2_rl.domains import DEFAULT_DOMAIN, DOMAINS
from tau2_rl.variants import VARIANTS

ROOT = Path(__file__).resolve().parents[2]
ALL_VARIANTS = tuple(VARIANTS)  # the variants' one table, in its order
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
        accelerate_config="accelerate_configs/zero2_offload.yaml",  # fp32 master weights: tau2_rl/run/precision.py
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

    domain: str = field(
        default=DEFAULT_DOMAIN,
        metadata={"help": f"τ² domain of every stage (their --domain): one of {', '.join(DOMAINS)}. A domain's tasks "
                  "for each profile's stages come from its folder (DomainSpec.profile_tasks); none there: the "
                  "recipes' own."},
    )  # fmt: skip
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
    stop_grace_s: int = field(
        default=900,
        metadata={"help": "Seconds a stopped (Ctrl-C / SIGTERM) training stage gets to finish its step and save a "
                  "checkpoint before it is killed; also torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT (default 30)."},
    )  # fmt: skip
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
    prm_rules: str | None = field(
        default=None,
        metadata={"help": "PRM-Lite rule set of the GRPO runs: one for every variant (e.g. 'reference'), or "
                  "comma-separated variant=rules pairs ('prm_lite=reference,joint=v2'; the others keep their "
                  "recipe's). Recorded in each model card, results file and the --compare table."},
    )  # fmt: skip
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
    prm_rules: dict[str, str] = field(default_factory=dict)  # variant -> --prm_rules of its GRPO run
    accelerate_args: list[str] = field(default_factory=list)
    stop_grace_s: int = 900

    @property
    def max_steps(self) -> int:
        return max(self.steps)

    @property
    def save_steps(self) -> int:
        return math.gcd(*self.steps)


def split_csv(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def resolve(args: AblationArguments) -> Settings:
    """Fills profile defaults in and validates; a bad value raises ``ExperimentError`` naming its flag."""
    if args.profile not in PROFILES:
        raise ExperimentError(f"--profile {args.profile!r} is unknown; profiles: {', '.join(PROFILES)}")
    profile = PROFILES[args.profile]
    variants = list(ALL_VARIANTS) if args.variants == "all" else split_csv(args.variants) or list(profile.variants)
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:
        raise ExperimentError(f"--variants: unknown variant(s) {unknown}; valid: {', '.join(ALL_VARIANTS)}")
    if len(set(variants)) != len(variants):
        raise ExperimentError(f"--variants lists a variant twice: {variants}")
    try:
        steps = [int(s) for s in split_csv(args.steps)] if args.steps else list(profile.steps)
    except ValueError:
        raise ExperimentError(f"--steps {args.steps!r} must be comma-separated positive integers") from None
    if not steps or any(s < 1 for s in steps):
        raise ExperimentError(f"--steps {args.steps!r} must be comma-separated positive integers")
    steps = sorted(set(steps))
    if args.stop_grace_s < 1:
        raise ExperimentError(f"--stop_grace_s {args.stop_grace_s} must be a positive number of seconds")
    stages = split_csv(args.stages) or list(STAGE_KINDS)
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
    domain = _domain_flags(args.domain, profile)
    extra = {
        kind: domain.get(kind, []) + shlex.split(value or "")  # the user's flags last: they win
        for kind, value in (
            ("user_server", args.user_server_args),
            ("collect", args.collect_args),
            ("sft", args.sft_args),
            ("grpo", args.grpo_args),
            ("eval", args.eval_args),
        )
    }
    prm_rules = _prm_rules(args.prm_rules, variants)
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
        accelerate_config=checked_accelerate_config(
            args.accelerate_config or profile.accelerate_config, launching=not args.dry_run
        ),
        eval_sft=args.eval_sft,
        extra=extra,
        prm_rules=prm_rules,
        accelerate_args=shlex.split(args.accelerate_args or ""),
        stop_grace_s=args.stop_grace_s,
    )


def _domain_flags(domain: str, profile: Profile) -> dict[str, list[str]]:
    """The flags each stage kind gets for ``--domain``: none for the domain the recipes were written for (its
    commands stay as they were), else ``--domain`` and the tasks its folder picks for the profile
    (``DomainSpec.profile_tasks``)."""
    from tau2_rl.domains import UnknownDomainError, get_domain

    try:
        spec = get_domain(domain)
    except UnknownDomainError as err:
        raise ExperimentError(str(err)) from None
    if spec.unnamed_before_domains:
        return {}
    tasks = spec.profile_tasks.get(profile.name)
    if tasks is None:
        raise ExperimentError(
            f"--domain {domain}: profile {profile.name} has no {domain} task lists (its recipes name another "
            "domain's tasks); pass another --profile, or give every stage its tasks with "
            "--collect_args/--grpo_args/--eval_args"
        )
    # the recipes name their own split: every stage gets the domain's
    flags = {kind: ["--domain", domain, "--split", spec.default_split] for kind in ("collect", "sft", "grpo", "eval")}
    for kind, task_ids in tasks.items():
        flags[kind] += ["--tasks", task_ids]
    return flags


def checked_accelerate_config(path: str, *, launching: bool = True) -> str:
    """``--accelerate_config``: a DeepSpeed config without DeepSpeed installed would end every training stage in
    accelerate's own 11-line ImportError (raised in the launcher, before any code of ours runs, and naming an
    unpinned ``pip3 install deepspeed``): refused here in one line naming the pin instead (a ``--dry_run``, which
    launches nothing, only prints the plan)."""
    import yaml

    from tau2_rl.run.dependencies import MissingDependencyError, require

    try:
        config = yaml.safe_load(Path(ROOT, path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ExperimentError(f"--accelerate_config {path}: cannot read it ({type(err).__name__})") from None
    if launching and isinstance(config, dict) and str(config.get("distributed_type", "")).upper() == "DEEPSPEED":
        try:
            require("deepspeed", f"--accelerate_config {path}")
        except MissingDependencyError as err:
            raise ExperimentError(str(err)) from None
    return path


def _prm_rules(value: str | None, variants: list[str]) -> dict[str, str]:
    """``--prm_rules``: one rule set for every variant, or variant=rules pairs -> {variant: rules}."""
    from tau2_rl.rewards.prm.engine import PRM_RULE_SETS

    if not value:
        return {}
    pairs = split_csv(value)
    if len(pairs) == 1 and "=" not in pairs[0]:
        pairs = [f"{variant}={pairs[0]}" for variant in variants]
    chosen: dict[str, str] = {}
    for pair in pairs:
        variant, sep, rules = (part.strip() for part in pair.partition("="))
        if not sep or variant not in variants or variant in chosen:
            raise ExperimentError(
                f"--prm_rules {value!r}: expected one rule set, or variant=rules pairs naming each of the run's "
                f"variants ({', '.join(variants)}) at most once"
            )
        if rules not in PRM_RULE_SETS:
            raise ExperimentError(f"--prm_rules: unknown rule set {rules!r}; valid: {', '.join(PRM_RULE_SETS)}")
        chosen[variant] = rules
    return chosen
