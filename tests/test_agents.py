"""Scripted agents and the scripted user: the offline end-to-end check of tools, state, reward and simulator.

The oracle replaying the gold actions must earn reward 1 on every task; the no-op agent must earn it exactly on the
tasks whose gold changes nothing and asks nothing to be said. All of it runs on CPU in a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.tools import WRITE_TOOLS
from tau2_rl.envs.agents import AGENTS, NoopAgent, OracleAgent, get_agent
from tau2_rl.envs.episode import USER_STOP, USER_TRANSFER, DomainEnv, Episode
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.state import EpisodeState
from tau2_rl.envs.users.scripted import STOP, ScriptedUser, to_first_person
from tau2_rl.rewards.outcome import gold_db_hash, outcome_reward

AIRLINE = get_domain("airline")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(AIRLINE)


@pytest.fixture(scope="module")
def all_task_ids(env: DomainEnv) -> list[str]:
    return list(env.domain.tasks)


def _transcript(episode_messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], str(m.get("content"))) for m in episode_messages]


def _start(env: DomainEnv, user: ScriptedUser, task_id: str, seed: int = 0) -> Episode:
    """A fresh episode whose user has answered the greeting."""
    episode = env.reset(task_id, seed)
    reply = user.reply(episode)
    episode.user_response(reply.content, reply.termination, reply.error)
    return episode


def _say(episode: Episode, user: ScriptedUser, text: str):
    """The agent says ``text``; returns the user's reply (also applied to the episode)."""
    assert episode.env_response(text) == []
    reply = user.reply(episode)
    episode.user_response(reply.content, reply.termination, reply.error)
    return reply


# ---------------------------------------------------------------------------------------------------------------------
# Oracle and no-op agents


def test_oracle_earns_reward_one_on_every_task(env: DomainEnv, all_task_ids: list[str]) -> None:
    assert len(all_task_ids) == 50
    records = run_episodes(env, OracleAgent(), ScriptedUser(), [(t, 0) for t in all_task_ids], score=outcome_reward)
    failures = {
        r.task_id: {k: r.reward[k] for k in ("reward", "db_match", "communicate_missing", "termination", "num_turns")}
        for r in records
        if r.reward["reward"] != 1.0
    }
    assert not failures, f"oracle failed {len(failures)} task(s): {json.dumps(failures, indent=1)}"
    for record in records:
        task = env.domain.get_task(record.task_id)
        transfers = any(a.name == "transfer_to_human_agents" for a in task.actions)
        assert record.termination == (USER_TRANSFER if transfers else USER_STOP), record.task_id
        assert record.num_tool_errors == 0, record.task_id
        assert [c.name for c in record.tool_calls] == sorted(
            (a.name for a in task.actions), key=lambda n: n == "transfer_to_human_agents"
        ), record.task_id
        # the user answered the oracle's id question with the id it knows
        user_messages = [m["content"] for m in record.messages if m["role"] == "user"]
        assert len(user_messages) >= 2 and "user id is" in user_messages[1], (record.task_id, user_messages[:2])


def test_oracle_confirms_before_every_write(env: DomainEnv) -> None:
    records = run_episodes(env, OracleAgent(), ScriptedUser(), [("18", 0), ("7", 0)], score=outcome_reward)
    for record in records:
        writes = [c for c in record.tool_calls if c.is_write]
        assert writes, record.task_id
        for call in writes:
            asked = record.turns[call.turn].last_user_message
            assert asked.lower().startswith("yes"), (record.task_id, call.name, asked)
            previous = record.turns[call.turn - 1].message
            assert "Do you confirm (yes/no)?" in previous, previous


def test_noop_earns_reward_exactly_where_gold_changes_nothing_and_says_nothing(
    env: DomainEnv, all_task_ids: list[str]
) -> None:
    base_hash = EpisodeState(env.base).db_hash()
    expected = set()
    for task_id in all_task_ids:
        task = env.domain.get_task(task_id)
        db_ok = "DB" not in task.reward_basis or gold_db_hash(env.base, task) == base_hash
        info_ok = "COMMUNICATE" not in task.reward_basis or not task.communicate_info
        if db_ok and info_ok:
            expected.add(task_id)
    # the same set by the simpler rule: no gold write, nothing to communicate (no gold write is a no-op)
    by_rule = {
        t.task_id
        for t in env.domain.tasks.values()
        if not any(a.name in WRITE_TOOLS for a in t.actions) and not t.communicate_info
    }
    assert expected == by_rule
    assert "13" in expected  # a gold transfer writes nothing: the no-op agent's user_stop earns the reward too

    records = run_episodes(env, NoopAgent(), ScriptedUser(), [(t, 0) for t in all_task_ids], score=outcome_reward)
    rewarded = {r.task_id for r in records if r.reward["reward"] == 1.0}
    assert rewarded == expected, f"unexpected: {sorted(rewarded - expected)}, missing: {sorted(expected - rewarded)}"
    assert all(r.num_tool_calls == 0 and r.termination == USER_STOP and len(r.turns) == 1 for r in records)


