"""Held-out pass^k inside GRPO training: the real score of the current policy at every evaluation step.

Training reward is not the benchmark score (a validation reward of 0.80 can sit next to a true pass^1 of 0.125), so
with ``eval_strategy: steps`` the trainer plays the split's test tasks (plus, with ``heldout_uncovered_tasks: M``, a
fixed sample of M uncovered train tasks, which makes the generalization metric defined) ``heldout_num_samples``
times each and scores them exactly as ``evaluate.py`` does:

1. the episodes go through ``run_episodes`` with the trainer's own ``TokenPolicyAgent`` over ``TrainerBackend`` (the
   same generation as the training rollouts: transformers or vLLM, colocate or server, with the trainer's sampling
   settings and token budgets), seeded per (task, sample) as in ``evaluate.py``;
2. each episode is stored with ``sample_entry`` in a ``results.json`` of the evaluator's format, one per eval step,
   ``<heldout_output_dir>/step-<N>/results.json`` (+ ``summary.md``): ``evaluate.py --compare <heldout_output_dir>``
   reads them as the variant ``<run_name>-heldout`` at each step;
3. the metrics are ``tau2_rl.evaluation.metrics.compute_metrics`` of that file, and are logged through the
   trainer's ``log`` with the ``eval_`` prefix, so TensorBoard shows ``eval/pass^1``, ``eval/pass^2``...,
   ``eval/pass^1/unseen``, ``eval/generalization``, ``eval/error_rate``, ``eval/reasoning_depth_p50``,
   ``eval/noop_floor`` next to ``train/reward``.

Several processes (accelerate): rank 0 opens (or resumes) the step's results file and broadcasts the missing
(task, sample) pairs; every rank plays its shard (pairs ``rank::world_size``) in chunks of
``per_device_eval_batch_size`` episodes, with ``TrainerBackend`` keeping the ranks' generation collectives in step
(an idle rank joins with dummy generations); after each chunk the sample records are gathered and rank 0 saves the
file. The metrics are computed on rank 0 and broadcast, so every rank returns the same numbers. An interrupted
evaluation resumes from the saved chunks; a complete file is never rewritten.

The evaluation leaves the training run as it found it: the Python, NumPy, torch and CUDA random states are saved
before it and restored after it (``keep_random_state``), so the same seeds give the same training numbers with
the evaluation on or off (its sampling draws from the training generators otherwise: an eval at step 1 moved step 2's
reward from 0.438 to 0.312).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import datasets

from tau2_rl.envs.multi import RunEnv
from tau2_rl.envs.prompt_style import style_name
from tau2_rl.envs.runner import RunTimings, run_episodes
from tau2_rl.envs.splits import Split
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.run.hub import revision_name
from tau2_rl.run.start import keep_random_state

from .metrics import GROUPS, STRATA, task_order
from .results import (
    FINGERPRINT_FIELDS,
    FORMAT_VERSION,
    RESULTS_FILE,
    ConfigMismatchError,
    ResultsFile,
    domain_group_sizes,
    domains_config,
    now,
    read_results,
    sample_entry,
    split_group_sizes,
    task_meta,
)

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from accelerate import Accelerator
    from transformers import PreTrainedModel, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

    from tau2_rl.configs import EnvArguments


class EvaluatingTrainer(Protocol):
    """What the held-out evaluation needs from the trainer that runs it (``MultiTurnGRPOTrainer``).

    A protocol rather than an import of the trainer class: the trainer imports this module to run it, so importing the
    trainer here would make the two modules import each other."""

    args: TrainingArguments
    model: PreTrainedModel
    use_vllm: bool
    accelerator: Accelerator
    state: TrainerState
    control: TrainerControl
    callback_handler: TrainerCallback

    def is_world_process_zero(self) -> bool: ...

    def policy_agent(self) -> tuple[Any, Any]: ...

    def _vllm_awake_for_rollout(self) -> AbstractContextManager[Any]: ...

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...


logger = logging.getLogger(__name__)

BOOTSTRAP_SAMPLES = 2000
CONFIDENCE = 0.95


def heldout_task_ids(split: Split, uncovered_tasks: int = 0, seed: int = 0) -> list[str]:
    """The split's test tasks, plus a fixed sample of ``uncovered_tasks`` uncovered train tasks (drawn with ``seed``,
    the same at every eval step and on resume), in canonical order."""
    uncovered = sorted(split.group("uncovered_seen"), key=task_order)
    if not 0 <= uncovered_tasks <= len(uncovered):
        raise ValueError(
            f"--heldout_uncovered_tasks must be in [0, {len(uncovered)}] (the uncovered train tasks of split "
            f"{split.name!r}), got {uncovered_tasks}"
        )
    sample = random.Random(f"heldout/{seed}").sample(uncovered, uncovered_tasks)
    return sorted([*split.test, *sample], key=task_order)


def user_config(env_args: EnvArguments) -> dict[str, Any]:
    """The user-simulator part of a results config (as ``evaluate.py`` writes it)."""
    user: dict[str, Any] = {"simulator": env_args.user_simulator}
    if env_args.user_simulator == "llm":
        user.update(
            base_url=env_args.user_base_url,
            model=env_args.user_model,
            temperature=env_args.user_temperature,
            seed=env_args.user_seed,
        )
    return user


def log_values(metrics: Mapping[str, Any], prefix: str = "eval") -> dict[str, float]:
    """The scalars logged at an eval step (``<prefix>_pass^1`` → TensorBoard tag ``<prefix>/pass^1``); missing
    values (a group with no task, pass^k beyond the smallest sample count) are left out, not logged as 0. A run over
    several domains adds each domain's (``<prefix>_<domain>/pass^1`` …)."""
    values = _log_values(metrics, prefix)
    for domain, domain_metrics in (metrics.get("domains") or {}).items():
        values.update(_log_values(domain_metrics, f"{prefix}_{domain}"))
    return values


