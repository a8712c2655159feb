"""A tiny OpenAI-compatible chat server on 127.0.0.1 for tests and benchmarks of the LLM user simulator.

It is a real HTTP server on a real socket (``ThreadingHTTPServer`` in a background thread), so the tests exercise the
``openai`` client, connection handling, timeouts and concurrency exactly as against vLLM. It serves
``GET /v1/models`` and ``POST /v1/chat/completions`` (non-streaming) and behaves according to a mode:

- ``echo``: a deterministic reply that quotes the newest message (the agent's text, role ``user`` here);
- ``stop``: like ``echo``, but replies ``###STOP###`` once the conversation holds ``stop_after`` earlier replies
  (``stop_after_by_text`` overrides it for conversations containing a given text, e.g. one task's user id);
- ``error``: HTTP 500 on every request (``error_by_text``: only on conversations containing a given text);
- ``hang``: sleeps ``hang_s`` (longer than any client timeout) before answering;
- ``slow``: answers like ``echo`` after ``delay_s``;
- ``empty``: a well-formed response whose message content is empty.

Agent modes (the stub plays the agent; replies are a function of the conversation, with native ``tool_calls`` as
``vllm serve --enable-auto-tool-choice --tool-call-parser hermes`` returns them):

- ``agent_text``: only ever answers in text;
- ``agent_lookup``: once the user has named a user id, looks it up (``get_user_details``, with the text "Let me
  look you up.\n" beside the call), then answers in text with the name it found; asks for the user id before;
- ``agent_write``: as ``agent_lookup``, then makes a write no task wants, then text: the airline's
  ``send_certificate`` of 50, or, when the request offers retail's tools, ``modify_user_address`` to ``WRITE_ADDRESS``;
- ``agent_noparser``: writes its calls as raw ``<tool_call>`` text, as a server without a tool-call parser.

Judge modes (the stub plays τ²'s NL-assertion judge, ``tau2_rl.rewards.judge``): ``judge`` reads the conversation and
the ``expectedOutcomes`` list out of τ²'s user prompt and returns τ²'s JSON, an assertion met when at least half of its
words of five or more letters occur in the conversation (a deterministic function of what it was asked, so two
harnesses asking the same thing get the same verdicts); ``judge_garbage`` answers text that is not JSON;
``judge_no_results`` answers ``{}``, ``judge_short`` one verdict fewer than the assertions.

Every agent mode but ``agent_noparser`` answers evaluate.py's tool-call probe with a call. User mode
``user_scenario`` answers from the scenario in its system prompt: it names the user id found there, then thanks the
agent quoting the start of its message, then ends (``###STOP###``) after ``stop_after`` replies. User mode
``user_device`` holds tools (telecom's phone, offered in the request): it runs on its phone the tool the agent names,
says what the phone showed, and ends after ``stop_after`` replies of text (``user_device_reply``).

``latency=(median, sigma)`` (``--latency MEDIAN,SIGMA``) delays every answer by a log-normal time, median ×
exp(sigma × z), with z drawn from a generator seeded by ``latency_seed`` and the request's messages: the same request
waits as long whatever the order or the concurrency it arrives in, as a user server's reply time follows what it is
asked, and two ways of scheduling the same episodes can be compared against the same latencies.

A request may pick its own mode with a marker ``[[stub:<mode>]]`` anywhere in its messages (the newest marker wins),
so one batch can mix good and bad episodes. The server counts requests and the most requests in flight at once.

By hand, to try the LLM user simulator without a GPU (Ctrl-C stops it):

    python tests/openai_stub_server.py --mode stop --stop_after 2 --port 8001
    python evaluate.py --model oracle --tasks 0,1 --num_samples 1 --user_simulator llm \
        --user_base_url http://127.0.0.1:8001/v1 --user_model stub-model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

AGENT_MODES = ("agent_text", "agent_lookup", "agent_write", "agent_noparser")
JUDGE_MODES = ("judge", "judge_garbage", "judge_no_results", "judge_short")
MODES = ("echo", "stop", "error", "hang", "slow", "empty", *AGENT_MODES, "user_scenario", "user_device", *JUDGE_MODES)
PHONE = re.compile(r"\b\d{3}-\d{3}-\d{4}\b")
MARKER = re.compile(r"\[\[stub:([a-z_]+)\]\]")
USER_ID = re.compile(r"\b[a-z]+_[a-z]+_\d{3,5}\b")
PROBE_TEXT = "Look me up with get_user_details"  # tau2_rl.data.teachers.PROBE_USER ends so
STOP_REPLY = "Great, that is everything I needed. ###STOP###"
WRITE_ADDRESS = {"address1": "1 Stub Street", "address2": "Suite 0", "city": "Testville", "state": "CA",
                 "country": "USA", "zip": "00000"}  # fmt: skip
"""Where ``agent_write`` moves a retail user: an address no task asks for."""


def marker(mode: str) -> str:
    """The text that makes the stub answer a request in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"unknown stub mode {mode!r}; valid modes: {', '.join(MODES)}")
    return f"[[stub:{mode}]]"


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hanging handler must not keep the test process alive
    block_on_close = False
    request_queue_size = 256  # the default backlog (5) drops SYNs when 64 clients connect at once
    stub: StubServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like vLLM, so the client reuses connections
    disable_nagle_algorithm = True  # headers and body go out as two writes: Nagle + delayed ACK would add ~40 ms
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class names it so
        """Silences the per-request access log."""

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stopped(self) -> bool:
        """After ``stop()`` a kept-alive connection is dropped without an answer, as a dead server's would be."""
        if self.server.stub._stopping.is_set():
            self.close_connection = True
            return True
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self._stopped():
            return
        if self.path.rstrip("/") == "/v1/models":
            model = {"id": self.server.stub.model, "object": "model", "created": 0, "owned_by": "stub"}
            self._send_json(200, {"object": "list", "data": [model]})
        else:
            self._send_json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self._stopped():
            return
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._send_json(404, {"error": {"message": f"no route {self.path}"}})
            return
        stub = self.server.stub
        stub.authorizations.append(self.headers.get("Authorization") or "")
        stub._enter(body)
        start = time.monotonic()
        mode = stub._mode_of(body.get("messages") or [])
        try:
            status, payload = stub._answer(mode, body)
        finally:
            # Recorded before the answer goes out: once the client holds its reply, the test may read the timeline.
            stub._leave(mode, start)
        try:
            self._send_json(status, payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout): nothing to send
            pass


