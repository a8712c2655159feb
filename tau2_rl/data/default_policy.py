"""The embedded default *policy*: the tiny Qwen2 warmed up by the project's own SFT so that it speaks the protocol.

Why this exists: GRPO only learns from episodes whose reward varies inside a group. A random-weight tiny model
never closes a turn, never calls a tool and never earns a reward, so a CPU run from it trains on nothing. This module
builds, once, a policy that already plays real τ² airline episodes (user turns, tool calls, tool results) on a few
train tasks, imperfectly, in a way GRPO can fix within a few CPU minutes.

The warm-up teacher is of mixed quality, on purpose: for every warm-up task the oracle's dialogue once and the noop's
(an agent that declines the request: "I'm sorry, but I can't help with that request. Goodbye!") twice
(``WARMUP_TEACHERS``). Imitation reproduces the mix: sampled at temperature 1 the warmed policy declines about two
episodes in three and fails them, and when it takes the oracle's path it still garbles a tool call now and then
(measured on task 3, 128 episodes: 82 declines, 27 of the other 46 solved, 0.21 in all). Whether to help is one early
choice that every episode makes and the reward tells apart, so GRPO has a strong, consistent signal to learn from;
sharpening the oracle's path token by token is the slow part that follows. (A warm-up on the oracle alone leaves only
the slow part: the policy solves ~0.5 of its episodes by sampling luck, and 40 GRPO steps on CPU did not move that
measurably: 69/128 before, 65/128 after.)

The build goes through the project's real code paths, in a temporary directory:

1. ``build_tiny_model``: the tiny random-weight Qwen2 (hidden 128 = 4 heads of 32, 2 layers, vocab 4,096);
2. ``collect``: each teacher of ``WARMUP_TEACHERS`` against the scripted user on the chosen train tasks → an HF
   dataset each, concatenated (a teacher's rows repeated by its weight);
3. ``train_sft.main``: TRL's SFTTrainer on Render-Twice-Diff assistant masks, a fixed number of epochs, one
   optimiser step per epoch over all rows, fixed seed;

then the fine-tuned model is copied next to a ``build_info.json`` (written last) and renamed into place. A cached
build is reused only when its ``build_info.json`` names the same parameters and builder version and every file it
lists is there with its recorded size; anything else (missing, half-written, another version) is rebuilt. Concurrent
builders are serialised by a lock file, so no process ever loads a half-written directory. A stop (Ctrl-C,
SIGTERM) during the build discards it with its scratch directory, and says so: a rerun builds it from the start.

The compact prompt: on CPU the real system prompt (policy + 14 tool schemas, ~4.4k tokens) costs seconds per episode
in every forward and backward pass, which would leave a ten-minute run with a handful of steps. The default policy is
therefore trained and run with a one-line system prompt and no schemas in the prompt (``compact_env``); the tools,
their results, the user simulator and the reward are the real ones. A real run keeps the full prompt.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets

from tau2_rl.data.build_cache import cached_build
from tau2_rl.envs.episode import DomainEnv, EnvConfig
from tau2_rl.envs.prompt_style import PROMPT_STYLE_FILE, compact_env, write_prompt_style
from tau2_rl.envs.spec import DomainSpec, split_task_key
from tau2_rl.run.start import keep_log_levels, keep_random_state
from tau2_rl.run.stop import discarded_on_stop

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_POLICY_DIR_NAME",
    "DEFAULT_WARMUP_EPOCHS",
    "build_default_policy",
    "compact_env",
    "default_policy_dir",
]

# Bump when the build recipe changes in a way that should invalidate cached builds.
POLICY_BUILDER_VERSION = 3  # 2: mixed oracle + noop warm-up, one optimiser step per epoch; 3: tau2_rl_prompt.json
DEFAULT_POLICY_DIR_NAME = "default-policy"
DEFAULT_WARMUP_EPOCHS = 96


def warmup_teachers(specs: Sequence[DomainSpec]) -> dict[str, Any]:
    """Teacher → copies of its dialogues in the warm-up data (``DomainSpec.warmup_teachers``); with several domains,
    each domain's mix for its own tasks (domain → teacher → copies)."""
    if len(specs) == 1:
        return dict(specs[0].warmup_teachers)
    return {spec.name: dict(spec.warmup_teachers) for spec in specs}


def _mix(teachers: dict[str, Any]) -> str:
    """``oracle x1 + noop x2`` (several domains: ``airline: oracle x1 + noop x2; retail: …``)."""
    if all(isinstance(copies, int) for copies in teachers.values()):
        return " + ".join(f"{teacher} x{copies}" for teacher, copies in teachers.items())
    return "; ".join(f"{domain}: {_mix(mix)}" for domain, mix in teachers.items())


