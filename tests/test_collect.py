"""Teacher trajectories → HF dataset (``tau2_rl.data.collect``, ``collect_trajectories.py``), offline.

The oracle teacher plays against the scripted user; the ``openai`` teacher is tested against a real HTTP server on
127.0.0.1 that answers like an OpenAI endpoint with structured ``tool_calls`` and plays the oracle behind it, so the
whole path (request format, tool-call ids, reply → Hermes text → environment, retries, concurrency) is exercised.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import pytest
from transformers.utils.chat_template_utils import render_jinja_template
from trl import TrlParser

from tau2_rl.configs import CollectArguments
from tau2_rl.data.collect import (
    FEATURES,
    CollectError,
    attempt_path,
    collect,
    covered_tasks,
    decode_rows,
    load_trajectories,
    rows_to_dataset,
)
from tau2_rl.data.teachers import OpenAITeacher, api_turn, openai_messages, reply_text
from tau2_rl.data.tiny_model import qwen2_5_chat_template
from tau2_rl.domains import get_domain
from tau2_rl.envs.agents import OracleAgent, get_agent
from tau2_rl.envs.episode import DomainEnv
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.splits import get_split
from tau2_rl.envs.tool_calls import parse_assistant_text
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.envs.users.llm import EndpointUnreachableError
from tau2_rl.rewards.outcome import outcome_reward

AIRLINE = get_domain("airline")

REPO_ROOT = Path(__file__).resolve().parent.parent
TASKS = "1,27,49"  # covered tasks: two reads, one read, one read by reservation id


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(AIRLINE)


def make_args(tmp_path: Path, **overrides: Any) -> CollectArguments:
    settings = {"output_dir": str(tmp_path / "collect"), "hub_dir": str(tmp_path / "hub"), "progress": False}
    return CollectArguments(**{**settings, **overrides})


def render_text(messages: list[dict], tools: list[dict]) -> str:
    return render_jinja_template([messages], tools=tools, chat_template=qwen2_5_chat_template())[0][0]


# ------------------------------------------------------------------------------------------------ oracle teacher


def test_oracle_collects_the_covered_tasks_by_default(tmp_path: Path, env: DomainEnv) -> None:
    result = collect(make_args(tmp_path))
    split = get_split("seed", AIRLINE.split_file())
    assert result.tasks == list(split.covered) and result.covered_tasks == list(split.covered)
    assert result.counts == {"kept": len(split.covered)} and result.played == len(split.covered)
    dataset = load_trajectories(result.output_dir)
    assert dataset.features == FEATURES and covered_tasks(dataset) == list(split.covered)
    assert set(dataset["reward"]) == {1.0} and set(dataset["teacher"]) == {"oracle"}
    assert set(dataset["user_simulator"]) == {"scripted"} and dataset["seed"] == [0] * len(split.covered)
    info = json.loads((Path(result.output_dir) / "collect_info.json").read_text())
    assert info["covered_tasks"] == list(split.covered) and info["teacher"] == "oracle"
    # The local-hub export is the same dataset, loadable with plain `datasets`.
    hub = Path(result.hub_path)
    assert hub == tmp_path / "hub" / "datasets" / "collect" and (hub / "README.md").is_file()
    exported = datasets.load_dataset(str(hub), split="train")
    assert decode_rows(exported) == decode_rows(dataset)
    assert load_trajectories("collect", hub_dir=tmp_path / "hub").num_rows == dataset.num_rows


def test_round_trip_renders_identically(tmp_path: Path, env: DomainEnv) -> None:
    records = run_episodes(
        env,
        get_agent("oracle"),
        get_user_simulator("scripted"),
        [(t, 0) for t in TASKS.split(",")],
        score=outcome_reward,
    )
    result = collect(make_args(tmp_path, tasks=TASKS))
    rows = decode_rows(datasets.load_from_disk(result.dataset_dir))
    for record, row in zip(records, rows, strict=True):
        assert row["messages"] == record.messages and row["tools"] == env.tools
        assert render_text(row["messages"], row["tools"]) == render_text(record.messages, env.tools)
    # Plain Arrow structs would unify the tool-call arguments of all rows (null keys) and change the rendering.
    naive = datasets.Dataset.from_list([{"messages": record.messages} for record in records])
    naive_messages = naive[0]["messages"]
    assert naive_messages != records[0].messages
    assert render_text(naive_messages, env.tools) != render_text(records[0].messages, env.tools)


def test_json_column_keeps_floats_and_odd_text_exact() -> None:
    arguments = {"amount": 0.35, "ratio": 3.141592653589793, "big": 2**60, "note": 'é "q" / \u2028', "none": None}
    call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    row = {"task_id": "1", "attempt": 0, "seed": 0, "messages": messages, "tools": [], "reward": 1.0}
    (decoded,) = decode_rows(rows_to_dataset([row]))
    assert decoded["messages"] == messages
    assert json.dumps(decoded["messages"]) == json.dumps(messages)


def test_resume_skips_finished_attempts_and_never_loses_them(tmp_path: Path) -> None:
    first = collect(make_args(tmp_path, tasks=TASKS))
    files = {path: path.read_bytes() for path in (Path(first.output_dir) / "attempts").glob("*/*.json")}
    assert len(files) == 3

    class Counting(OracleAgent):
        calls = 0

        def act(self, episodes):
            Counting.calls += len(episodes)
            return super().act(episodes)

    again = collect(make_args(tmp_path, tasks=TASKS), teacher=Counting())
    assert again.played == 0 and again.skipped == 3 and Counting.calls == 0
    more = collect(make_args(tmp_path, tasks=TASKS, attempts=2), teacher=Counting())
    assert more.played == 3 and more.skipped == 3 and Counting.calls > 0
    assert all(path.read_bytes() == content for path, content in files.items())  # untouched
    dataset = load_trajectories(more.output_dir)
    assert sorted(zip(dataset["task_id"], dataset["attempt"], strict=True)) == sorted(
        (t, a) for t in TASKS.split(",") for a in (0, 1)
    )
    assert dataset["seed"] == [0, 1] * 3


def test_interrupted_run_keeps_finished_chunks(tmp_path: Path) -> None:
    class Crashing(OracleAgent):
        def act(self, episodes):
            if episodes[0].task.task_id == "49":  # the second chunk
                raise KeyboardInterrupt
            return super().act(episodes)

    args = make_args(tmp_path, tasks=TASKS, chunk_size=2)
    with pytest.raises(KeyboardInterrupt):
        collect(args, teacher=Crashing())
    assert (
        attempt_path(Path(args.output_dir), "1", 0).is_file()
        and attempt_path(Path(args.output_dir), "27", 0).is_file()
    )
    assert not attempt_path(Path(args.output_dir), "49", 0).exists()
    assert load_trajectories(args.output_dir)["task_id"] == ["1", "27"]  # the dataset of what finished
    result = collect(args)
    assert result.played == 1 and result.skipped == 2 and result.covered_tasks == ["1", "27", "49"]


def test_deduplicate_identical_conversations(tmp_path: Path) -> None:
    class SameSeed(OracleAgent):
        pass

    env_user = get_user_simulator("scripted")

    class FixedSeedUser:  # answers every attempt as attempt 0 would: identical conversations
        name = "scripted"

        def reply_batch(self, episodes):
            seeds = [e.seed for e in episodes]
            for e in episodes:
                e.seed = 0
            replies = env_user.reply_batch(episodes)
            for e, seed in zip(episodes, seeds, strict=True):
                e.seed = seed
            return replies

    result = collect(make_args(tmp_path, tasks="27", attempts=3), teacher=SameSeed(), user=FixedSeedUser())
    assert result.counts == {"kept": 1, "duplicate": 2}
    kept_all = collect(make_args(tmp_path, tasks="27", attempts=3, deduplicate=False))
    assert kept_all.counts == {"kept": 3}


def test_failed_and_malformed_episodes_are_not_kept(tmp_path: Path) -> None:
    class Malformed(OracleAgent):
        def act(self, episodes):
            return ['<tool_call>{"name": "get_user_details", "arguments": {bad json}</tool_call>' for _ in episodes]

    with pytest.raises(CollectError, match="no dataset was written"):
        collect(make_args(tmp_path, tasks="11"), teacher=get_agent("noop"))
    assert not (tmp_path / "collect" / "dataset").exists()  # no empty dataset left behind
    assert attempt_path(tmp_path / "collect", "11", 0).is_file()  # what was played is kept on disk anyway
    result = collect(make_args(tmp_path, tasks="0,11"), teacher=get_agent("noop"))
    assert result.counts == {"kept": 1, "reward_below_min": 1} and result.covered_tasks == ["0"]
    with pytest.raises(CollectError, match="malformed_tool_call"):
        collect(make_args(tmp_path, tasks="0", output_dir=str(tmp_path / "bad"), max_turns=2), teacher=Malformed())


def test_noop_teacher_by_name_keeps_its_failures_with_min_reward_0(tmp_path: Path) -> None:
    """``--teacher noop`` is the deliberately bad teacher of the mixed warm-up data (the default policy's)."""
    result = collect(make_args(tmp_path, tasks="3,40", teacher="noop", min_reward=0.0))
    dataset = load_trajectories(result.output_dir)
    assert result.covered_tasks == ["3", "40"] and set(dataset["teacher"]) == {"noop"}
    assert set(dataset["reward"]) == {0.0}  # both tasks need work: declining fails them
    for row in decode_rows(dataset):
        said = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert get_agent("noop").MESSAGE in said and not any("<tool_call>" in text for text in said)
    with pytest.raises(CollectError, match="no dataset was written"):  # the default min_reward keeps successes only
        collect(make_args(tmp_path, tasks="3", teacher="noop", output_dir=str(tmp_path / "strict")))


# ------------------------------------------------------------------------------------------------ bad input


def test_test_tasks_are_refused_without_the_force_flag(tmp_path: Path) -> None:
    test_task = get_split("seed", AIRLINE.split_file()).test[0]
    with pytest.raises(CollectError, match="--allow_test_tasks") as err:
        collect(make_args(tmp_path, tasks=f"1,{test_task}"))
    assert repr(test_task) in str(err.value)
    assert not (tmp_path / "collect" / "attempts").exists()
    result = collect(make_args(tmp_path, tasks=test_task, allow_test_tasks=True))
    assert result.covered_tasks == [test_task]


def test_bad_settings_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(CollectError, match="--tasks names unknown task ids"):
        collect(make_args(tmp_path, tasks="1,999"))
    with pytest.raises(CollectError, match="--attempts"):
        collect(make_args(tmp_path, attempts=0))
    collect(make_args(tmp_path, tasks="27"))
    with pytest.raises(CollectError, match="--seed was 0, now 5"):
        collect(make_args(tmp_path, tasks="27", seed=5))
    with pytest.raises(ValueError, match="--teacher_base_url"):
        collect(make_args(tmp_path, tasks="27", teacher="openai", output_dir=str(tmp_path / "o")))


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import collect_trajectories

    argv = ["--tasks", "27", "--output_dir", str(tmp_path / "c"), "--hub_dir", str(tmp_path / "hub"), "--progress",
            "false"]  # fmt: skip
    (args,) = TrlParser((CollectArguments,)).parse_args_and_config(args=argv)
    collect_trajectories.main(args)
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{\n") :])["covered_tasks"] == ["27"]


def test_command_line_parser_refuses_test_tasks(tmp_path: Path) -> None:
    import collect_trajectories

    test_task = get_split("seed", AIRLINE.split_file()).test[0]
    argv = ["--tasks", test_task, "--output_dir", str(tmp_path / "c"), "--hub_dir", str(tmp_path)]
    (args,) = TrlParser((CollectArguments,)).parse_args_and_config(args=argv)
    with pytest.raises(CollectError, match="--allow_test_tasks"):
        collect_trajectories.main(args)


# ------------------------------------------------------------------------------------------------ openai teacher


class OracleServer:
    """An OpenAI-compatible endpoint on 127.0.0.1 whose replies are the oracle's turns as structured tool calls.

    The task of a conversation is recognised by its first user message; ``fail_first`` requests of each conversation
    turn get HTTP 500 before the oracle is asked (so a retry gets the same turn).
    """

    def __init__(self, env: DomainEnv, tasks: list[str], fail_first: int = 0, always_fail: bool = False) -> None:
        self.env = env
        user = get_user_simulator("scripted")
        self.by_opening: dict[str, str] = {}
        for task_id in tasks:
            episode = env.reset(task_id, 0)
            self.by_opening[user.reply(episode).content] = task_id
        self.oracle = OracleAgent()
        self.shadows: dict[str, SimpleNamespace] = {}
        self.fail_first = fail_first
        self.always_fail = always_fail
        self.failures: dict[tuple[str, int], int] = {}
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, body: dict) -> tuple[int, dict]:
        messages = body["messages"]
        opening = next(m["content"] for m in messages if m["role"] == "user")
        key = (opening, len(messages))
        with self.lock:
            self.bodies.append(body)
            failed = self.failures.get(key, 0)
            if self.always_fail or failed < self.fail_first:
                self.failures[key] = failed + 1
                return 500, {"error": {"message": "stub failure", "type": "internal_error", "code": 500}}
            shadow = self.shadows.setdefault(
                opening, SimpleNamespace(task=self.env.domain.get_task(self.by_opening[opening]), agent_state={})
            )
            shadow.messages = messages
            text = self.oracle.act([shadow])[0]
        parsed = parse_assistant_text(text)
        calls = [
            {"id": f"call_{k}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for k, c in enumerate(parsed.tool_calls)
        ]
        message = {"role": "assistant", "content": parsed.text or None, **({"tool_calls": calls} if calls else {})}
        return 200, {
            "id": "chatcmpl-oracle",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._send(200, {"object": "list", "data": [{"id": "oracle-model", "object": "model"}]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                time.sleep(0.02)
                try:
                    answer = stub.answer(body)
                finally:  # before the reply goes out: the client may send its next request as soon as it has it
                    with stub.lock:
                        stub.in_flight -= 1
                self._send(*answer)

        return Handler


@pytest.fixture
def oracle_server(env: DomainEnv) -> Iterator[Callable[..., OracleServer]]:
    servers: list[OracleServer] = []

    def start(**kwargs: Any) -> OracleServer:
        server = OracleServer(env, TASKS.split(","), **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def openai_args(tmp_path: Path, server: OracleServer, **overrides: Any) -> CollectArguments:
    settings = {"teacher": "openai", "teacher_base_url": server.base_url, "teacher_model": "oracle-model",
                "teacher_backoff": 0.01, "teacher_timeout": 10.0, "tasks": TASKS}  # fmt: skip
    return make_args(tmp_path, **{**settings, **overrides})


def test_openai_teacher_collects_what_the_oracle_would(tmp_path: Path, env: DomainEnv, oracle_server) -> None:
    server = oracle_server()
    result = collect(openai_args(tmp_path, server, teacher_concurrency=2))
    assert result.counts == {"kept": 3} and result.covered_tasks == ["1", "27", "49"]
    oracle = collect(make_args(tmp_path, tasks=TASKS, output_dir=str(tmp_path / "oracle")))
    ours, theirs = decode_rows(load_trajectories(result.output_dir)), decode_rows(load_trajectories(oracle.output_dir))
    assert [r["messages"] for r in ours] == [r["messages"] for r in theirs]
    assert {(r["teacher"], r["teacher_model"]) for r in ours} == {("openai", "oracle-model")}
    assert 1 <= server.max_in_flight <= 2
    body = next(b for b in server.bodies if any(m["role"] == "tool" for m in b["messages"]))
    assert body["tools"] == env.tools and body["tool_choice"] == "auto" and body["model"] == "oracle-model"
    calls = [c["id"] for m in body["messages"] if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    answered = [m["tool_call_id"] for m in body["messages"] if m["role"] == "tool"]
    assert answered and answered == calls[: len(answered)]


def test_openai_teacher_retries_failed_requests(tmp_path: Path, oracle_server) -> None:
    server = oracle_server(fail_first=1)
    result = collect(openai_args(tmp_path, server, teacher_max_retries=2))
    assert result.counts == {"kept": 3} and result.unfinished == 0


def test_openai_teacher_failures_are_retried_on_the_next_run(tmp_path: Path, oracle_server) -> None:
    broken = oracle_server(always_fail=True)
    with pytest.raises(CollectError, match=r"3 of 3 attempts did not finish \(0 failed in the user simulator, 3 in"):
        collect(openai_args(tmp_path, broken, teacher_max_retries=1))
    assert not (tmp_path / "collect" / "attempts").exists()  # nothing finished, nothing recorded
    healthy = oracle_server()
    result = collect(openai_args(tmp_path, healthy))
    assert result.played == 3 and result.counts == {"kept": 3}


def test_unreachable_teacher_endpoint_fails_before_any_episode(tmp_path: Path) -> None:
    args = make_args(tmp_path, teacher="openai", teacher_base_url="http://127.0.0.1:9/v1", teacher_model="m")
    with pytest.raises(EndpointUnreachableError, match="--teacher_base_url"):
        collect(args)
    with pytest.raises(ValueError, match="--teacher_model"):
        OpenAITeacher(base_url="http://127.0.0.1:9/v1")


def test_openai_message_conversion() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}},
            {"type": "function", "function": {"name": "b", "arguments": {}}},
        ]},
        {"role": "tool", "name": "a", "content": "ra"},
        {"role": "tool", "name": "b", "content": "rb"},
        {"role": "assistant", "content": "<tool_call>{oops</tool_call>"},
        {"role": "tool", "name": "invalid_tool_call", "content": "Error: not JSON"},
    ]  # fmt: skip
    converted = openai_messages(messages)
    assert converted[3] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_3_0", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
            {"id": "call_3_1", "type": "function", "function": {"name": "b", "arguments": "{}"}},
        ],
    }
    assert [m.get("tool_call_id") for m in converted[4:6]] == ["call_3_0", "call_3_1"]
    assert converted[7] == {"role": "user", "content": "[tool invalid_tool_call] Error: not JSON"}