class StubServer:
    """An OpenAI-compatible chat server on a free port of 127.0.0.1; use as a context manager or start()/stop()."""

    def __init__(
        self,
        mode: str = "echo",
        *,
        stop_after: int = 2,
        stop_after_by_text: dict[str, int] | None = None,
        error_by_text: tuple[str, ...] = (),
        delay_s: float = 0.2,
        hang_s: float = 30.0,
        model: str = "stub-model",
        port: int = 0,
        latency: tuple[float, float] | None = None,
        latency_seed: int = 0,
    ) -> None:
        marker(mode)  # validates the mode
        if latency is not None and (latency[0] <= 0 or latency[1] < 0):
            raise ValueError(f"latency: a median > 0 and a sigma >= 0, got {latency}")
        self.latency = latency
        self.latency_seed = latency_seed
        self.requested_port = port  # 0: a free port
        self.mode = mode
        self.stop_after = stop_after
        self.stop_after_by_text = dict(stop_after_by_text or {})
        self.error_by_text = tuple(error_by_text)  # conversations containing one of these texts get HTTP 500
        self.delay_s = delay_s
        self.hang_s = hang_s
        self.model = model
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []
        self.authorizations: list[str] = []  # the Authorization header of every chat request
        self.timeline: list[tuple[str, float, float]] = []
        """(mode, start, end) of every answered request, in ``time.monotonic`` seconds."""
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._port: int | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port it serves (or served, once stopped: a test may name the dead endpoint)."""
        if self._port is None:
            raise RuntimeError("the stub server is not started")
        return self._port

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (with ``/v1``), as a client would be configured against vLLM."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> StubServer:
        self._stopping.clear()
        self._server = _Server(("127.0.0.1", self.requested_port), _Handler)
        self._server.stub = self
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="openai-stub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and wakes any hanging handler, so the test ends promptly."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset_counters(self) -> None:
        with self._lock:
            self.requests = 0
            self.max_in_flight = 0
            self.bodies.clear()
            self.timeline.clear()

    def _enter(self, body: dict[str, Any]) -> None:
        with self._lock:
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.bodies.append(body)

    def _leave(self, mode: str, start: float) -> None:
        with self._lock:
            self.in_flight -= 1
            self.timeline.append((mode, start, time.monotonic()))

    def _mode_of(self, messages: list[dict[str, Any]]) -> str:
        if self.error_by_text:
            text = " ".join(str(message.get("content") or "") for message in messages)
            if any(needle in text for needle in self.error_by_text):
                return "error"
        found = [m for message in messages for m in MARKER.findall(str(message.get("content") or ""))]
        return found[-1] if found and found[-1] in MODES else self.mode

    def _stop_after(self, messages: list[dict[str, Any]]) -> int:
        text = " ".join(str(message.get("content") or "") for message in messages)
        return next((n for needle, n in self.stop_after_by_text.items() if needle in text), self.stop_after)

    def latency_of(self, body: dict[str, Any]) -> float:
        """The seconds this request waits before its answer (0 without ``latency``): a function of its messages."""
        if self.latency is None:
            return 0.0
        median, sigma = self.latency
        text = json.dumps([self.latency_seed, body.get("messages") or []], sort_keys=True)
        z = random.Random(hashlib.sha256(text.encode()).digest()).gauss(0.0, 1.0)
        return median * math.exp(sigma * z)

    def _answer(self, mode: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        messages = body.get("messages") or []
        if self.latency is not None:
            self._stopping.wait(self.latency_of(body))
        if mode == "error":
            return 500, {"error": {"message": "stub server error", "type": "internal_error", "code": 500}}
        if mode == "hang":
            self._stopping.wait(self.hang_s)
        elif mode == "slow":
            time.sleep(self.delay_s)
        earlier_replies = sum(message.get("role") == "assistant" for message in messages)
        newest = str(messages[-1].get("content") or "") if messages else ""
        if mode in AGENT_MODES:
            offered = {str((tool.get("function") or {}).get("name")) for tool in body.get("tools") or []}
            return 200, self._completion(body, *agent_reply(mode, messages, offered))
        if mode == "user_scenario":
            return 200, self._completion(body, user_scenario_reply(messages, self._stop_after(messages)), [])
        if mode == "user_device":
            offered = {str((tool.get("function") or {}).get("name")) for tool in body.get("tools") or []}
            return 200, self._completion(body, *user_device_reply(messages, offered, self._stop_after(messages)))
        if mode == "judge":
            return 200, self._completion(body, judge_reply(messages), [])
        if mode == "judge_garbage":
            return 200, self._completion(body, "I think the agent did fine.", [])
        if mode == "judge_no_results":  # valid JSON, no verdict at all: τ² would score the term as met
            return 200, self._completion(body, "{}", [])
        if mode == "judge_short":  # one verdict fewer than the assertions asked
            results = json.loads(judge_reply(messages))["results"][:-1]
            return 200, self._completion(body, json.dumps({"results": results}), [])
        if mode == "empty":
            content = ""
        elif mode == "stop" and earlier_replies >= self._stop_after(messages):
            content = STOP_REPLY
        else:
            content = f"[reply {earlier_replies + 1} seed={body.get('seed')}] You said: {newest[:80]}"
        return 200, self._completion(body, content, [])

    def _completion(self, body: dict[str, Any], content: str | None, calls: list[tuple[str, dict]]) -> dict[str, Any]:
        """A chat completion with ``content`` and native tool calls (ids ``call_<messages>_<k>``)."""
        messages = body.get("messages") or []
        prompt_tokens = sum(len(str(message.get("content") or "").split()) for message in messages)
        completion_tokens = len((content or "").split()) + 8 * len(calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{len(messages)}_{k}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}
                for k, (name, arguments) in enumerate(calls)
            ]  # fmt: skip
        return {
            "id": f"chatcmpl-stub-{self.requests}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }


def _tool_results(messages: list[dict[str, Any]]) -> list[str]:
    return [str(m.get("content") or "") for m in messages if m.get("role") == "tool"]


def agent_reply(
    mode: str, messages: list[dict[str, Any]], offered: set[str] = frozenset()
) -> tuple[str | None, list[tuple[str, dict]]]:
    """(text, tool calls) of an agent mode: a function of the conversation and of the tools the request offers
    (``offered``: their names; retail's ``modify_user_address`` picks retail's write)."""
    newest = messages[-1] if messages else {}
    said = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
    found = USER_ID.findall(said)
    results = _tool_results(messages)
    turn = sum(m.get("role") == "assistant" for m in messages)
    probe = newest.get("role") == "user" and PROBE_TEXT in str(newest.get("content") or "")
    if mode == "agent_noparser":
        call = {"name": "get_user_details", "arguments": {"user_id": found[-1] if found else "x"}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>", []
    if probe:
        return None, [("get_user_details", {"user_id": found[-1]})]
    if mode == "agent_text":
        return f"I am sorry, I cannot help with that request (reply {turn}).", []
    if "get_customer_by_phone" in offered:  # telecom: look the line up, then ask the user to act on the phone
        return _telecom_agent_reply(mode, said, results)
    if not found:
        return "Could you please tell me your user id?", []
    user_id = found[-1]
    if not results:  # text next to the call, ending in a newline, as Qwen2.5 writes it before <tool_call>
        return "Let me look you up.\n", [("get_user_details", {"user_id": user_id})]
    if mode == "agent_write" and len(results) == 1:
        if "modify_user_address" in offered:
            return None, [("modify_user_address", {"user_id": user_id, **WRITE_ADDRESS})]
        return None, [("send_certificate", {"user_id": user_id, "amount": 50})]
    try:
        profile = json.loads(results[0])
        name = f"{profile['name']['first_name']} {profile['name']['last_name']}"
    except (ValueError, KeyError, TypeError):
        name = "there"
    return f"Thank you, {name}. I found your profile ({len(results)} lookups).", []


def _telecom_agent_reply(mode: str, said: str, results: list[str]) -> tuple[str | None, list[tuple[str, dict]]]:
    phones = PHONE.findall(said)
    if not phones:
        return "Could you please tell me the phone number of your line?", []
    if not results:
        return "Let me look up your line.\n", [("get_customer_by_phone", {"phone_number": phones[-1]})]
    if mode == "agent_write" and "toggle_airplane_mode" not in said and "airplane" not in said.lower():
        return "Please run toggle_airplane_mode on your phone and tell me what it shows.", []
    return "Thank you. Please run check_status_bar and tell me whether you have signal now.", []


def user_device_reply(
    messages: list[dict[str, Any]], offered: set[str], stop_after: int
) -> tuple[str | None, list[tuple[str, dict]]]:
    """The ``user_device`` user, who holds tools (telecom's phone): names the phone number its scenario gives, runs
    on its phone whatever offered tool the agent's newest message names (``check_status_bar`` when it names none,
    once), says what the phone showed, and ends after ``stop_after`` replies of text."""
    system = str(messages[0].get("content") or "") if messages and messages[0].get("role") == "system" else ""
    newest = messages[-1] if messages else {}
    said = sum(m.get("role") == "assistant" and not m.get("tool_calls") for m in messages)
    if newest.get("role") == "tool":
        return f"My phone shows: {str(newest.get('content') or '')[:60]}", []
    if said >= stop_after:
        return STOP_REPLY, []
    if said == 0:
        phones = PHONE.findall(system)
        return (f"Hi, my phone has a problem. My phone number is {phones[0]}." if phones else "Hi, I need help."), []
    asked = str(newest.get("content") or "")
    named = [name for name in sorted(offered) if name in asked]
    if named:
        return None, [(named[0], {})]
    if offered and not any(m.get("tool_calls") for m in messages if m.get("role") == "assistant"):
        return "Let me look.", [("check_status_bar", {})]  # text beside the calls: τ² delivers it to nobody
    return f"Okay. You said: {asked[:40]}", []


def user_scenario_reply(messages: list[dict[str, Any]], stop_after: int) -> str:
    """The ``user_scenario`` user: names the scenario's user id, then thanks the agent, then stops."""
    system = str(messages[0].get("content") or "") if messages and messages[0].get("role") == "system" else ""
    found = USER_ID.findall(system)
    replies = sum(m.get("role") == "assistant" for m in messages)
    if replies >= stop_after:
        return STOP_REPLY
    if replies == 0:
        return f"Hi, I need help. My user id is {found[0]}." if found else "Hi, I need help with my reservation."
    agent_said = str(messages[-1].get("content") or "")
    return f"Thanks. You said: {agent_said[:40]}"


