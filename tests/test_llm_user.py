"""Tests of the LLM user simulator against a real OpenAI-compatible HTTP server on 127.0.0.1 (``openai_stub_server``).

Everything runs offline in a few seconds: the stub answers at once unless a test asks it to be slow, fail or hang.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from openai_stub_server import STOP_REPLY, StubServer, marker

from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import USER_ERROR, USER_STOP, DomainEnv, EnvConfig, Episode
from tau2_rl.envs.users import USER_SIMULATORS, get_user_simulator
from tau2_rl.envs.users.llm import EMPTY_AGENT_TURN, EndpointUnreachableError, LLMUser, LLMUserConfig, user_view

AIRLINE = get_domain("airline")


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(AIRLINE)


@pytest.fixture
def stub() -> Iterator[Callable[..., StubServer]]:
    """Starts stub servers on free ports; all are stopped when the test ends."""
    servers: list[StubServer] = []

    def start(mode: str = "echo", **kwargs: object) -> StubServer:
        server = StubServer(mode, **kwargs).start()  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def make_user() -> Iterator[Callable[..., LLMUser]]:
    """Builds simulators with fast test defaults; all are closed when the test ends."""
    users: list[LLMUser] = []

    def make(server: StubServer, **overrides: object) -> LLMUser:
        settings: dict[str, object] = {"timeout": 5.0, "max_retries": 2, "backoff": 0.01, **overrides}
        user = LLMUser(base_url=server.base_url, model=server.model, **settings)
        users.append(user)
        return user

    yield make
    for user in users:
        user.close()


def waiting_episode(env: DomainEnv, text: str | None = None, task_id: str = "0", seed: int = 0) -> Episode:
    """An episode whose user must answer: the greeting, then optionally one more agent message."""
    episode = env.reset(task_id, seed)
    if text is not None:
        episode.user_response("Hi, I need help with a reservation.")
        assert episode.env_response(text) == []
    return episode


def loop_threads() -> int:
    return sum(thread.name == "llm-user-loop" for thread in threading.enumerate())


def test_full_episode_until_stop(env: DomainEnv, stub: Callable[..., StubServer], make_user) -> None:
    server = stub("stop", stop_after=2)
    user = make_user(server, seed=100)
    episode = env.reset("0", seed=5)
    agent_turns = [
        'Let me look you up. <tool_call>{"name": "get_user_details", "arguments": {"user_id": "emma_kim_9957"}}'
        "</tool_call>",
        "I found your profile. Which reservation is it about?",
        "Thank you, anything else?",
    ]
    replies = []
    for turn in [None, *agent_turns]:
        if turn is not None:
            while episode.env_response(turn):  # tool results: the agent speaks again before the user
                turn = "I found your profile. What would you like to do?"
        reply = user.reply(episode)
        assert reply.error is None
        replies.append(reply.content)
        episode.user_response(reply.content, reply.termination, reply.error)
        if episode.is_completed:
            break
    assert replies[0].startswith("[reply 1 seed=105] You said: Hi! How can I help you today?")
    assert replies[-1] == STOP_REPLY
    assert episode.record.termination == USER_STOP
    assert len(replies) == 3

    last = server.bodies[-1]
    assert last["model"] == server.model and last["seed"] == 105 and last["temperature"] == 0.0
    assert last["top_p"] == 1.0 and last["max_tokens"] == 512
    roles = [message["role"] for message in last["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    system = last["messages"][0]["content"]
    assert "###STOP###" in system and "###TRANSFER###" in system and "###OUT-OF-SCOPE###" in system
    assert "You want to cancel reservation EHGLP3." in system and "emma_kim_9957" in system
    seen = json.dumps(last["messages"][1:])
    assert "tool_call" not in seen and "get_user_details" not in seen and "membership" not in seen
    assert "Let me look you up." in seen and env.system_prompt[:40] not in seen


def test_user_view_roles_merging_and_empty_agent_turn(env: DomainEnv) -> None:
    episode = env.reset("0")
    episode.user_response("I want to cancel.")
    episode.env_response('<tool_call>{"name": "get_user_details", "arguments": {"user_id": "x"}}</tool_call>')
    episode.env_response("First part.")
    view = user_view(episode)
    assert [m["role"] for m in view] == ["system", "user", "assistant", "user"]
    assert view[-1]["content"] == "First part."

    episode.user_response("Ok.")
    episode.messages.append({"role": "assistant", "content": "Second part."})  # two visible agent turns in a row
    episode.messages.append({"role": "assistant", "content": "Third part."})
    assert user_view(episode)[-1] == {"role": "user", "content": "Second part.\n\nThird part."}

    episode.user_response("Still there?")
    episode.env_response("")  # the agent said nothing visible: the request must still end on the agent's side
    assert user_view(episode)[-1] == {"role": "user", "content": EMPTY_AGENT_TURN}


def test_concurrency_limit_is_respected(env: DomainEnv, stub: Callable[..., StubServer], make_user) -> None:
    server = stub("slow", delay_s=0.15)
    episodes = [waiting_episode(env, seed=i) for i in range(9)]
    replies = make_user(server, concurrency=3).reply_batch(episodes)
    assert all(reply.error is None for reply in replies)
    assert server.requests == 9
    assert 1 < server.max_in_flight <= 3

    server.reset_counters()
    start = time.monotonic()
    replies = make_user(server, concurrency=1).reply_batch(episodes[:3])
    assert server.max_in_flight == 1 and time.monotonic() - start >= 0.45
    assert [reply.content for reply in replies] == [
        f"[reply 1 seed={i}] You said: Hi! How can I help you today?" for i in range(3)
    ]


def test_slow_request_does_not_block_the_rest(env: DomainEnv, stub: Callable[..., StubServer], make_user) -> None:
    server = stub("echo", delay_s=1.0)
    episodes = [waiting_episode(env, f"Please hold. {marker('slow')}")]
    episodes += [waiting_episode(env, f"Fast question {i}?") for i in range(10)]
    start = time.monotonic()
    replies = make_user(server, concurrency=2).reply_batch(episodes)
    elapsed = time.monotonic() - start
    assert all(reply.error is None for reply in replies)
    assert replies[3].content.endswith("You said: Fast question 2?")
    assert 1.0 <= elapsed < 4.0  # bounded well below a hang; the order check below is the point
    slow_end = next(end for mode, _, end in server.timeline if mode == "slow")
    assert all(end < slow_end for mode, _, end in server.timeline if mode == "echo")


def test_error_episode_fails_after_retries_others_unaffected(
    env: DomainEnv, stub: Callable[..., StubServer], make_user
) -> None:
    server = stub("echo")
    episodes = [
        waiting_episode(env, "Good one?"),
        waiting_episode(env, f"Broken one. {marker('error')}"),
        waiting_episode(env, "Another good one?"),
    ]
    user = make_user(server, max_retries=2)
    replies = user.reply_batch(episodes)
    assert replies[0].content.endswith("You said: Good one?") and replies[0].error is None
    assert replies[2].content.endswith("You said: Another good one?") and replies[2].error is None
    assert replies[1].error is not None and replies[1].content == ""
    assert "HTTP 500" in replies[1].error and "after 3 attempt(s)" in replies[1].error
    assert server.requests == 2 + 3  # one per good episode, 1 + max_retries for the broken one
    stats = user.stats()
    assert (stats["requests"], stats["replies"], stats["retries"], stats["failures"]) == (5, 2, 2, 1)

    episodes[1].user_response(replies[1].content, replies[1].termination, replies[1].error)
    assert episodes[1].record.termination == USER_ERROR and "HTTP 500" in episodes[1].record.user_error


def test_hanging_request_times_out_within_bound(env: DomainEnv, stub: Callable[..., StubServer], make_user) -> None:
    server = stub("echo", hang_s=30.0)
    episodes = [waiting_episode(env, f"Hello? {marker('hang')}"), waiting_episode(env, "Are you there?")]
    user = make_user(server, timeout=0.4, max_retries=1, backoff=0.05)
    start = time.monotonic()
    replies = user.reply_batch(episodes)
    elapsed = time.monotonic() - start
    assert replies[0].error is not None and "timed out after 0.4s" in replies[0].error
    assert replies[1].error is None and replies[1].content.endswith("You said: Are you there?")
    assert 0.8 <= elapsed < 4.0  # two attempts of 0.4 s and one short backoff; never the server's 30 s
    assert user.stats()["failures"] == 1


def test_empty_reply_is_retried_then_fails(env: DomainEnv, stub: Callable[..., StubServer], make_user) -> None:
    server = stub("empty")
    user = make_user(server, max_retries=1)
    reply = user.reply(waiting_episode(env))
    assert reply.error is not None and "empty reply" in reply.error
    assert server.requests == 2
    assert user.stats()["retries"] == 1


def test_replay_cache_hit_sends_no_request(
    env: DomainEnv, stub: Callable[..., StubServer], make_user, tmp_path: Path
) -> None:
    server = stub("echo")
    cache_dir = tmp_path / "cache"
    first = make_user(server, cache_dir=str(cache_dir), seed=7).reply(waiting_episode(env, "Cache me?"))
    assert server.requests == 1 and first.error is None
    files = list(cache_dir.rglob("*"))
    entries = [path for path in files if path.is_file()]
    assert len(entries) == 1 and entries[0].parent.name == entries[0].name[:2] and entries[0].suffix == ".json"

    replay = make_user(server, cache_dir=str(cache_dir), seed=7)  # a fresh simulator, as in a rerun
    again = replay.reply(waiting_episode(env, "Cache me?"))
    assert again == first
    assert server.requests == 1
    stats = replay.stats()
    assert stats["cache_hits"] == 1 and stats["requests"] == 0

    make_user(server, cache_dir=str(cache_dir), seed=7, temperature=0.7).reply(waiting_episode(env, "Cache me?"))
    make_user(server, cache_dir=str(cache_dir), seed=8).reply(waiting_episode(env, "Cache me?"))
    make_user(server, cache_dir=str(cache_dir), seed=7).reply(waiting_episode(env, "Something else?"))
    assert server.requests == 4  # sampling settings, seed and conversation are all part of the key
    assert not [path for path in cache_dir.rglob("*.tmp")]

    failing = make_user(server, cache_dir=str(cache_dir), max_retries=0)
    assert failing.reply(waiting_episode(env, f"x {marker('error')}")).error is not None
    assert len([path for path in cache_dir.rglob("*.json")]) == 4  # failures are never cached


def test_tau2_keeps_the_replys_whitespace_tau2_rl_strips_it(
    stub: Callable[..., StubServer], make_user, tmp_path: Path
) -> None:
    """τ²'s UserSimulator takes the endpoint's content as it is; so does the ``tau2`` protocol (the replay cache
    keys the two apart, so a stripped reply cached before is never replayed as a τ² one)."""
    server = stub("echo")
    text = "A" * 79 + " tail"  # echo quotes 80 characters: the reply ends in a space
    replies = {}
    for protocol in ("tau2", "tau2_rl"):
        env = DomainEnv(AIRLINE, None, EnvConfig(protocol=protocol))
        user = make_user(server, cache_dir=str(tmp_path / "cache"))
        replies[protocol] = user.reply(waiting_episode(env, text)).content
    assert replies["tau2"].endswith("A ") and replies["tau2_rl"] == replies["tau2"].rstrip()
    assert server.requests == 2  # one cache key per protocol
    assert sorted(p.read_text(encoding="utf-8").count('A "') for p in (tmp_path / "cache").rglob("*.json")) == [0, 1]


def test_stats_counts_and_resets(env: DomainEnv, stub: Callable[..., StubServer], make_user) -> None:
    server = stub("echo")
    user = make_user(server)
    user.reply_batch([waiting_episode(env, f"Question {i}?") for i in range(3)])
    stats = user.stats()
    bodies = server.bodies
    prompt_tokens = sum(len(str(m["content"]).split()) for body in bodies for m in body["messages"])
    assert stats["requests"] == 3 and stats["replies"] == 3 and stats["retries"] == 0 and stats["failures"] == 0
    assert stats["prompt_tokens"] == prompt_tokens > 0
    assert stats["completion_tokens"] == 3 * len("[reply 1 seed=0] You said: Question 0?".split())
    assert 0 < stats["latency_p50"] <= stats["latency_p90"] <= stats["latency_p99"] < 5
    assert stats["latency_mean"] > 0
    empty = user.stats()
    assert empty["requests"] == 0 and empty["latency_p50"] == 0.0
    user.reply(waiting_episode(env))
    total = user.total_stats()
    assert total["requests"] == 4 and total["prompt_tokens"] > prompt_tokens
    assert user.stats()["requests"] == 1


def test_missing_endpoint_or_model_names_the_flag(stub: Callable[..., StubServer]) -> None:
    with pytest.raises(ValueError, match="--user_base_url"):
        LLMUser(model="some-model")
    with pytest.raises(ValueError, match="--user_model"):
        LLMUser(base_url="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="--concurrency"):
        LLMUser(base_url="http://127.0.0.1:1/v1", model="m", concurrency=0)
    with pytest.raises(TypeError, match="base_url"):
        LLMUser(base_url="http://127.0.0.1:1/v1", model="m", temprature=0.5)
    LLMUserConfig()  # the empty config itself is fine: a CLI builds it even when the scripted user runs


def test_check_endpoint(stub: Callable[..., StubServer], make_user) -> None:
    server = stub("echo")
    assert make_user(server).check_endpoint() == [server.model]
    with pytest.raises(ValueError, match="stub-model"):
        LLMUser(base_url=server.base_url, model="not-served").check_endpoint()

    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    start = time.monotonic()
    with pytest.raises(EndpointUnreachableError, match=f"{url}/models is unreachable"):
        LLMUser(base_url=url, model="m").check_endpoint(timeout=2.0)
    assert time.monotonic() - start < 3.0


def test_works_inside_a_running_loop_and_threads_without_leaking(
    env: DomainEnv, stub: Callable[..., StubServer], make_user
) -> None:
    server = stub("echo")
    user = make_user(server)
    baseline = loop_threads()
    user.reply(waiting_episode(env))

    async def inside_a_loop() -> str:  # e.g. a notebook or an async server calling the sync API
        return user.reply(waiting_episode(env, "From a loop?")).content

    assert asyncio.run(inside_a_loop()).endswith("From a loop?")
    results: list[str] = []
    worker = threading.Thread(
        target=lambda: results.append(user.reply(waiting_episode(env, "From a thread?")).content)
    )
    worker.start()
    worker.join()
    assert results[0].endswith("From a thread?")
    for _ in range(5):
        user.reply_batch([waiting_episode(env, seed=i) for i in range(4)])
    assert loop_threads() == baseline + 1  # one loop thread per simulator, whatever the number of waves
    user.close()
    assert loop_threads() == baseline
    assert user.reply(waiting_episode(env, "After close?")).content.endswith("After close?")  # restarts lazily


def test_backoff_is_exponential_and_deterministic(stub: Callable[..., StubServer], make_user) -> None:
    user = make_user(stub("echo"), backoff=1.0)
    delays = [user.backoff_delay("abc", retry) for retry in (1, 2, 3)]
    assert delays == [user.backoff_delay("abc", retry) for retry in (1, 2, 3)]
    for retry, delay in enumerate(delays, start=1):
        assert 0.5 * 2 ** (retry - 1) <= delay < 2 ** (retry - 1)
    assert user.backoff_delay("abc", 1) != user.backoff_delay("abd", 1)
    assert user.backoff_delay("abc", 20) == 30.0


def test_registry(stub: Callable[..., StubServer]) -> None:
    assert set(USER_SIMULATORS) == {"scripted", "llm"}
    server = stub("echo")
    user = get_user_simulator("llm", base_url=server.base_url, model=server.model)
    assert isinstance(user, LLMUser) and user.name == "llm"
    user.close()
    with pytest.raises(ValueError, match="llm, scripted"):
        get_user_simulator("gpt-user")


def test_endpoint_down_or_wrong_path_gives_user_errors(env: DomainEnv, stub: Callable[..., StubServer]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with LLMUser(base_url=f"http://127.0.0.1:{port}/v1", model="m", max_retries=1, backoff=0.01) as user:
        reply = user.reply(waiting_episode(env))
    assert reply.error is not None and "after 2 attempt(s)" in reply.error and f"127.0.0.1:{port}" in reply.error

    server = stub("echo")
    wrong = server.base_url.removesuffix("/v1")  # a 404 is not retried: it cannot get better
    with LLMUser(base_url=wrong, model=server.model, max_retries=3, backoff=0.01) as user:
        reply = user.reply(waiting_episode(env))
        assert user.stats()["requests"] == 1
    assert reply.error is not None and "HTTP 404" in reply.error and "after 1 attempt(s)" in reply.error


def test_the_stub_server_runs_by_hand_and_an_evaluation_uses_it(tmp_path: Path) -> None:
    """``python tests/openai_stub_server.py`` (its docstring's command) serves until stopped; evaluate.py's LLM user
    plays against it."""
    import json
    import signal
    import subprocess
    import sys
    import urllib.request

    repo = Path(__file__).resolve().parent.parent
    server = subprocess.Popen(
        [sys.executable, str(repo / "tests" / "openai_stub_server.py"), "--mode", "stop", "--stop_after", "1",
         "--port", "0"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = server.stdout.readline()
        assert line.startswith("serving 'stub-model' in mode 'stop' at http://127.0.0.1:"), line
        base_url = line.split(" at ", 1)[1].split()[0]
        with urllib.request.urlopen(f"{base_url}/models", timeout=10) as response:
            assert json.loads(response.read())["data"][0]["id"] == "stub-model"
        done = subprocess.run(
            [sys.executable, str(repo / "evaluate.py"), "--model", "oracle", "--tasks", "0", "--num_samples", "1",
             "--user_simulator", "llm", "--user_base_url", base_url, "--user_model", "stub-model",
             "--output_dir", str(tmp_path), "--progress", "false", "--protocol", "tau2_rl"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]  # every episode scored (user errors would make it 1)
        results = json.loads((tmp_path / "oracle" / "results.json").read_text())
        assert results["metrics"]["user_errors"] == 0 and results["metrics"]["episodes"] == 1
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=10) == 0


def test_the_stubs_latency_is_a_seeded_log_normal_function_of_the_request() -> None:
    """Groundwork for scheduling benchmarks: the same request waits as long whatever its order; over many requests
    the delays are log-normal around the median (checked on the drawn values, never on a clock)."""
    import math
    import statistics

    server = StubServer("echo", latency=(0.3, 1.0), latency_seed=7)
    bodies = [{"messages": [{"role": "user", "content": f"turn {i}"}]} for i in range(2000)]
    delays = [server.latency_of(body) for body in bodies]
    assert delays == [server.latency_of(body) for body in bodies]  # a function of the request, not of the order
    assert StubServer("echo", latency=(0.3, 1.0), latency_seed=8).latency_of(bodies[0]) != delays[0]
    logs = [math.log(d / 0.3) for d in delays]
    assert abs(statistics.mean(logs)) < 0.1 and abs(statistics.stdev(logs) - 1.0) < 0.1
    assert StubServer("echo").latency_of(bodies[0]) == 0.0
    with pytest.raises(ValueError, match="latency"):
        StubServer("echo", latency=(0.0, 1.0))
