"""Loading the airline domain: the real package data, and clear errors for malformed or missing files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.models import DB_TABLES
from tau2_rl.envs.data import DomainDataError, GoldAction, Task, load_domain

AIRLINE = get_domain("airline")


def test_load_real_domain() -> None:
    domain = load_domain(AIRLINE)
    assert len(domain.tasks) == 50
    assert sorted(domain.tasks, key=int) == [str(i) for i in range(50)]
    assert set(domain.db) == set(DB_TABLES) == {"flights", "reservations", "users"}
    assert (len(domain.db["flights"]), len(domain.db["users"]), len(domain.db["reservations"])) == (300, 500, 2000)
    assert "airline" in domain.policy.lower() and len(domain.policy) > 1000
    assert set(domain.official_split) >= {"train", "test"}
    assert set(domain.official_split["train"]) | set(domain.official_split["test"]) <= set(domain.tasks)
    assert load_domain(AIRLINE) is load_domain(AIRLINE, None)  # parsed once per process, whatever the spelling


def test_real_tasks_are_typed() -> None:
    domain = load_domain(AIRLINE)
    task = domain.get_task(0)
    assert isinstance(task, Task) and task is domain.get_task("0")
    assert task.instructions.reason_for_call
    assert all(isinstance(a, GoldAction) and isinstance(a.arguments, dict) for t in domain.tasks.values()
               for a in t.actions)  # fmt: skip
    assert sum(t.writes for t in domain.tasks.values()) > 10
    assert all(set(t.reward_basis) <= {"DB", "COMMUNICATE", "NL_ASSERTION", "ACTION"} for t in domain.tasks.values())


def test_the_task_file_hash_quoted_in_the_docs_is_the_real_one() -> None:
    import re

    from tau2_rl.envs.data import domain_file_sha256

    text = (Path(__file__).resolve().parents[1] / "docs" / "reproducing.md").read_text(encoding="utf-8")
    quoted = re.findall(r"sha256 `([0-9a-f]+)…([0-9a-f]+)`", text)
    real = domain_file_sha256(AIRLINE, None, "tasks.json")
    assert quoted and all(real.startswith(head) and real.endswith(tail) for head, tail in quoted), (quoted, real)


def test_unknown_task_id_lists_the_valid_range() -> None:
    with pytest.raises(KeyError, match=r"0\.\.49 \(50 tasks\)"):
        load_domain(AIRLINE).get_task("50")
    with pytest.raises(KeyError, match="'abc'"):
        load_domain(AIRLINE).get_task("abc")


# ---------------------------------------------------------------------------------------------------------------------
# A small synthetic domain in a temporary directory


def _db() -> dict[str, Any]:
    return {
        "flights": {
            "HAT001": {"flight_number": "HAT001", "origin": "JFK", "destination": "LAX",
                       "scheduled_departure_time_est": "06:00:00", "scheduled_arrival_time_est": "09:00:00",
                       "dates": {"2024-05-20": {"status": "available", "available_seats": {"economy": 3},
                                                "prices": {"economy": 100}}}},
        },
        "users": {
            "ann_lee_1": {"user_id": "ann_lee_1", "name": {"first_name": "Ann", "last_name": "Lee"},
                          "address": {"address1": "1 Main St", "city": "Austin", "country": "USA", "state": "TX",
                                      "zip": "78701"},
                          "email": "ann@example.com", "dob": "1990-01-01", "payment_methods": {},
                          "saved_passengers": [], "membership": "gold", "reservations": ["ABC123"]},
        },
        "reservations": {
            "ABC123": {"reservation_id": "ABC123", "user_id": "ann_lee_1", "origin": "JFK", "destination": "LAX",
                       "flight_type": "one_way", "cabin": "economy", "flights": [], "passengers": [],
                       "payment_history": [], "created_at": "2024-05-01T00:00:00", "total_baggages": 0,
                       "nonfree_baggages": 0, "insurance": "no"},
        },
    }  # fmt: skip


def _tasks() -> list[dict[str, Any]]:
    def task(task_id: str) -> dict[str, Any]:
        return {
            "id": task_id,
            "description": {"purpose": "test"},
            "user_scenario": {"persona": None, "instructions": {"reason_for_call": "cancel", "known_info": "id",
                                                               "unknown_info": None, "task_instructions": "be nice"}},
            "evaluation_criteria": {"actions": [{"action_id": f"{task_id}_0", "name": "cancel_reservation",
                                                 "arguments": {"reservation_id": "ABC123"}}],
                                    "communicate_info": [], "nl_assertions": [], "reward_basis": ["DB"]},
        }  # fmt: skip

    return [task("0"), task("1")]


def write_domain(
    root: Path,
    db: Any = None,
    tasks: Any = None,
    policy: str | None = "# Airline policy\n",
    split: Any = None,
    raw: dict[str, str] | None = None,
) -> str:
    files: dict[str, str | None] = {
        "db.json": json.dumps(_db() if db is None else db),
        "tasks.json": json.dumps(_tasks() if tasks is None else tasks),
        "policy.md": policy,
        "split_tasks.json": json.dumps({"train": ["0"], "test": ["1"]} if split is None else split),
    }
    files.update(raw or {})
    for name, text in files.items():
        if text is not None:
            (root / name).write_text(text, encoding="utf-8")
    return str(root)


def test_synthetic_domain_loads(tmp_path: Path) -> None:
    domain = load_domain(AIRLINE, write_domain(tmp_path))
    assert set(domain.tasks) == {"0", "1"}
    task = domain.get_task(1)
    assert task.actions == (GoldAction("1_0", "cancel_reservation", {"reservation_id": "ABC123"}),)
    assert task.instructions.unknown_info == "" and task.persona == "" and task.writes
    assert task.reward_basis == ("DB",)
    assert domain.official_split == {"train": ["0"], "test": ["1"]}
    assert domain.source == str(tmp_path)
    with pytest.raises(KeyError, match=r"0\.\.1 \(2 tasks\)"):
        domain.get_task(7)


def _error(root: Path, **kwargs: Any) -> str:
    with pytest.raises(DomainDataError) as info:
        load_domain(AIRLINE, write_domain(root, **kwargs))
    return str(info.value)


def test_db_bad_json(tmp_path: Path) -> None:
    message = _error(tmp_path, raw={"db.json": '{"flights": {'})
    assert str(tmp_path / "db.json") in message and "not valid JSON" in message


def test_db_not_an_object(tmp_path: Path) -> None:
    message = _error(tmp_path, db=[1, 2])
    assert "db.json" in message and "'<root>'" in message


@pytest.mark.parametrize("table", ["flights", "users", "reservations"])
def test_db_table_missing(tmp_path: Path, table: str) -> None:
    db = _db()
    del db[table]
    message = _error(tmp_path, db=db)
    assert "db.json" in message and f"field '{table}'" in message


def test_db_table_wrong_type(tmp_path: Path) -> None:
    message = _error(tmp_path, db={**_db(), "users": ["ann_lee_1"]})
    assert "db.json" in message and "'users'" in message and "mapping ids to records" in message


@pytest.mark.parametrize(
    ("table", "key", "field"),
    [("reservations", "ABC123", "cabin"), ("reservations", "ABC123", "payment_history"),
     ("users", "ann_lee_1", "payment_methods"), ("flights", "HAT001", "dates")],
)  # fmt: skip
def test_db_record_missing_required_field(tmp_path: Path, table: str, key: str, field: str) -> None:
    db = _db()
    del db[table][key][field]
    message = _error(tmp_path, db=db)
    assert "db.json" in message and f"'{table}.{key}.{field}'" in message and "required" in message


def test_db_record_checked_against_tau2_data_model(tmp_path: Path) -> None:
    db = _db()
    db["users"]["ann_lee_1"]["membership"] = "platinum"
    message = _error(tmp_path, db=db)
    assert "db.json" in message and "'users.ann_lee_1.membership'" in message and "'gold'" in message


def test_db_is_stored_as_tau2_dumps_it(tmp_path: Path) -> None:
    reservation = load_domain(AIRLINE, write_domain(tmp_path)).db["reservations"]["ABC123"]
    assert reservation["status"] is None and list(reservation)[-1] == "status"  # τ²'s field order, explicit null
    user = load_domain(AIRLINE, write_domain(tmp_path)).db["users"]["ann_lee_1"]
    assert user["address"]["address2"] is None


def test_db_record_not_an_object(tmp_path: Path) -> None:
    db = _db()
    db["reservations"]["ABC123"] = "cancelled"
    message = _error(tmp_path, db=db)
    assert "db.json" in message and "'reservations.ABC123'" in message


def test_tasks_bad_json(tmp_path: Path) -> None:
    message = _error(tmp_path, raw={"tasks.json": "[{"})
    assert "tasks.json" in message and "not valid JSON" in message


def test_tasks_not_a_list(tmp_path: Path) -> None:
    message = _error(tmp_path, tasks={"0": {}})
    assert "tasks.json" in message and "a list of tasks" in message


def test_task_missing_user_scenario(tmp_path: Path) -> None:
    tasks = _tasks()
    del tasks[1]["user_scenario"]
    message = _error(tmp_path, tasks=tasks)
    assert "tasks.json" in message and "[1] (task 1).user_scenario" in message


def test_task_missing_reason_for_call(tmp_path: Path) -> None:
    tasks = _tasks()
    del tasks[0]["user_scenario"]["instructions"]["reason_for_call"]
    message = _error(tmp_path, tasks=tasks)
    assert "tasks.json" in message and "instructions.reason_for_call" in message


def test_action_without_name(tmp_path: Path) -> None:
    tasks = _tasks()
    del tasks[0]["evaluation_criteria"]["actions"][0]["name"]
    message = _error(tmp_path, tasks=tasks)
    assert "tasks.json" in message and "[0] (task 0).evaluation_criteria.actions[0].name" in message


def test_action_arguments_not_an_object(tmp_path: Path) -> None:
    tasks = _tasks()
    tasks[1]["evaluation_criteria"]["actions"][0]["arguments"] = ["ABC123"]
    message = _error(tmp_path, tasks=tasks)
    assert "tasks.json" in message and "actions[0].arguments" in message


def test_task_missing_id_and_duplicate_id(tmp_path: Path) -> None:
    tasks = _tasks()
    del tasks[0]["id"]
    assert "[0].id" in _error(tmp_path, tasks=tasks)
    tasks = _tasks()
    tasks[1]["id"] = "0"
    message = _error(tmp_path, tasks=tasks)
    assert "tasks.json" in message and "[1].id" in message and "duplicate 0" in message


def test_split_references_unknown_task(tmp_path: Path) -> None:
    message = _error(tmp_path, split={"train": ["0", "9"], "test": ["1"]})
    assert "split_tasks.json" in message and "'train'" in message and "'9'" in message


@pytest.mark.parametrize("name", get_domain("airline").files)
def test_missing_file(tmp_path: Path, name: str) -> None:
    write_domain(tmp_path)
    (tmp_path / name).unlink()
    with pytest.raises(DomainDataError) as info:
        load_domain(AIRLINE, str(tmp_path))
    message = str(info.value)
    assert str(tmp_path / name) in message and "missing" in message


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DomainDataError, match="db.json is missing"):
        load_domain(AIRLINE, str(tmp_path / "nowhere"))


def test_a_gold_action_no_tool_answers_names_the_file_the_task_and_the_tool(tmp_path: Path) -> None:
    """An edited tasks.json whose gold calls a tool the domain lacks loaded silently, and the oracle then scored a
    tool error on that task (issue 62): the task is refused as a task (issue 68: the same treatment as an installed
    release's task), and a run that selects it stops at start naming the file, the task and the tool."""
    from tau2_rl.rewards.outcome import RewardTermError, require_scorable

    tasks = _tasks()
    tasks[1]["evaluation_criteria"]["actions"][0]["name"] = "cancel_booking"
    domain = load_domain(AIRLINE, write_domain(tmp_path, tasks=tasks))
    assert not domain.tasks["0"].unscorable and "cancel_booking" in domain.tasks["1"].unscorable
    with pytest.raises(RewardTermError) as info:
        require_scorable(domain.tasks, judge_available=False)
    message = str(info.value)
    assert str(tmp_path / "tasks.json") in message and "task 1" in message and "[1].evaluation_criteria" in message
    assert "'cancel_booking', none of the 14 tools of the airline domain" in message and "--tasks" in message
    require_scorable({"0": domain.tasks["0"]}, judge_available=False)  # the others still run