def _log_values(metrics: Mapping[str, Any], prefix: str) -> dict[str, float]:
    pass1 = metrics.get("pass1") or {}
    floor = metrics.get("refusal_floor") or {}
    overall = pass1.get("overall") or {}
    values: dict[str, Any] = {
        "pass^1": overall.get("value"),
        "pass^1_ci_low": overall.get("ci_low"),
        "pass^1_ci_high": overall.get("ci_high"),
    }
    for k, value in (metrics.get("pass_hat_k") or {}).items():
        if k != "1":
            values[f"pass^{k}"] = value
    for name in (*GROUPS, *STRATA):
        values[f"pass^1/{name}"] = (pass1.get(name) or {}).get("value")
    general = pass1.get("generalization") or {}
    values.update(
        {
            "generalization": general.get("value"),
            "generalization_ci_low": general.get("ci_low"),
            "generalization_ci_high": general.get("ci_high"),
            "noop_floor": floor.get("overall"),
            "noop_floor/generalization": floor.get("generalization") if general.get("value") is not None else None,
            "error_rate": metrics.get("error_rate"),
            "tool_call_error_rate": metrics.get("tool_call_error_rate"),
            "reasoning_depth_p50": metrics.get("reasoning_depth_p50"),
            "turns_per_episode": metrics.get("turns_per_episode"),
            "truncation_rate": metrics.get("truncation_rate"),
            "episodes": metrics.get("episodes"),
            "user_errors": metrics.get("user_errors"),
        }
    )
    return {f"{prefix}_{key}": float(value) for key, value in values.items() if value is not None}


