"""Evaluate a policy (or the oracle / noop baselines) on the τ² airline tasks, resumably.

Everything is played by ``tau2_rl.envs.runner.run_episodes``, the one episode loop the trainer uses, and a model
policy is the trainer's ``TokenPolicyAgent`` over a ``TransformersBackend`` or ``VLLMBackend``: all (task, sample)
episodes of a chunk (``--batch_size``) advance together, one batched generation per wave.

Order of work, so that bad input fails before anything runs and nothing finished is lost:
1. check the arguments, the split, the task ids, every model id / checkpoint step, and every existing results file
   against this configuration (a file from another configuration is refused, never overwritten);
2. build the user simulator and, for the LLM user, check that its endpoint answers;
3. per model (one per checkpoint step): load it, play the missing (task, sample) episodes chunk by chunk, and save
   results.json + summary.md atomically after every chunk.

Layout: ``<output_dir>/<name>/results.json`` where name is ``--eval_name`` or, by default, the local-hub run name, the
model folder's name, ``oracle`` or ``noop``; a local-hub revision adds ``step-<N>/`` (``<output_dir>/<run>/
step-000200/results.json``), so ``--steps 200,250,300`` writes three files side by side. With ``--protocol tau2``
(the default) or ``--tau2_results true``, ``tau2_results.json`` beside it holds the same episodes in τ²-bench's own
``Results`` format (``tau2_rl.evaluation.tau2_export``; ``tau2_results.incomplete.json`` until every episode is
in it).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import random
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tau2_rl.configs import EvalArguments
from tau2_rl.envs.agents import get_agent
from tau2_rl.envs.data import check_domain_files
from tau2_rl.envs.multi import RunEnv, run_env, run_split
from tau2_rl.envs.prompt_style import compact_env, read_prompt_domains, style_name, use_compact_prompt
from tau2_rl.envs.protocol import PROTOCOLS, TAU2, ProtocolUnavailableError, get_protocol, tau2_reference
from tau2_rl.envs.runner import Agent, RunTimings, run_episodes
from tau2_rl.envs.splits import Split
from tau2_rl.envs.users import check_user_endpoint, get_user_simulator
from tau2_rl.envs.users.base import UserSimulator
from tau2_rl.rewards.outcome import require_scorable, scorer
from tau2_rl.run.hub import HubError, read_refs, resolve_model, revision_name

from .results import (
    FORMAT_VERSION,
    RESULTS_FILE,
    ResultsFile,
    check_compatible,
    domain_group_sizes,
    domains_config,
    now,
    sample_entry,
    split_group_sizes,
    task_meta,
)
from .tau2_export import TAU2_INCOMPLETE_FILE, Tau2Results, tau2_info

logger = logging.getLogger(__name__)

SCRIPTED_AGENTS = ("oracle", "noop")
SERVED_PREFIX = "openai:"
"""``--model openai:<name>``: the chat model ``<name>`` behind ``--agent_base_url`` is the agent."""
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CARD_LINE = r"^- `{}`: (\S+)\s*$"  # a training field in a local-hub model card (tau2_rl.run.hub.model_card)


class EvaluationError(ValueError):
    """Bad evaluation input (model, steps, tasks, settings); the message names the flag or the thing."""


@dataclass
class EvalTarget:
    """One thing to evaluate: a scripted agent or one model revision, and where its results go."""

    kind: str  # "oracle", "noop", "model" (a local checkpoint) or "served" (--model openai:<name>)
    model: str  # the id as evaluated ("run@200" for a step of --steps)
    label: str
    step: int | None
    model_path: Path | None
    out_dir: Path
    variant: str | None = None
    prm_rules: str | None = None  # the process reward's rule set the model was trained with (its model card)
    trained_on: list[str] | None = None  # the domains the model was trained on, when its directory says

    @property
    def results_path(self) -> Path:
        return self.out_dir / RESULTS_FILE

    @property
    def description(self) -> str:
        return f"{self.label}@{self.step}" if self.step is not None else self.label


# ---------------------------------------------------------------------------------------------------------------------
# arguments


def parse_steps(steps: Any) -> list[int]:
    """'200,250,300' (or a YAML list) → [200, 250, 300]; anything else names --steps."""
    if steps is None or steps == "":
        return []
    items = steps if isinstance(steps, list | tuple) else str(steps).split(",")
    result = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        if text.startswith("step-"):
            text = text[len("step-") :]
        if not text.isdigit():
            raise EvaluationError(
                f"--steps must be comma-separated checkpoint steps such as 200,250,300; got {item!r}"
            )
        result.append(int(text))
    if len(set(result)) != len(result):
        raise EvaluationError(f"--steps lists a step twice: {steps}")
    return result


SPLIT_SIDES = ("train", "test")
"""``--tasks train`` / ``--tasks test``: the split's side instead of ids."""