def domains_tag(specs: Sequence[DomainSpec]) -> str | None:
    """The ``--domain`` value a build, a run or a cache entry records; ``None`` for the one domain whose runs and
    caches predate domains (``DomainSpec.unnamed_before_domains``: their names and fingerprints stay valid)."""
    if len(specs) == 1 and specs[0].unnamed_before_domains:
        return None
    return ",".join(spec.name for spec in specs)


# The tiny model: head size 32 (hidden 128 / 4 heads) so that vLLM's CPU attention kernels also accept it.
MODEL_SIZE = {"hidden_size": 128, "num_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
SFT_LEARNING_RATE = 3e-3  # large and constant: the random tiny model must move within a few dozen epochs
REPO_ROOT = Path(__file__).resolve().parents[2]
# The files of the built policy (copied from the SFT output).
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")  # fmt: skip


def default_policy_dir(
    outputs_dir: str | os.PathLike[str], tasks: Sequence[str], epochs: int, specs: Sequence[DomainSpec]
) -> Path:
    """``<outputs_dir>/default-policy-<domains>-t<tasks>-e<epochs>`` (``default-policy-t…`` for the domain whose
    cache predates domains): one cache entry per warm-up setting."""
    tag = domains_tag(specs)
    name = DEFAULT_POLICY_DIR_NAME if tag is None else f"{DEFAULT_POLICY_DIR_NAME}-{tag.replace(',', '+')}"
    joined = "_".join(task.replace("/", ".") for task in tasks)
    if not re.fullmatch(r"[\w.+-]+", joined):  # ids no shell takes bare (telecom's "[service_issue]a|b[...]")
        joined = "h" + hashlib.sha256(",".join(tasks).encode()).hexdigest()[:12]
    return Path(outputs_dir) / f"{name}-t{joined}-e{epochs}"


def _params(
    tasks: Sequence[str], epochs: int, seed: int, max_turns: int, specs: Sequence[DomainSpec]
) -> dict[str, Any]:
    tag = domains_tag(specs)
    prompts = [spec.compact_prompt for spec in specs]
    return {
        "policy_builder_version": POLICY_BUILDER_VERSION,
        "tasks": list(tasks),
        "epochs": epochs,
        "seed": seed,
        "max_turns": max_turns,
        "learning_rate": SFT_LEARNING_RATE,
        "teachers": warmup_teachers(specs),
        "system_prompt": prompts[0] if len(prompts) == 1 else prompts,
        **MODEL_SIZE,
        **({"domain": tag} if tag is not None else {}),  # the older domain's cache entries stay valid
    }


def _load_train_sft() -> Any:
    """``train_sft.py`` (the entry script at the repository root) as a module, so its ``main`` does the SFT."""
    if "train_sft" in sys.modules:
        return sys.modules["train_sft"]
    path = REPO_ROOT / "train_sft.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the default policy is built with the repository's train_sft.py")
    spec = importlib.util.spec_from_file_location("train_sft", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def build_default_policy(
    output_dir: str | os.PathLike[str],
    tasks: Sequence[str],
    *,
    epochs: int = DEFAULT_WARMUP_EPOCHS,
    seed: int = 0,
    max_turns: int = 8,
    data_dir: str | None = None,
    force: bool = False,
    specs: Sequence[DomainSpec],
) -> Path:
    """Builds (or reuses) the warmed-up default policy of the domains ``specs`` in ``output_dir`` and returns its
    path (see module doc). ``tasks``: the warm-up tasks (``<domain>/<id>`` with several domains)."""
    output_dir = Path(output_dir)
    tasks = [str(t) for t in tasks]
    if not tasks:
        raise ValueError("the default policy needs at least one warm-up task (--warmup_tasks)")
    if len(specs) > 1:  # several domains: each warm-up task names its domain
        names = {spec.name for spec in specs}
        unnamed = [task for task in tasks if split_task_key(task)[0] not in names]
        if unnamed:
            raise ValueError(
                f"--warmup_tasks {','.join(unnamed)}: with several domains a warm-up task is <domain>/<task id>, the "
                f"domain one of {', '.join(sorted(names))}"
            )
    if epochs < 1:
        raise ValueError(f"--warmup_epochs must be >= 1, got {epochs}")
    params = _params(tasks, epochs, seed, max_turns, specs)

    def announce() -> None:
        logger.warning(
            "default policy: building %s once (tiny Qwen2 + SFT on %s dialogues of train tasks %s, %d epochs); "
            "about 20 s per warm-up task on 2 idle CPU cores (several times that where episodes run in τ²'s own "
            "environment), each phase said below; cached for later runs",
            output_dir,
            _mix(params["teachers"]),
            ",".join(tasks),
            epochs,
        )

    info = cached_build(
        output_dir,
        params,
        lambda work, tmp_dir: _build(work, tmp_dir, tasks, params, data_dir, specs),
        what="default-policy",
        force=force,
        replaceable=(*MODEL_FILES, PROMPT_STYLE_FILE),  # files copied in before the build was interrupted
        before_build=announce,
    )
    if info is None:
        logger.info("default policy: reusing the cached build in %s", output_dir)
    else:
        logger.warning(
            "default policy: built %s in %.0f s (SFT: %d epochs of one optimiser step each)",
            output_dir, info["build_seconds"], epochs,
        )  # fmt: skip
    return output_dir


def _build(
    work: Path,
    tmp_dir: Path,
    tasks: list[str],
    params: dict[str, Any],
    data_dir: str | None,
    specs: Sequence[DomainSpec],
) -> dict:
    """tiny model → the teachers' trajectories (one dataset) → train_sft; the model's files end up in ``tmp_dir``."""
    from tau2_rl.configs import CollectArguments
    from tau2_rl.data.collect import collect
    from tau2_rl.data.tiny_model import build_tiny_model
    from tau2_rl.envs.multi import run_env

    domain = ",".join(spec.name for spec in specs)
    env = run_env(specs, data_dir, EnvConfig(max_turns=params["max_turns"]))
    for member in env.members:
        compact_env(member)
    # The same tokenizer corpus as train_grpo.py's tiny model, plus each domain's compact prompt (a domain other than
    # the corpus's own: its policy and the schemas of its tools as its agent sees them).
    extra: list[str] = []
    for spec in specs:
        full = DomainEnv(spec, data_dir)
        extra += [full.system_prompt, spec.compact_prompt, *(str(schema) for schema in full.tools)]
    tiny = build_tiny_model(
        work / "tiny",
        hidden_size=MODEL_SIZE["hidden_size"],
        num_layers=MODEL_SIZE["num_layers"],
        num_attention_heads=MODEL_SIZE["num_attention_heads"],
        num_key_value_heads=MODEL_SIZE["num_key_value_heads"],
        intermediate_size=2 * MODEL_SIZE["hidden_size"],
        seed=params["seed"],
        extra_texts=extra,
    )
    # The warm-up data: every teacher of the domain's mix on each of its tasks, through collect (one HF dataset each),
    # its rows repeated as many times as the teacher's weight, in one dataset that train_sft reads.
    parts = []
    start = time.perf_counter()
    for spec in specs:
        mine = [task for task in tasks if env.task(task).domain == spec.name]
        teachers = params["teachers"] if len(specs) == 1 else params["teachers"][spec.name]
        for teacher, copies in teachers.items():
            logger.warning("default policy: playing the %s teacher on %s task(s) %s (%.0f s so far)", teacher,
                           spec.name, ",".join(mine), time.perf_counter() - start)  # fmt: skip
            collected = collect(
                CollectArguments(
                    domain=domain,
                    data_dir=data_dir,
                    teacher=teacher,
                    tasks=",".join(mine),
                    max_turns=params["max_turns"],
                    min_reward=0.0,  # the noop's failures are kept on purpose (the oracle's episodes all score 1)
                    output_dir=str(
                        work / f"trajectories-{teacher}"
                        if len(specs) == 1
                        else work / f"trajectories-{spec.name}-{teacher}"
                    ),
                    hub_dir=str(work / "hub"),
                    progress=False,
                ),
                env=env,
            )
            parts += [datasets.load_from_disk(collected.dataset_dir)] * copies
    warmup_data = datasets.concatenate_datasets(parts)
    warmup_data.save_to_disk(str(work / "warmup-data"))
    # the SFT is most of the build: its progress bar (steps = epochs) where someone watches a terminal
    watched = sys.stderr.isatty()
    logger.warning("default policy: SFT on %d rows, %d epochs%s (%.0f s so far)", len(warmup_data), params["epochs"],
                   ", progress below" if watched else "", time.perf_counter() - start)  # fmt: skip
    train_sft = _load_train_sft()
    argv = [
        "--dataset_path", str(work / "warmup-data"),
        "--model_name_or_path", str(tiny),
        "--output_dir", str(work / "sft"),
        "--run_name", "default-policy-sft",
        "--hub_dir", str(work / "hub"),
        "--domain", domain,
        "--max_turns", str(params["max_turns"]),
        "--min_reward", "0",  # train on the noop's dialogues too
        "--num_train_epochs", str(params["epochs"]),
        "--learning_rate", str(params["learning_rate"]),
        "--lr_scheduler_type", "constant",
        "--per_device_train_batch_size", "1",
        # One optimiser step per epoch over all rows: with a large constant lr, one row per step would leave the
        # oracle-or-decline choice wherever the last row of the last epoch pushed it, not at the data's mix.
        "--gradient_accumulation_steps", str(len(warmup_data)),
        "--max_length", "4096",
        "--bf16", "false",
        "--use_cpu", "true",
        "--gradient_checkpointing", "false",
        "--save_strategy", "no",
        "--report_to", "none",
        "--logging_steps", "1000000",
        "--disable_tqdm", "false" if watched else "true",
        "--log_level", "warning",
        "--seed", str(params["seed"]),
    ]  # fmt: skip
    script_args, training_args, model_args = train_sft.make_parser().parse_args_and_config(args=argv)
    # the caller's random state and log levels are its own (train_sft.main sets both)
    # a stop (Ctrl-C, SIGTERM) during this SFT says what happens: the scratch directory, checkpoint included, goes
    what = f"the default-policy build ({params['epochs']} SFT epochs)"
    # train_sft's own summary line is not printed: its paths are this scratch directory, gone a moment later (the
    # build logs its own line, "default policy: built ...")
    with keep_random_state(), keep_log_levels("__main__", "train_grpo"), discarded_on_stop(what):
        with contextlib.redirect_stdout(io.StringIO()):
            outcome = train_sft.main(script_args, training_args, model_args)
    tmp_dir.mkdir(parents=True)
    sft_dir = work / "sft"
    for name in MODEL_FILES:
        if (sft_dir / name).is_file():
            shutil.copy2(sft_dir / name, tmp_dir / name)
    write_prompt_style(tmp_dir, compact=True, specs=specs)  # evaluate.py and train_grpo.py prompt it so
    files = {p.name: p.stat().st_size for p in sorted(tmp_dir.iterdir()) if p.is_file()}
    metrics = outcome.get("metrics", {}) if isinstance(outcome, dict) else {}
    return {
        "params": params,
        "files": files,
        "sft_train_loss": metrics.get("train_loss"),
        "trajectories": len(warmup_data),
    }


# What a distributed launcher puts in a rank's environment: a build inside a rank would join (or wait for) the run's
# process group, and its SFT trainer would take up the launch's FSDP / DeepSpeed settings (issue 28: an FSDP launch
# hung here). The build is a one-process job, the same on every launch config.
_LAUNCH_ENV_PREFIXES = ("ACCELERATE_", "FSDP_", "TORCHELASTIC_", "PET_", "DEEPSPEED_", "DS_")
_LAUNCH_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                     "TORCH_NCCL_ASYNC_ERROR_HANDLING")  # fmt: skip