def judge_reply(messages: list[dict[str, Any]]) -> str:
    """τ²'s judge JSON for the assertions of the (last) user prompt: met when at least half of an assertion's words
    of five or more letters occur in the conversation."""
    import ast

    prompt = str(messages[-1].get("content") or "") if messages else ""
    conversation, _, outcomes = prompt.partition("expectedOutcomes:")
    assertions = ast.literal_eval(outcomes.strip()) if outcomes.strip() else []
    seen = conversation.lower()
    results = []
    for assertion in assertions:
        words = re.findall(r"[a-z]{5,}", assertion.lower())
        met = bool(words) and sum(w in seen for w in words) * 2 >= len(words)
        results.append({"expectedOutcome": assertion, "reasoning": f"{len(words)} words", "metExpectation": met})
    return json.dumps({"results": results})


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Serves until Ctrl-C (or SIGTERM), printing the base URL to pass as ``--user_base_url``."""
    parser = argparse.ArgumentParser(description="A local OpenAI-compatible stub for the LLM user simulator.")
    parser.add_argument("--mode", choices=MODES, default="stop", help="how it answers (see the module docstring)")
    parser.add_argument("--stop_after", type=int, default=2, help="stop mode: replies before ###STOP###")
    parser.add_argument("--port", type=int, default=8001, help="port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--model", default="stub-model", help="the model id it serves (pass it as --user_model)")
    parser.add_argument("--latency", default=None, metavar="MEDIAN,SIGMA",
                        help="delay each answer by a log-normal time (seconds; seeded per request)")  # fmt: skip
    parser.add_argument("--latency_seed", type=int, default=0, help="seed of the per-request delays")
    args = parser.parse_args(argv)
    latency = None
    if args.latency:
        try:
            median, sigma = (float(v) for v in args.latency.split(","))
        except ValueError:
            parser.error(f"--latency: MEDIAN,SIGMA (two numbers), got {args.latency!r}")
        if median <= 0 or sigma < 0:
            parser.error(f"--latency: a median > 0 and a sigma >= 0, got {args.latency!r}")
        latency = (median, sigma)
    try:
        server = StubServer(args.mode, stop_after=args.stop_after, model=args.model, port=args.port, latency=latency,
                            latency_seed=args.latency_seed).start()  # fmt: skip
    except OSError as err:
        parser.exit(2, f"{parser.prog}: error: --port {args.port}: {err.strerror or err}\n")
    print(f"serving {args.model!r} in mode {args.mode!r} at {server.base_url} (Ctrl-C stops)", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
