"""The event-driven episode loop (``tau2_rl.envs.runner``): who the agent is called with, and when.

The users here answer after a set delay per episode (a timer per request), so the order of events is known: the
tests assert which episodes share a call and in which order they finish, never how long anything took.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import USER_ERROR, DomainEnv, EnvConfig
from tau2_rl.envs.runner import AgentTurn, RunTimings, Schedule, run_episodes
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.envs.users.base import UserReply, UserSimulator
from tau2_rl.rewards.outcome import outcome_reward

AIRLINE = get_domain("airline")

SPECS = [("0", 0), ("1", 1), ("2", 2)]


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(AIRLINE, config=EnvConfig(max_turns=3))


class Talker:
    """Writes to the user every turn; records the episode indices (their seeds) of every call."""

    def __init__(self, fail_at_call: int | None = None) -> None:
        self.calls: list[list[int]] = []
        self.released: list[int] = []
        self.fail_at_call = fail_at_call

    def act(self, episodes):
        self.calls.append([ep.seed for ep in episodes])
        if self.fail_at_call is not None and len(self.calls) == self.fail_at_call:
            raise KeyboardInterrupt  # as a Ctrl-C in the middle of a generation
        return [AgentTurn(text=f"turn {len(ep.record.turns)} of episode {ep.seed}") for ep in episodes]

    def release(self, episodes):
        self.released.extend(ep.seed for ep in episodes)


class DelayedUser(UserSimulator):
    """Answers episode ``seed`` after ``delays[seed]`` seconds (a timer thread per request); ``errors`` fail."""

    name = "delayed"
    answers_at_once = False

    def __init__(self, delays: dict[int, float], errors: frozenset[int] = frozenset()) -> None:
        self.delays, self.errors = delays, errors
        self.timers: list[threading.Timer] = []
        self.futures: list[Future] = []

    def reply(self, episode):  # pragma: no cover - submit_batch is what the loop calls
        raise AssertionError("the loop must submit")

    def submit_batch(self, episodes):
        futures = []
        for episode in episodes:
            future: Future = Future()
            reply = (
                UserReply(error="the endpoint failed")
                if episode.seed in self.errors
                else UserReply.from_text(f"reply {len(episode.record.turns)}")
            )

            def land(future: Future = future, reply: UserReply = reply) -> None:
                if future.set_running_or_notify_cancel():
                    future.set_result(reply)

            timer = threading.Timer(self.delays[episode.seed], land)
            timer.start()
            self.timers.append(timer)
            self.futures.append(future)
            futures.append(future)
        return futures


def play(env, agent, user, schedule=None, timings=None):
    return run_episodes(env, agent, user, SPECS, score=outcome_reward, schedule=schedule, timings=timings)


def test_a_user_that_answers_at_once_plays_the_lock_step_waves(env) -> None:
    """The scripted user: every call carries every unfinished episode, in order, in both schedules, with the same
    records; nothing is ever in flight."""
    runs = {}
    for mode in ("events", "waves"):
        agent, timings = Talker(), RunTimings()
        records = play(env, agent, get_user_simulator("scripted"), Schedule(mode=mode), timings)
        runs[mode] = (agent.calls, [r.messages for r in records])
        assert timings.max_in_flight == 0 and timings.in_flight_seconds == 0.0
        assert sorted(agent.released) == [0, 1, 2]
    assert runs["events"] == runs["waves"]
    assert runs["events"][0] == [[0, 1, 2]] * 3  # 3 turns, all episodes together


def test_each_episode_moves_on_when_its_own_reply_lands(env) -> None:
    """Episodes 0 and 1 are answered at once, episode 2 after 1 s: the first two play all their turns before episode
    2 gets its first reply; under waves every call waits for episode 2."""
    delays = {0: 0.0, 1: 0.0, 2: 1.0}
    agent, timings = Talker(), RunTimings()
    records = play(env, agent, DelayedUser(delays), Schedule(), timings)
    first_with_2 = next(i for i, call in enumerate(agent.calls) if 2 in call)
    early = [seed for call in agent.calls[:first_with_2] for seed in call]
    assert early.count(0) == 3 and early.count(1) == 3  # all of their turns, without episode 2
    assert agent.released[:2] in ([0, 1], [1, 0]) and agent.released[2] == 2
    assert all(len(r.turns) == 3 for r in records)
    assert 0.0 < timings.agent_idle_fraction <= 1.0 and timings.max_in_flight >= 1 and timings.mean_in_flight > 0

    waves = Talker()
    waved = play(env, waves, DelayedUser(delays), Schedule(mode="waves"))
    assert waves.calls == [[0, 1, 2]] * 3
    assert [r.messages for r in waved] == [r.messages for r in records]  # the same conversations either way


def test_min_ready_and_the_batching_window_decide_the_first_call(env) -> None:
    agent = Talker()
    play(env, agent, DelayedUser({0: 0.0, 1: 0.3, 2: 1.5}), Schedule(min_ready=2, batch_window=10.0))
    assert agent.calls[0] == [0, 1]  # episode 1's reply made two ready

    agent = Talker()
    play(env, agent, DelayedUser({0: 0.0, 1: 0.0, 2: 1.5}), Schedule(min_ready=3, batch_window=0.3))
    assert agent.calls[0] == [0, 1]  # the window ran out before episode 2 was ready

    agent = Talker()
    play(env, agent, DelayedUser({0: 0.0, 1: 0.0, 2: 0.5}), Schedule(min_ready=3, batch_window=30.0))
    assert agent.calls[0] == [0, 1, 2]  # every unfinished episode ready: no need to wait out the window


def test_a_failed_request_ends_only_its_own_episode(env) -> None:
    records = play(env, Talker(), DelayedUser({0: 0.0, 1: 0.2, 2: 0.0}, errors=frozenset({1})))
    assert records[1].termination == USER_ERROR and records[1].user_error == "the endpoint failed"
    assert [len(r.turns) for r in records] == [3, 0, 3] and records[0].user_error is None


def test_an_interrupt_cancels_the_requests_in_flight(env) -> None:
    user = DelayedUser({0: 0.0, 1: 0.0, 2: 30.0})
    with pytest.raises(KeyboardInterrupt):
        play(env, Talker(fail_at_call=2), user)
    pending = [f for f in user.futures if not f.done() or f.cancelled()]
    assert pending and all(f.cancelled() for f in pending)  # episode 2's greeting reply: cancelled, not left running
    for timer in user.timers:
        timer.cancel()


def test_a_bad_schedule_is_refused_naming_its_flag() -> None:
    from tau2_rl.configs import EnvArguments

    with pytest.raises(ValueError, match="--min_ready must be >= 1"):
        EnvArguments(min_ready=0).episode_schedule()
    with pytest.raises(ValueError, match="--batch_window must be >= 0"):
        EnvArguments(batch_window=-1.0).episode_schedule()
    assert EnvArguments().episode_schedule() == Schedule()
    with pytest.raises(ValueError, match="schedule mode must be one of events, waves"):
        Schedule(mode="asap")  # type: ignore[arg-type]


# -- the LLM user against the stub server: the same transcripts in both schedules, and nothing left behind --------


@pytest.fixture
def stub_server():
    from openai_stub_server import StubServer

    servers = []

    def start(mode: str = "echo", **kwargs):
        server = StubServer(mode, **kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_the_policy_plays_the_same_episodes_in_both_schedules_against_reply_delays(
    tiny_model, tiny_tokenizer, short_env, stub_server
) -> None:
    """The tiny policy (sampling, per-episode seeds, the evaluator's shared-prefix engine with turn caching) against
    the LLM user behind the stub with seeded log-normal delays: events and waves give the same token ids, messages
    and rewards, and the event-driven calls carry fewer episodes than the waves'."""
    from tau2_rl.backends.shared_prefix import SharedPrefixTransformersBackend
    from tau2_rl.envs.users.llm import LLMUser
    from tau2_rl.rollout import TokenPolicyAgent

    env = short_env(max_turns=4)
    tok = tiny_tokenizer
    eos = tok.eos_token_id
    forced = {"forced_eos_token_id": eos}  # every turn is 8 tokens: no episode ends early
    server = stub_server("echo", latency=(0.05, 1.0))
    user = LLMUser(base_url=server.base_url, model=server.model, timeout=30.0)
    specs = [(str(t), 10 + t) for t in range(6)]
    runs = {}
    try:
        for mode in ("waves", "events"):
            backend = SharedPrefixTransformersBackend(tiny_model, tok, temperature=1.0, eos_token_ids=[eos],
                                                      min_prefix_tokens=16, generation_kwargs=forced)  # fmt: skip
            agent = TokenPolicyAgent(backend, tok, [eos], 4096, 8, per_episode_seeds=True)
            episodes = [env.reset(t, s) for t, s in specs]
            timings = RunTimings()
            records = run_episodes(env, agent, user, specs, episodes=episodes, timings=timings, score=outcome_reward,
                                   schedule=Schedule(mode=mode))  # fmt: skip
            runs[mode] = ([ep.agent_state["completion_ids"] for ep in episodes], [r.messages for r in records],
                          [r.reward for r in records], timings.waves)  # fmt: skip
            assert all(r.user_error is None and len(r.turns) == 4 for r in records)
            assert timings.max_in_flight >= 2 and backend.turn_cache_stats["reused_tokens"] > 0
            backend.close()
    finally:
        user.close()
    assert runs["events"][:3] == runs["waves"][:3]
    assert runs["waves"][3] == 4 and runs["events"][3] > 4  # smaller calls, as the replies land


def test_ctrl_c_with_requests_in_flight_leaves_no_thread_socket_or_loop(env, stub_server) -> None:
    """A Ctrl-C while the loop waits on a user that hangs: KeyboardInterrupt within a second, the request cancelled,
    and once the simulator is closed no loop thread, no socket and no open event loop remain."""
    import signal

    import psutil

    from tau2_rl.envs.users.llm import LLMUser

    server = stub_server("hang", hang_s=60.0)
    user = LLMUser(base_url=server.base_url, model=server.model, timeout=60.0, max_retries=0)
    main = threading.main_thread().ident

    def ctrl_c_once_the_request_hangs() -> None:
        # Timed from the request's arrival, not from the test's start: on a loaded machine a fixed 1 s could land
        # before the loop is waiting on the user at all (CI saw the episode end as a user error after 3 minutes).
        deadline = time.monotonic() + 30.0
        while server.requests == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        signal.pthread_kill(main, signal.SIGINT)  # a Ctrl-C

    # Python's own Ctrl-C handler for the test: under pytest -n 2 an earlier test on this worker may have left a
    # trainer's graceful-stop handler installed (tau2_rl/run/stop.py turns a first SIGINT into a flag), and then
    # the signal never raised here (f34312e's fresh-clone CI: the episode waited out the stub's 60 s instead).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt = threading.Thread(target=ctrl_c_once_the_request_hangs, daemon=True)
    interrupt.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            play(env, Talker(), user)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 30.0  # the stub would answer after 60 s: the loop stopped at the signal
    runtime = user._runtime
    assert runtime is not None
    user.close()
    assert runtime.loop.is_closed() and not runtime.thread.is_alive()  # the simulator's loop and its thread

    def to_the_stub() -> list:  # this process's sockets connected to the stub (other tests' threads may come and go)
        return [c for c in psutil.Process().net_connections(kind="tcp") if c.raddr and c.raddr.port == server.port]

    for _ in range(50):
        if not to_the_stub():
            break
        time.sleep(0.1)
    assert not to_the_stub()


def test_a_policy_that_samples_per_call_is_said_once_to_depend_on_the_schedule(env, caplog) -> None:
    """TRL's generate on vLLM server mode or PEFT draws from one generator per call: with a user that answers later
    the loop says once that transcripts depend on the schedule; with the scripted user or under waves, nothing."""
    import logging

    from tau2_rl.envs import runner

    class PerCall(Talker):
        schedule_invariant = False
        schedule_reason = "the policy samples per call (test)"

    runner._SAID.discard(PerCall.schedule_reason)
    with caplog.at_level(logging.INFO, logger="tau2_rl.envs.runner"):
        play(env, PerCall(), get_user_simulator("scripted"))
        play(env, PerCall(), DelayedUser({0: 0.0, 1: 0.0, 2: 0.0}), Schedule(mode="waves"))
        assert not [r for r in caplog.records if "depends on which episodes share" in r.message]
        for _ in range(2):
            play(env, PerCall(), DelayedUser({0: 0.0, 1: 0.0, 2: 0.0}))
    said = [r.message for r in caplog.records if "depends on which episodes share" in r.message]
    assert len(said) == 1 and "the policy samples per call (test)" in said[0] and "delayed user" in said[0]