def test_reply_text_formats_structured_calls() -> None:
    def message(content, *calls):
        tool_calls = [SimpleNamespace(function=SimpleNamespace(name=n, arguments=a)) for n, a in calls]
        return SimpleNamespace(content=content, tool_calls=tool_calls)

    text = reply_text(message("Sure.", ("get_user_details", '{"user_id": "a_1"}')))
    assert text == 'Sure.\n<tool_call>\n{"name": "get_user_details", "arguments": {"user_id": "a_1"}}\n</tool_call>'
    parsed = parse_assistant_text(reply_text(message(None, ("f", "{not json"))))
    assert parsed.tool_calls[0].parse_error is not None  # recorded as a malformed call, never guessed
    # the same message as τ²'s harness takes it (tau2): content as sent, structured calls, nothing re-parsed
    turn = api_turn(message(" Sure.\n", ("get_user_details", '{"user_id": "a_1"}'), ("", "{}"), ("g", "[1]")))
    assert turn.text == " Sure.\n" and [c.name for c in turn.tool_calls] == ["get_user_details", "", "g"]
    assert turn.tool_calls[0].arguments == {"user_id": "a_1"} and turn.tool_calls[0].parse_error is None
    assert [c.parse_error is not None for c in turn.tool_calls] == [False, True, True]
    assert api_turn(message("<tool_call>\n{}\n</tool_call>")).tool_calls == []  # text stays text