def test_get_agent_builds_registered_agents_and_rejects_unknown_names() -> None:
    assert set(AGENTS) == {"oracle", "noop"}
    assert isinstance(get_agent("oracle"), OracleAgent)
    assert isinstance(get_agent("noop"), NoopAgent)
    with pytest.raises(ValueError, match="bogus") as info:
        get_agent("bogus")
    assert "noop" in str(info.value) and "oracle" in str(info.value)


# ---------------------------------------------------------------------------------------------------------------------
# Scripted user


def test_scripted_user_is_deterministic(env: DomainEnv) -> None:
    specs = [("7", 3), ("14", 5), ("38", 0)]
    first = [
        _transcript(r.messages) for r in run_episodes(env, OracleAgent(), ScriptedUser(), specs, score=outcome_reward)
    ]
    second = [
        _transcript(r.messages) for r in run_episodes(env, OracleAgent(), ScriptedUser(), specs, score=outcome_reward)
    ]
    assert first == second


def test_scripted_user_is_deterministic_across_processes() -> None:
    """Phrasing must not depend on hash randomisation (string hashing differs between processes)."""
    code = (
        "import json\n"
        "from tau2_rl.domains import get_domain\n"
        "from tau2_rl.envs.agents import OracleAgent\n"
        "from tau2_rl.envs.episode import DomainEnv\n"
        "from tau2_rl.envs.runner import run_episodes\n"
        "from tau2_rl.envs.users.scripted import ScriptedUser\n"
        "from tau2_rl.rewards.outcome import outcome_reward\n"
        "specs = [('7', 1), ('23', 2), ('9', 4)]\n"
        "env = DomainEnv(get_domain('airline'))\n"
        "records = run_episodes(env, OracleAgent(), ScriptedUser(), specs, score=outcome_reward)\n"
        "print(json.dumps([[m['content'] for m in r.messages if m['role'] == 'user'] for r in records]))\n"
    )
    outputs = []
    for hash_seed in ("1", "2"):
        environ = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=REPO_ROOT, timeout=120
        )
        assert done.returncode == 0, done.stderr
        outputs.append(json.loads(done.stdout))
    assert outputs[0] == outputs[1]
    assert all(len(messages) >= 3 for messages in outputs[0])


def test_scripted_user_seed_changes_only_phrasing(env: DomainEnv) -> None:
    rewards = set()
    acknowledgements = set()
    for seed in range(6):
        (record,) = run_episodes(env, OracleAgent(), ScriptedUser(), [("7", seed)], score=outcome_reward)
        rewards.add(record.reward["reward"])
        acknowledgements.update(m["content"] for m in record.messages if m["role"] == "user")
    assert rewards == {1.0}
    assert len({a for a in acknowledgements if a.startswith("Yes")}) > 1  # the seed varies the wording of "yes"


def test_scripted_user_opens_with_the_reason_for_the_call(env: DomainEnv) -> None:
    episode = _start(env, ScriptedUser(), "0")
    assert episode.messages[-1] == {"role": "user", "content": "Hi! I want to cancel reservation EHGLP3."}
    assert to_first_person("The agent tells you that your flight allows you to bring bags.") == (
        "The agent tells me that my flight allows me to bring bags."
    )


def test_scripted_user_answers_id_questions_with_what_it_knows(env: DomainEnv) -> None:
    user = ScriptedUser()
    episode = _start(env, user, "0")
    reply = _say(episode, user, "Sure. Could you please provide your user id?")
    assert "emma_kim_9957" in reply.content and reply.termination is None
    reply = _say(episode, user, "Thanks. What is the reservation number?")
    assert "EHGLP3" in reply.content
    reply = _say(episode, user, "May I have your full name?")
    assert "Emma Kim" in reply.content
    # task 38's user does not remember the reservation id, but knows the user id
    episode = _start(env, user, "38")
    reply = _say(episode, user, "Please share your user id and reservation id.")
    assert "noah_muller_9847" in reply.content and "don't remember my reservation id" in reply.content