class HeldoutEvaluation:
    """What the trainer evaluates at each eval step and where the results go (built by ``build_heldout``)."""

    def __init__(
        self,
        env: RunEnv,
        user: Any,
        split: Split,
        task_ids: list[str],
        *,
        num_samples: int,
        output_dir: str | Path,
        label: str,
        env_args: EnvArguments,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"--heldout_num_samples must be >= 1, got {num_samples}")
        if not task_ids:
            raise ValueError(f"split {split.name!r} has no held-out task to evaluate")
        self.env = env
        self.user = user
        self.split = split
        self.task_ids = list(task_ids)
        self.num_samples = num_samples
        self.output_dir = Path(output_dir)
        self.label = label
        self.env_args = env_args
        several = len(env.members) > 1
        self.meta = {t: task_meta(env.task(t), split.group_of(t), env.base_of(t), several) for t in self.task_ids}
        self.domains = domains_config(env)

    def dataset(self) -> datasets.Dataset:
        """One row per held-out task: what TRL's Trainer needs as ``eval_dataset`` when ``eval_strategy`` is set."""
        return datasets.Dataset.from_list(
            [{"prompt": [{"role": "system", "content": self.env.env_of(t).system_prompt}], "task_id": t}
             for t in self.task_ids]
        )  # fmt: skip

    def results_path(self, step: int) -> Path:
        return self.output_dir / revision_name(step) / RESULTS_FILE

    def config(self, trainer: EvaluatingTrainer, step: int) -> dict[str, Any]:
        """The results file's config section; the fingerprint fields mean what they mean for ``evaluate.py``."""
        args = trainer.args
        dtype = str(getattr(trainer.model, "dtype", "")).replace("torch.", "") or None
        return {
            "format": FORMAT_VERSION,
            "agent": "model",
            "source": "training",  # played inside the training run, by the live weights at this step
            "model": f"{self.label}@{step}",
            "label": self.label,
            "variant": args.variant,
            "model_path": None,
            "model_digest": None,
            "step": step,
            "backend": "trainer-vllm" if trainer.use_vllm else "trainer-transformers",
            "dtype": dtype,
            **self.domains,
            "split": self.split.name,
            "split_file": self.env_args.split_file,
            "data_dir": self.env_args.data_dir,
            "task_set": self.env_args.task_set,
            "tasks": list(self.task_ids),
            "num_samples": self.num_samples,
            "seed": args.seed,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "max_new_tokens": args.max_completion_length,
            "max_turn_tokens": args.max_turn_tokens,
            "system_prompt": style_name(all(m.system_prompt == m.spec.compact_prompt for m in self.env.members)),
            "protocol": self.env.config.protocol,
            "max_turns": self.env.config.max_turns if self.env.config.protocol != "tau2" else None,
            "max_steps": self.env.config.max_steps if self.env.config.protocol == "tau2" else None,
            "max_tool_errors": self.env.config.max_tool_errors,
            "user": user_config(self.env_args),
            "bootstrap_samples": BOOTSTRAP_SAMPLES,
            "confidence": CONFIDENCE,
            "group_sizes": split_group_sizes(self.split),
            **({"domain_group_sizes": domain_group_sizes(self.env, self.split)} if len(self.env.members) > 1 else {}),
        }

    def check_existing(self, trainer: EvaluatingTrainer) -> None:
        """Refuses, before training starts, step files in ``output_dir`` written by another configuration (they
        would otherwise stop the run at its first eval step); ``ConfigMismatchError`` names the file and fields."""
        if not trainer.is_world_process_zero() or not self.output_dir.is_dir():
            return
        current = self.config(trainer, 0)
        for path in sorted(self.output_dir.glob(f"step-*/{RESULTS_FILE}")):
            stored = read_results(path)["config"]
            differences = [
                f"{key}: file has {stored.get(key)!r}, this run has {current.get(key)!r}"
                for key in FINGERPRINT_FIELDS
                if key not in ("model", "step") and stored.get(key) != current.get(key)
            ]
            if differences:
                raise ConfigMismatchError(
                    f"held-out results file {path} was written by another configuration and is kept as is. "
                    f"Differing fields: {'; '.join(differences)}. Pass another --heldout_output_dir or move it away."
                )

    # -- the evaluation ------------------------------------------------------------------------------------------

    def run(self, trainer: EvaluatingTrainer, prefix: str = "eval") -> dict[str, float]:
        """Plays the missing episodes of this step (sharded over ranks), saves the results file, logs the metrics;
        the training run's random states are the same afterwards (``keep_random_state``)."""
        with keep_random_state():
            return self._run(trainer, prefix)

    def _run(self, trainer: EvaluatingTrainer, prefix: str) -> dict[str, float]:
        from accelerate.utils import broadcast_object_list, gather_object

        from tau2_rl.evaluation.evaluator import episode_seed

        start = time.perf_counter()
        accelerator = trainer.accelerator
        world, rank = accelerator.num_processes, accelerator.process_index
        main = accelerator.is_main_process
        step = trainer.state.global_step
        path = self.results_path(step)
        results = None
        pending: list[tuple[str, int]] = []
        if main:
            results = ResultsFile.open(path, self.config(trainer, step), self.meta)
            pending = results.pending()
        if world > 1:
            pending = broadcast_object_list([pending])[0]
        shard = pending[rank::world]
        chunk = max(1, int(trainer.args.per_device_eval_batch_size))
        rounds = math.ceil(math.ceil(len(pending) / world) / chunk) if pending else 0  # the same on every rank

        timings, started, played = RunTimings(), now(), 0
        was_training = trainer.model.training
        trainer.model.eval()
        try:
            if rounds:
                backend, agent = trainer.policy_agent()
                seed = trainer.args.seed
                with trainer._vllm_awake_for_rollout():
                    for index in range(rounds):
                        part = shard[index * chunk : (index + 1) * chunk]
                        specs = [(task_id, episode_seed(seed, task_id, sample)) for task_id, sample in part]
                        records = run_episodes(
                            self.env,
                            agent,
                            self.user,
                            specs,
                            timings=timings,
                            score=getattr(trainer, "score", outcome_reward),
                            schedule=trainer.schedule,
                        )
                        backend.drain()
                        local = [
                            (t, sample_entry(r, s, self.env.task(t).spec))
                            for (t, s), r in zip(part, records, strict=True)
                        ]
                        entries = gather_object(local) if world > 1 else local
                        played += len(entries)
                        if results is not None:
                            for task_id, entry in entries:
                                results.add(task_id, entry)
                            results.save()
            metrics: dict[str, Any] | None = None
            if results is not None:
                if played:
                    results.add_run(
                        {
                            "started": started,
                            "seconds": round(time.perf_counter() - start, 3),
                            "episodes": played,
                            "waves": timings.waves,  # rank 0's
                            "timings": {k: round(getattr(timings, k), 3) for k in ("agent", "env", "user", "reward")},
                            "schedule": {"mode": trainer.schedule.mode, **timings.schedule_summary()},  # rank 0's
                            "user_simulator": {"name": self.user.name, **_stats(self.user)},
                        }
                    )
                    results.save()
                else:  # complete already (a resumed run): recomputed in memory, the file is left untouched
                    results.refresh()
                metrics = results.data["metrics"]
            if world > 1:
                metrics = broadcast_object_list([metrics])[0]
            assert metrics is not None
            logs = log_values(metrics, prefix)
            logs[f"{prefix}_runtime"] = round(time.perf_counter() - start, 3)
            trainer.log(dict(logs))  # in eval mode: GRPOTrainer.log prefixes its own eval metrics the same way
        finally:
            trainer.model.train(was_training)
        if main:
            value = logs.get(f"{prefix}_pass^1")
            logger.info(
                "held-out eval at step %d: pass^1 %s over %d tasks × %d samples (%.1f s) → %s",
                step,
                "n/a" if value is None else f"{value:.3f}",
                len(self.task_ids),
                self.num_samples,
                logs[f"{prefix}_runtime"],
                path,
            )
        trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, logs)
        return logs


def _stats(user: Any) -> dict[str, Any]:
    stats = getattr(user, "stats", None)
    return dict(stats()) if stats is not None else {}


def build_heldout(
    env_args: EnvArguments, training_args: Any, env: RunEnv, user: Any, split: Split, run_name: str
) -> HeldoutEvaluation | None:
    """The held-out evaluation of a training run, or None when ``eval_strategy`` is ``no``."""
    if str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) == "no":
        return None
    task_ids = heldout_task_ids(split, training_args.heldout_uncovered_tasks, training_args.seed)
    trained = {t.strip() for t in str(getattr(env_args, "tasks", None) or "").split(",") if t.strip()}
    if trained & set(split.test):
        logger.warning(
            "--tasks trains on test tasks of split %r (%s): their held-out scores are not held out",
            split.name,
            ", ".join(sorted(trained & set(split.test), key=task_order)),
        )
    output_dir = training_args.heldout_output_dir or str(Path(training_args.output_dir) / "heldout")
    return HeldoutEvaluation(
        env,
        user,
        split,
        task_ids,
        num_samples=training_args.heldout_num_samples,
        output_dir=output_dir,
        label=f"{run_name}-heldout",
        env_args=env_args,
    )