def test_a_failing_user_endpoint_is_named_and_leaves_no_dataset(tmp_path: Path) -> None:
    """An LLM user whose endpoint answers ``GET /models`` but HTTP 500 to every chat request (the test stub):
    the message names the user simulator, and neither an empty dataset nor a hub dataset is left behind."""
    from openai_stub_server import StubServer

    with StubServer("error") as server:
        args = make_args(
            tmp_path, tasks="1,27", user_simulator="llm", user_base_url=server.base_url, user_model="stub-model",
            user_max_retries=0,
        )  # fmt: skip
        with pytest.raises(CollectError) as err:
            collect(args)
    message = str(err.value)
    assert "2 of 2 attempts did not finish (2 failed in the user simulator, 0 in the teacher" in message
    assert "HTTP 500" in message and server.base_url in message and "--min_reward" not in message
    assert not (tmp_path / "collect" / "dataset").exists()
    assert not list((tmp_path / "hub").glob("datasets/*"))


def test_an_empty_saved_dataset_is_one_clear_error(tmp_path: Path) -> None:
    rows_to_dataset([]).save_to_disk(str(tmp_path / "empty"))  # what an earlier version left behind
    with pytest.raises(CollectError, match=r"--dataset_path .*empty: the dataset is empty \(0 rows\)"):
        load_trajectories(tmp_path / "empty")
