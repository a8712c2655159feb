"""Test helpers around τ²'s own harness (tau2_rl/evaluation/tau2_harness.py): evaluate.py's arguments for a served
agent, the request bodies both harnesses send, and ``compare_harnesses``, which runs both against the same endpoints
and asserts they agree (tests/test_served_agent.py, tests/test_vllm_served.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai_stub_server import PROBE_TEXT

from tau2_rl.configs import EvalArguments
from tau2_rl.domains import get_domain
from tau2_rl.evaluation.tau2_harness import TAU2_SEED, compare_results, run_tau2_harness


def request_key(body: dict[str, Any], *, sampling: bool = True) -> str:
    """A chat request as canonical JSON without tool-call ids (and τ²'s non-standard ``name`` beside
    ``function``), arguments parsed; ``sampling=False`` keeps only the messages and the tools offered."""
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
    kept.update({k: body[k] for k in ("tools", "tool_choice") if body.get(k)})  # a user who holds tools
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
    from tau2_rl.evaluation import run_evaluation

    def agent_bodies() -> list[str]:
        kept = [b for b in agent_stub.bodies if PROBE_TEXT not in json.dumps(b["messages"])]
        return sorted(request_key(b) for b in kept)

    domain = overrides.get("domain", "airline")
    spec = get_domain(domain)
    task_set = overrides.get("task_set")
    judge = (overrides["judge_base_url"], overrides["judge_model"]) if overrides.get("judge_base_url") else None
    tau2 = run_tau2_harness(
        agent_url, agent_model, user.base_url, user.model, task_ids, tmp_path / "tau2", concurrency=concurrency,
        spec=spec, data_dir=spec.task_set_dir(task_set) if task_set else None, judge=judge,
    )  # fmt: skip
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
    every = {str(i) for i in range(50)} if domain == "airline" else set(ours["tasks"])
    expected = set(task_ids) if task_ids else every
    assert {s.task_id for s in tau2.simulations} == set(ours["tasks"]) == expected
    comparison = compare_results(tmp_path / "tau2" / "tau2_harness.json", path.parent / "tau2_results.json")
    assert comparison.equal, comparison.report()
    rewards = {task_id: ours["tasks"][task_id]["samples"][0]["reward"]["reward"] for task_id in expected}
    assert rewards == {task: theirs for (task, _), (theirs, _) in comparison.rewards.items()}
    if agent_stub is not None:  # the same requests: messages, tools, tool_choice, temperature, seed
        assert agent_bodies() == theirs_agent
    assert ours_user == theirs_user
    return rewards