def task_order(env: RunEnv, keys: Any) -> list[str]:
    """``keys`` domain by domain (the run's order), by id within a domain (shorter ids first: "2" before "10")."""
    rank = {member.spec.name: position for position, member in enumerate(env.members)}

    def order(key: str) -> tuple[int, int, str]:
        task = env.task(key)
        return (rank[task.domain], len(task.task_id), task.task_id)

    return sorted(keys, key=order)


def select_tasks(tasks: Any, env: RunEnv, split: Split | None = None) -> list[str]:
    """The task keys to evaluate: all of the domains' by default, else --tasks (each checked): keys, or ``train`` /
    ``test``, the ``--split``'s side (a domain's τ² split: its official train / test)."""
    if tasks is None or tasks == "":
        return task_order(env, env.task_keys)
    if isinstance(tasks, str) and tasks.strip() in SPLIT_SIDES:
        if split is None:
            raise EvaluationError(f"--tasks {tasks.strip()} needs a --split")
        side = split.train if tasks.strip() == "train" else split.test
        return task_order(env, side)
    items = tasks if isinstance(tasks, list | tuple) else str(tasks).split(",")
    selected = []
    for item in items:
        task_id = str(item).strip()
        if not task_id:
            continue
        try:
            env.task(task_id)
        except KeyError as err:
            raise EvaluationError(f"--tasks: {err.args[0]}") from err
        if task_id not in selected:
            selected.append(task_id)
    if not selected:
        raise EvaluationError(f"--tasks {tasks!r} names no task")
    return selected