def single_process_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` without the distributed launcher's variables (see ``_LAUNCH_ENV_PREFIXES``)."""
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in environ.items() if k not in _LAUNCH_ENV_NAMES and not k.startswith(_LAUNCH_ENV_PREFIXES)}


def build_default_policy_isolated(
    output_dir: str | os.PathLike[str],
    tasks: Sequence[str],
    *,
    epochs: int,
    data_dir: str | None = None,
    specs: Sequence[DomainSpec],
) -> Path:
    """``build_default_policy`` in a child process with a one-process environment, for a rank of a multi-process
    launch: every rank calls it; the cache's lock lets one child build while the others wait, then reuse it."""
    import subprocess

    argv = [sys.executable, "-m", "tau2_rl.data.default_policy", "--output_dir", str(output_dir),
            "--tasks", ",".join(tasks), "--epochs", str(epochs)]  # fmt: skip
    if data_dir:
        argv += ["--data_dir", str(data_dir)]
    argv += ["--domain", ",".join(spec.name for spec in specs)]
    done = subprocess.run(argv, cwd=REPO_ROOT, env=single_process_env(), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the default-policy build for {output_dir} failed (exit {done.returncode}); see above")
    return Path(output_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tau2_rl.data.default_policy``: builds (or reuses) the default policy, one process."""
    import argparse

    from tau2_rl.domains import DEFAULT_DOMAIN, DOMAINS, parse_domains

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--tasks", required=True, help="comma-separated warm-up task ids")
    parser.add_argument("--epochs", type=int, default=DEFAULT_WARMUP_EPOCHS)
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--domain", default=DEFAULT_DOMAIN, help=f"τ² domain(s): {', '.join(DOMAINS)}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    specs = parse_domains(args.domain)
    build_default_policy(args.output_dir, tasks, epochs=args.epochs, data_dir=args.data_dir, specs=specs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