@pytest.mark.parametrize(
    "question",
    [
        "I will cancel reservation EHGLP3 for you. Do you confirm (yes/no)?",
        "The refund goes to your card. Shall I proceed?",
        "Would you like me to go ahead and book this flight?",
    ],
)
def test_scripted_user_says_yes_to_a_confirmation_question(env: DomainEnv, question: str) -> None:
    user = ScriptedUser()
    episode = _start(env, user, "0")
    reply = _say(episode, user, question)
    assert reply.content.lower().startswith("yes") and reply.termination is None


def test_scripted_user_ends_on_closing_refusal_and_transfer(env: DomainEnv) -> None:
    user = ScriptedUser()
    cases = [
        ("Your booking is done. Is there anything else I can help you with?", USER_STOP),
        ("I'm sorry, but I cannot help with cancelling this reservation.", USER_STOP),
        ("Have a great day!", USER_STOP),
        ("I am transferring you to a human agent. Please hold on.", USER_TRANSFER),
    ]
    for text, termination in cases:
        episode = _start(env, user, "0")
        _say(episode, user, text)
        assert episode.record.termination == termination, text


def test_scripted_user_answers_other_questions_from_the_scenario(env: DomainEnv) -> None:
    user = ScriptedUser()
    episode = _start(env, user, "35")
    reply = _say(episode, user, "Which payment method would you like to use for the new flight?")
    assert "7334" in reply.content  # "You can pay for the new flight using your credit card ending in 7334"
    reply = _say(episode, user, "Hmm, what is the airspeed velocity of an unladen swallow?")
    assert reply.content and reply.termination is None  # a neutral line, not a crash or a stop


def test_scripted_user_stops_at_the_turn_cap_against_garbage(env: DomainEnv) -> None:
    class GarbageAgent:
        """An untrained policy: random characters, unclosed tags, questions, never a tool call."""

        def __init__(self) -> None:
            self.rng = random.Random(0)

        def act(self, episodes: list[Episode]) -> list[str]:
            alphabet = "qwxzjkvpfm éø漢字<>{}[]\"':;?!.,_/\\ \n\t"
            return [
                "".join(self.rng.choice(alphabet) for _ in range(self.rng.randint(0, 80))).replace("<tool", "<t")
                for _ in episodes
            ]

    cap = 7
    records = run_episodes(
        env, GarbageAgent(), ScriptedUser(max_user_turns=cap), [(t, 0) for t in ("0", "8", "44")], score=outcome_reward
    )
    for record in records:
        user_messages = [m["content"] for m in record.messages if m["role"] == "user"]
        assert record.termination == USER_STOP, (record.task_id, record.termination, user_messages)
        assert len(user_messages) == cap and user_messages[-1] == STOP
        assert record.user_error is None
    # a conversation that does nothing still earns the task whose gold does nothing (task 0), and no other
    assert {r.task_id: r.reward["reward"] for r in records} == {"0": 1.0, "8": 0.0, "44": 0.0}


def test_scripted_user_never_raises_on_odd_agent_turns(env: DomainEnv) -> None:
    user = ScriptedUser()
    odd = ["", "   ", "?" * 5000, "<tool_call>{not json", "</tool_call>", "\x00\x01", "ÿ" * 3, "name? id? confirm?"]
    episode = _start(env, user, "44")
    for text in odd:
        if episode.is_completed:
            break
        episode.messages.append({"role": "assistant", "content": text})
        reply = user.reply(episode)
        assert reply.error is None and isinstance(reply.content, str) and reply.content, text
        episode.user_response(reply.content, reply.termination, reply.error)


def test_max_user_turns_must_leave_room_for_the_opening() -> None:
    with pytest.raises(ValueError, match="max_user_turns"):
        ScriptedUser(max_user_turns=1)


# ---------------------------------------------------------------------------------------------------------------------
# play.py


def _load_play():
    spec = importlib.util.spec_from_file_location("play", REPO_ROOT / "play.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_play_runs_selected_tasks_and_reports_the_pass_rate(capsys: pytest.CaptureFixture[str]) -> None:
    play = _load_play()
    assert play.main(["--agent", "oracle", "--tasks", "0,7,13", "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "pass rate (oracle agent, scripted user): 3/3 = 100.0%" in out
    assert sum(line.startswith("task ") for line in out.splitlines()) == 3


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--agent", "bogus"], "valid agents: noop, oracle"),
        (["--user", "llm9000"], "valid users: scripted"),
        (["--tasks", "0,999"], "unknown task id(s) ['999']"),
    ],
)
def test_play_rejects_bad_input(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    play = _load_play()
    with pytest.raises(SystemExit) as info:
        play.main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err