def validate_arguments(args: EvalArguments) -> None:
    checks = [
        (bool(args.model and str(args.model).strip()), "--model is required: a model directory, a local-hub id "
         "'<run>[@<step>]', 'openai:<served name>', 'oracle' or 'noop'"),
        (args.num_samples >= 1, f"--num_samples must be >= 1, got {args.num_samples}"),
        (args.max_new_tokens >= 1, f"--max_new_tokens must be >= 1, got {args.max_new_tokens}"),
        (args.max_turn_tokens >= 1, f"--max_turn_tokens must be >= 1, got {args.max_turn_tokens}"),
        (args.max_turns >= 1, f"--max_turns must be >= 1, got {args.max_turns}"),
        (args.tau2_max_steps >= 1, f"--tau2_max_steps must be >= 1, got {args.tau2_max_steps}"),
        (args.max_tool_errors >= 1, f"--max_tool_errors must be >= 1, got {args.max_tool_errors}"),
        (args.protocol in PROTOCOLS, f"--protocol must be one of {', '.join(PROTOCOLS)}, got {args.protocol!r}"),
        (args.temperature is None or args.temperature >= 0, f"--temperature must be >= 0, got {args.temperature}"),
        (args.agent_timeout > 0, f"--agent_timeout must be > 0 seconds, got {args.agent_timeout}"),
        (args.agent_max_retries >= 0, f"--agent_max_retries must be >= 0, got {args.agent_max_retries}"),
        (args.agent_concurrency >= 1, f"--agent_concurrency must be >= 1, got {args.agent_concurrency}"),
        (0 < args.top_p <= 1, f"--top_p must be in (0, 1], got {args.top_p}"),
        (args.batch_size >= 0, f"--batch_size must be >= 0 (0: all episodes at once), got {args.batch_size}"),
        (args.generation_batch_size >= 1, f"--generation_batch_size must be >= 1, got {args.generation_batch_size}"),
        (0 < args.confidence < 1, f"--confidence must be in (0, 1), got {args.confidence}"),
        (args.bootstrap_samples >= 1, f"--bootstrap_samples must be >= 1, got {args.bootstrap_samples}"),
        (args.num_threads is None or args.num_threads >= 1, f"--num_threads must be >= 1, got {args.num_threads}"),
        (args.backend in ("transformers", "vllm"), f"--backend must be transformers or vllm, got {args.backend!r}"),
        (args.user_simulator in ("scripted", "llm"), f"--user_simulator must be scripted or llm, got "
         f"{args.user_simulator!r}"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise EvaluationError(message)
    try:
        args.episode_schedule()
    except ValueError as err:
        raise EvaluationError(str(err)) from None
    try:
        get_protocol(args.protocol)
        if args.tau2_results:
            tau2_reference()
    except ProtocolUnavailableError as err:
        flag = "--protocol tau2" if args.protocol == TAU2 else "--tau2_results"
        raise EvaluationError(str(err).replace("--protocol tau2", flag)) from None
    model = str(args.model).strip()
    if model.startswith(SERVED_PREFIX):
        if not model[len(SERVED_PREFIX) :].strip():
            raise EvaluationError(f"--model {model!r}: name the served model after 'openai:' (e.g. openai:Qwen2.5-7B)")
        if not (args.agent_base_url or "").strip():
            raise EvaluationError(
                f"--model {model} needs --agent_base_url, the endpoint serving it (e.g. http://localhost:8000/v1)"
            )
        if not (args.agent_api_key_env or "").strip() or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*",
                                                                            args.agent_api_key_env):  # fmt: skip
            raise EvaluationError(
                f"--agent_api_key_env names an environment variable holding the key (e.g. OPENAI_API_KEY), got "
                f"{args.agent_api_key_env!r}; the key itself never goes on the command line"
            )
    elif args.agent_base_url:
        raise EvaluationError(f"--agent_base_url is for --model openai:<name>, not --model {model!r}")
    if args.user_simulator == "llm":
        if not args.user_base_url:
            raise EvaluationError("--user_simulator llm needs --user_base_url (e.g. http://localhost:8000/v1)")
        if not args.user_model:
            raise EvaluationError(
                f"--user_simulator llm needs --user_model (the model served at {args.user_base_url})"
            )


def _safe_name(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("._")
    return cleaned or "model"


def _hub_revision(path: Path) -> tuple[str, int] | None:
    """(run name, step) when ``path`` is a revision folder of a local-hub run."""
    match = _STEP_DIR.match(path.name)
    if match and (path.parent / "refs.json").is_file():
        return path.parent.name, int(match.group(1))
    return None


def _card_field(path: Path, key: str) -> str | None:
    """A training field (``variant``, ``prm_rules``) named in a local-hub model card (README.md), if any."""
    try:
        match = re.search(_CARD_LINE.format(re.escape(key)), (path / "README.md").read_text(encoding="utf-8"), re.M)
    except OSError:
        return None
    return match.group(1) if match else None


def resolve_targets(args: EvalArguments) -> list[EvalTarget]:
    """What --model (and --steps) name, each resolved to a directory; a wrong id or missing step raises here."""
    model = str(args.model).strip()
    steps = parse_steps(args.steps)
    output_dir = Path(args.output_dir)
    if model in SCRIPTED_AGENTS:
        if steps:
            raise EvaluationError(f"--steps needs a local-hub run id as --model, not the scripted agent {model!r}")
        label = _safe_name(args.eval_name or model)
        return [EvalTarget(model, model, label, None, None, output_dir / label)]
    if model.startswith(SERVED_PREFIX):
        if steps:
            raise EvaluationError(f"--steps needs a local-hub run id as --model, not the served model {model!r}")
        name = model[len(SERVED_PREFIX) :].strip()
        label = _safe_name(args.eval_name or name)
        return [EvalTarget("served", name, label, None, None, output_dir / label)]
    if steps:
        run_dir = Path(args.hub_dir) / model
        if "@" in model:
            raise EvaluationError(f"--model {model!r} already names a revision; drop '@...' or drop --steps")
        if not run_dir.is_dir() or not (run_dir / "refs.json").is_file():
            raise EvaluationError(
                f"--steps needs --model to be a run of the local hub {args.hub_dir} (--hub_dir); {model!r} is not one "
                f"(runs there: {_hub_runs(args.hub_dir)})"
            )
        available = sorted(read_refs(run_dir).get("revisions", {}).values())
        missing = [s for s in steps if revision_name(s) not in read_refs(run_dir).get("revisions", {})]
        if missing:
            raise EvaluationError(
                f"run {model!r} in {args.hub_dir} has no checkpoint step {', '.join(map(str, missing))} "
                f"(--steps); available steps: {available}"
            )
        specs = [f"{model}@{s}" for s in steps]
    else:
        specs = [model]
    targets = []
    for spec in specs:
        try:
            path = resolve_model(spec, args.hub_dir)
        except HubError as err:
            raise EvaluationError(f"--model: {err}") from err
        except ValueError as err:  # a malformed revision
            raise EvaluationError(f"--model {spec!r}: {err}") from err
        revision = _hub_revision(path)
        if revision is not None:
            run, step = revision
            label = _safe_name(args.eval_name or run)
            out_dir = output_dir / label / revision_name(step)
            spec_id = f"{run}@{step}" if not Path(spec).is_dir() else spec
        else:
            step = None
            label = _safe_name(args.eval_name or path.resolve().name)
            out_dir = output_dir / label
            spec_id = spec
        card = {key: _card_field(path, key) for key in ("variant", "prm_rules")}
        trained_on = trained_domains(path)
        targets.append(EvalTarget("model", spec_id, label, step, path, out_dir, **card, trained_on=trained_on))
    return targets


def trained_domains(path: Path) -> list[str] | None:
    """The domains the model at ``path`` was trained on, as far as its directory says: its prompt record
    (``tau2_rl_prompt.json``: train_grpo.py, the default-policy build, hub revisions), else a local-hub card's
    ``domain`` line, else the training run's fingerprint (``run_config.json``; none recorded: the domain that predates
    domains); None when nothing says (a checkpoint from elsewhere)."""
    from tau2_rl.domains import legacy_domain
    from tau2_rl.run.guard import RunGuardError, read_run_config

    recorded = read_prompt_domains(path)
    if recorded is None and (card := _card_field(path, "domain")):
        recorded = card.split(",")
    if recorded is None:
        try:
            run = read_run_config(path)
        except RunGuardError:  # an unreadable record says nothing
            run = None
        if run and isinstance(run.get("fingerprint"), dict):
            recorded = str(run["fingerprint"].get("domain") or legacy_domain().name).split(",")
    return [name.strip() for name in recorded if name.strip()] if recorded else None


def _hub_runs(hub_dir: str) -> str:
    root = Path(hub_dir)
    runs = sorted(p.name for p in root.iterdir() if (p / "refs.json").is_file()) if root.is_dir() else []
    return ", ".join(runs) or "none"


def model_digest(path: Path) -> str:
    """A cheap identity of a model folder: sha256 of config.json plus the names and sizes of its weight files."""
    digest = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for weight in sorted(path.iterdir()):
        if weight.is_file() and weight.suffix in (".safetensors", ".bin", ".pt"):
            digest.update(f"{weight.name}:{weight.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def episode_seed(seed: int, task_id: str, sample: int) -> int:
    """The seed of episode (task, sample): stable across processes, runs and chunkings."""
    return zlib.crc32(f"{seed}/{task_id}/{sample}".encode()) & 0x7FFFFFFF


def prompt_style_of(args: EvalArguments, targets: list[EvalTarget]) -> bool:
    """Whether the policies get the compact prompt: ``--compact_prompt``, else what their directories record."""
    try:
        styles = {use_compact_prompt(args.compact_prompt, t.model_path) for t in targets if t.kind == "model"}
    except ValueError as err:
        raise EvaluationError(f"--model: {err}") from None
    if len(styles) > 1:
        raise EvaluationError(
            "--model/--steps: these revisions were trained with different system prompts (tau2_rl_prompt.json); "
            "evaluate them separately or pass --compact_prompt true/false"
        )
    return styles.pop() if styles else False


def build_config(
    args: EvalArguments,
    target: EvalTarget,
    task_ids: list[str],
    compact: bool = False,
    *,
    domains: dict[str, Any],
    split: Split,
) -> dict[str, Any]:
    """The results file's config section (FINGERPRINT_FIELDS decide whether a file may be resumed)."""
    policy = target.kind in ("model", "served")
    local = target.kind == "model"
    user: dict[str, Any] = {"simulator": args.user_simulator}
    if args.user_simulator == "llm":
        user.update(
            base_url=args.user_base_url, model=args.user_model, temperature=args.user_temperature, seed=args.user_seed
        )
    return {
        "format": FORMAT_VERSION,
        "agent": target.kind,
        "model": target.model,
        "label": target.label,
        "variant": target.variant or (target.kind if not policy else None),
        "prm_rules": target.prm_rules,  # what the training's process reward was (not a fingerprint field)
        "trained_on": target.trained_on,  # the model's training domains, where its directory says (not a fingerprint)
        "model_path": str(target.model_path.resolve()) if target.model_path else None,
        "model_digest": model_digest(target.model_path) if target.model_path else None,
        "step": target.step,
        "backend": args.backend if local else None,
        "dtype": args.dtype if local else None,
        "agent_endpoint": {"base_url": args.agent_base_url, "model": target.model} if not local and policy else None,
        **domains,
        "split": split.name,
        "split_file": args.split_file,
        "data_dir": args.data_dir,
        "task_set": args.task_set,
        "tasks": list(task_ids),
        "num_samples": args.num_samples,
        "seed": args.seed,
        "temperature": args.temperature if policy else None,
        "top_p": args.top_p if policy else None,
        "max_new_tokens": args.max_new_tokens if local else None,
        "max_turn_tokens": args.max_turn_tokens if local else None,
        "system_prompt": style_name(compact) if policy else None,
        "protocol": args.protocol,
        "max_turns": args.max_turns if args.protocol != TAU2 else None,
        "max_steps": args.tau2_max_steps if args.protocol == TAU2 else None,
        "max_tool_errors": args.max_tool_errors,
        "user": user,
        "bootstrap_samples": args.bootstrap_samples,
        "confidence": args.confidence,
    }


# ---------------------------------------------------------------------------------------------------------------------
# policies


def _eos_ids(tokenizer: Any, generation_config: Any) -> list[int]:
    ids: list[int] = []
    candidates = [tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)]
    for value in candidates:
        for token in value if isinstance(value, list | tuple) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    if not ids:
        raise EvaluationError("the model's tokenizer has no eos token: set eos_token to the end-of-turn token")
    return ids


def _require_vllm() -> None:
    from tau2_rl.backends import require_vllm

    try:
        require_vllm("--backend vllm")
    except ValueError as err:
        raise EvaluationError(str(err)) from err


def build_policy(args: EvalArguments, target: EvalTarget, env: RunEnv) -> tuple[Agent, Callable[[], None]]:
    """The agent for ``target`` and a function that frees it (the model's memory) when its evaluation is done."""
    if target.kind in SCRIPTED_AGENTS:
        return get_agent(target.kind), lambda: None
    if target.kind == "served":
        agent = served_agent(args, target, env)
        return agent, agent.close
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from tau2_rl.backends import TransformersBackend, VLLMBackend
    from tau2_rl.rollout import TokenPolicyAgent

    assert target.model_path is not None
    path = str(target.model_path)
    if args.backend == "vllm":
        _require_vllm()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if args.backend == "vllm":
        try:
            generation_config = GenerationConfig.from_pretrained(path)
        except OSError:
            generation_config = None
        backend: Any = VLLMBackend(
            path,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_len,
            tensor_parallel_size=args.vllm_tensor_parallel_size,
            max_num_batched_tokens=args.vllm_max_num_batched_tokens,
        )
        max_context = args.vllm_max_model_len or getattr(
            AutoConfig.from_pretrained(path), "max_position_embeddings", None
        )
        model = None
    else:
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype: Any = args.dtype if args.dtype in ("auto", None) else getattr(torch, args.dtype, None)
        if dtype is None:
            raise EvaluationError(f"--dtype {args.dtype!r} is not a torch dtype (auto, float32, bfloat16, float16)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        generation_config = model.generation_config
        backend_class: Any = TransformersBackend
        extra: dict[str, Any] = {}
        if args.shared_prefix_attention:
            from tau2_rl.backends.shared_prefix import SharedPrefixTransformersBackend

            backend_class = SharedPrefixTransformersBackend
            extra["turn_cache_tokens"] = args.turn_cache_tokens
        backend = backend_class(
            model,
            tokenizer,
            temperature=args.temperature,
            top_p=args.top_p,
            eos_token_ids=_eos_ids(tokenizer, generation_config),
            max_batch_size=args.generation_batch_size,
            seed=args.seed,
            prefix_cache=args.prefix_cache or args.shared_prefix_attention,
            **extra,
        )
        max_context = getattr(model.config, "max_position_embeddings", None)
    agent = TokenPolicyAgent(
        backend,
        tokenizer,
        _eos_ids(tokenizer, generation_config),
        max_completion_length=args.max_new_tokens,
        max_turn_tokens=args.max_turn_tokens,
        max_context=int(max_context or 10**9),
        per_episode_seeds=True,  # an episode's samples depend on (seed, task, sample) only: resumes equal runs
    )

    def release() -> None:
        nonlocal backend, model
        close = getattr(backend, "close", None)
        if close is not None:
            close()
        backend = model = None
        agent.backend = None  # type: ignore[assignment]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    return agent, release


def tau2_trial_seeds(seed: int, num_trials: int) -> list[int]:
    """The request seed of each trial as τ²'s ``run_tasks`` draws it: ``random.seed(seed)``, then one
    ``randint(0, 1_000_000)`` per trial, sent with every agent and user request of that trial."""
    rng = random.Random(seed)
    return [rng.randint(0, 1_000_000) for _ in range(num_trials)]


def served_agent(args: EvalArguments, target: EvalTarget, env: RunEnv) -> Any:
    """The ``OpenAITeacher`` that plays ``--model openai:<name>``: the protocol's tool schemas (τ²'s under
    ``tau2``), ``--temperature`` (0 by default) and τ²'s per-trial seed on every request."""
    from tau2_rl.data.teachers import OpenAITeacher, OpenAITeacherConfig

    assert args.agent_base_url is not None
    seeds = tau2_trial_seeds(args.seed, args.num_samples)
    samples = range(args.num_samples)
    trial_of = {episode_seed(args.seed, task_id, sample): sample for task_id in env.task_keys for sample in samples}
    config = OpenAITeacherConfig(
        base_url=args.agent_base_url,
        model=target.model,
        api_key=os.environ.get(args.agent_api_key_env) or "EMPTY",
        temperature=float(args.temperature or 0.0),
        top_p=args.top_p if args.top_p != 1.0 else None,  # τ²'s harness sends neither top_p nor max_tokens
        max_tokens=None,
        timeout=args.agent_timeout,
        max_retries=args.agent_max_retries,
        concurrency=args.agent_concurrency,
    )
    agent = OpenAITeacher(
        config,
        seed_of=lambda episode: seeds[trial_of.get(episode.seed, 0)],
        flags=("--agent_base_url", f"${args.agent_api_key_env} (--agent_api_key_env)", "--model openai:"),
    )
    agent.name = "agent"
    return agent


def check_served_agents(args: EvalArguments, plan_: Plan) -> None:
    """Before any episode: the served agent's endpoint answers, serves the model, and returns native tool calls.
    Each failure is one EvaluationError line."""
    for target in plan_.targets:
        if target.kind != "served":
            continue
        agent = served_agent(args, target, plan_.env)
        try:
            agent.check_endpoint(timeout=min(10.0, args.agent_timeout))
            if args.agent_tool_probe:
                agent.check_tool_calls(plan_.env.members[0].tools, timeout=args.agent_timeout)
        except (ValueError, ConnectionError) as err:
            raise EvaluationError(str(err)) from None
        finally:
            agent.close()


def build_user(args: EvalArguments) -> UserSimulator:
    """The user simulator; the LLM user's endpoint is checked before any episode runs."""
    user = get_user_simulator(args.user_simulator, **args.user_kwargs())
    try:
        check_user_endpoint(user, timeout=min(10.0, float(args.user_timeout)))
    except ValueError as err:  # the endpoint answers but does not serve the model
        raise EvaluationError(f"--user_model {args.user_model!r}: {err}") from err
    return user


# ---------------------------------------------------------------------------------------------------------------------
# the run


@dataclass
class Plan:
    """Everything checked before the first episode: environment, split, tasks, targets and their configs."""

    env: RunEnv
    split: Split
    task_ids: list[str]
    targets: list[EvalTarget]
    configs: list[dict[str, Any]]
    tau2_results: bool = False
    judge: Any = None
    """τ²'s NL-assertion judge (``--judge_*``), for tasks whose reward needs it."""


def writes_tau2_results(args: EvalArguments) -> bool:
    """--tau2_results, by default on exactly when the protocol is τ²'s."""
    return args.protocol == TAU2 if args.tau2_results is None else bool(args.tau2_results)


def plan(args: EvalArguments) -> Plan:
    specs = args.domain_specs()
    try:
        data_dirs = args.data_dirs()  # --data_dir, or each domain's --task_set
    except ValueError as err:
        raise EvaluationError(str(err)) from None
    for spec in specs:  # a missing file fails here, before anything heavy loads (τ²'s package, a model)
        check_domain_files(spec, data_dirs.get(spec.name) if isinstance(data_dirs, dict) else data_dirs)
    validate_arguments(args)
    env = run_env(specs, data_dirs, args.env_config())
    split = run_split(env, args.split, args.split_file)
    task_ids = select_tasks(args.tasks, env, split)
    try:  # every term of every task's reward can be computed, or the run stops here
        judge = args.judge()
        require_scorable({key: env.task(key) for key in task_ids}, judge is not None)
    except ValueError as err:
        raise EvaluationError(str(err)) from None
    targets = resolve_targets(args)
    if args.temperature is None:  # τ²'s harness samples a served agent greedily; a local policy samples on-policy
        args.temperature = 0.0 if any(t.kind == "served" for t in targets) else 1.0
    if args.backend == "vllm" and any(t.kind == "model" for t in targets):
        _require_vllm()
    compact = prompt_style_of(args, targets)
    if compact:
        for member in env.members:
            compact_env(member)
        if args.protocol == TAU2:
            logger.warning(
                "the policy gets the compact system prompt (tau2_rl_prompt.json or --compact_prompt), not τ²'s: "
                "the turn rules are τ²'s, the number is not a τ² number (docs/protocol.md)"
            )
    evaluated = [member.spec.name for member in env.members]
    for target in targets:  # a model evaluated off its training domains: said once, recorded in results.json
        if target.trained_on and not set(evaluated) <= set(target.trained_on):
            logger.warning("%s was trained on %s and is evaluated on %s (its scores are off its training domains)",
                           target.description, ",".join(target.trained_on), ",".join(evaluated))  # fmt: skip
    paths = [t.results_path for t in targets]
    if len(set(paths)) != len(paths):
        raise EvaluationError(f"two evaluations would write the same results file: {paths}")
    domains = domains_config(env)
    configs = [build_config(args, target, task_ids, compact, domains=domains, split=split) for target in targets]
    for config in configs:  # who judged NL_ASSERTION (a fingerprint field: another judge is another evaluation)
        config["judge"] = {"base_url": judge.config.base_url, "model": judge.config.model} if judge else None
    for config in configs:  # the generalization weights: the split's group sizes (not a fingerprint field)
        config["group_sizes"] = split_group_sizes(split)
        if len(env.members) > 1:  # each domain's own weights, for its figures apart
            config["domain_group_sizes"] = domain_group_sizes(env, split)
    for target, config in zip(targets, configs, strict=True):
        check_compatible(target.results_path, config)  # refuses a file from another configuration, before any work
    return Plan(env, split, task_ids, targets, configs, writes_tau2_results(args), judge)


def chunked(items: list[Any], size: int) -> list[list[Any]]:
    size = size or len(items) or 1
    return [items[i : i + size] for i in range(0, len(items), size)]


def tau2_writers(
    args: EvalArguments, plan_: Plan, target: EvalTarget, config: dict[str, Any]
) -> dict[str, Tau2Results]:
    """The τ² results file of each domain next to ``target``'s results.json (tau2_rl.evaluation.tau2_export): one
    domain's is ``tau2_results.json``; with several, ``tau2_results.<domain>.json`` each (τ²'s format holds one
    domain), its tasks under their plain τ² ids."""
    reference = tau2_reference()
    policy = target.kind == "model"
    served = target.kind == "served"
    user = config["user"]
    agent = {
        "implementation": "llm_agent" if served else f"tau2_rl.{target.kind}",
        "llm": target.model,
        "llm_args": {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "protocol": args.protocol,
            "system_prompt": config["system_prompt"],
        }
        if policy
        else {"api_base": args.agent_base_url, "temperature": args.temperature, "protocol": args.protocol}
        if served
        else {"protocol": args.protocol},
    }  # fmt: skip
    user_info = {
        "implementation": "user_simulator" if user["simulator"] == "llm" else "tau2_rl.scripted_user",
        "llm": user.get("model"),
        "llm_args": {"temperature": user["temperature"]} if "temperature" in user else None,
    }
    several = len(plan_.env.members) > 1
    writers = {}
    for member in plan_.env.members:
        name = member.spec.name
        info = tau2_info(domain=member.spec.name, policy=member.domain.policy, num_trials=args.num_samples,
                         max_steps=args.tau2_max_steps, max_errors=args.max_tool_errors, seed=args.seed, agent=agent,
                         user=user_info)  # fmt: skip
        tasks = [plan_.env.task(key) for key in plan_.task_ids if plan_.env.task(key).domain == name]
        about = {
            "protocol": args.protocol,
            "system_prompt": config["system_prompt"],
            "tasks_sha256": config["tasks_sha256"][name] if several else config["tasks_sha256"],
            "results_file": RESULTS_FILE,
        }
        writers[name] = Tau2Results(
            target.out_dir,
            info,
            [reference.Task.model_validate(task.raw).model_dump(mode="json") for task in tasks],
            [(task.task_id, sample) for task in tasks for sample in range(args.num_samples)],
            about,
            domain=name if several else None,
        )
    return writers


def evaluate_target(
    args: EvalArguments, plan_: Plan, target: EvalTarget, config: dict[str, Any], user: UserSimulator
) -> ResultsFile:
    """Plays the missing episodes of one target chunk by chunk, saving after each chunk (and the τ² file)."""
    env = plan_.env
    several = len(env.members) > 1
    meta = {
        key: task_meta(env.task(key), plan_.split.group_of(key), env.base_of(key), several) for key in plan_.task_ids
    }
    results = ResultsFile.open(target.results_path, config, meta)
    todo = results.pending()
    done = args.num_samples * len(plan_.task_ids) - len(todo)
    tau2 = tau2_writers(args, plan_, target, config) if plan_.tau2_results else {}
    missing = sum(len(writer.missing) for writer in tau2.values())
    if missing and not todo:
        logger.warning("%s: %d episodes of results.json are not in the τ² export (it was off when they ran); it is "
                       "written as %s", target.description, missing, TAU2_INCOMPLETE_FILE)  # fmt: skip
    for writer in tau2.values():
        writer.save()
    if not todo:  # a complete file is never rewritten; its metrics are recomputed in memory (as compare mode does)
        logger.info("%s: all %d episodes already in %s", target.description, done, target.results_path)
        stored = json.dumps(results.data.get("metrics"), sort_keys=True)
        results.refresh()
        if json.dumps(results.data["metrics"], sort_keys=True) != stored:
            logger.warning("%s: the stored metrics differ from those the current code computes from its samples; "
                           "the file is left as is (compare mode recomputes them)", target.results_path)  # fmt: skip
        return results
    if done:
        logger.info("%s: resuming %s (%d episodes done, %d to go)", target.description, target.results_path, done,
                    len(todo))  # fmt: skip
    agent: Any
    agent, release = build_policy(args, target, plan_.env)
    schedule = args.episode_schedule()
    user.stats()  # start a fresh accounting window for this target
    timings = RunTimings()
    started, start, played = now(), time.perf_counter(), 0
    bar = tqdm(total=len(todo), desc=f"eval {target.description}", unit="episode", disable=not args.progress)
    try:
        for chunk in chunked(todo, args.batch_size):
            specs = [(task_id, episode_seed(args.seed, task_id, sample)) for task_id, sample in chunk]
            # the bar moves as each episode finishes, not once per chunk of --batch_size episodes
            chunk_started, chunk_start = now(), time.perf_counter()
            records = run_episodes(
                plan_.env,
                agent,
                user,
                specs,
                timings=timings,
                on_finished=bar.update,
                score=scorer(plan_.judge),
                schedule=schedule,
            )
            duration = (time.perf_counter() - chunk_start) / max(1, len(chunk))
            for (task_id, sample), record in zip(chunk, records, strict=True):
                task = env.task(task_id)
                results.add(task_id, sample_entry(record, sample, task.spec, args.save_messages))
                if tau2:
                    tau2[task.domain].add(record, sample, task, chunk_started, duration)
            played += len(chunk)
            results.save()
            for writer in tau2.values():
                writer.save()
    finally:
        bar.close()
        turn_cache = getattr(getattr(agent, "backend", None), "turn_cache_stats", None) or {}  # die with it
        agent_stats = agent.stats() if target.kind == "served" else None  # requests, tokens, latency
        release()
        if played:
            results.add_run(
                {
                    "started": started,
                    "seconds": round(time.perf_counter() - start, 3),
                    "episodes": played,
                    "waves": timings.waves,
                    "timings": {k: round(getattr(timings, k), 3) for k in ("agent", "env", "user", "reward")},
                    "schedule": {
                        "mode": schedule.mode,
                        "min_ready": schedule.min_ready,
                        "batch_window": schedule.batch_window,
                        **timings.schedule_summary(),
                    },  # fmt: skip
                    "user_simulator": {"name": user.name, **user.stats()},
                    **({"agent_endpoint": agent_stats} if agent_stats else {}),
                    **({"turn_cache": turn_cache} if turn_cache else {}),
                }
            )
            results.save()
    return results


def run_evaluation(args: EvalArguments) -> list[Path]:
    """Evaluates every target of ``args``; returns the results files written."""
    plan_ = plan(args)
    check_served_agents(args, plan_)
    if plan_.judge is not None:
        try:
            plan_.judge.check_endpoint(timeout=min(10.0, args.judge_timeout))
        except ValueError as err:
            raise EvaluationError(str(err)) from None
    user = build_user(args)
    written = []
    try:
        for target, config in zip(plan_.targets, plan_.configs, strict=True):
            results = evaluate_target(args, plan_, target, config, user)
            metrics = results.data["metrics"]
            overall = metrics["pass1"]["overall"]
            logger.info(
                "%s: pass^1 %s (tasks %d, episodes %d) → %s",
                target.description,
                "n/a" if overall["value"] is None else f"{overall['value']:.3f}",
                metrics["tasks_evaluated"],
                metrics["episodes"],
                target.results_path,
            )
            written.append(target.results_path)
    finally:
        close = getattr(user, "close", None)
        if close is not None:
            close()
    return written


def describe_results(path: Path) -> str:
    """One line per results file for the console."""
    data = json.loads(path.read_text(encoding="utf-8"))
    metrics = data["metrics"]
    overall = metrics["pass1"]["overall"]["value"]
    return (
        f"{path}: pass^1 {'n/a' if overall is None else f'{overall:.3f}'} over {metrics['tasks_evaluated']} tasks, "
        f"{metrics['episodes']} episodes (complete: {metrics['complete']})"
    )
