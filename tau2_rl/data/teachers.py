"""Teacher agents for trajectory collection: ``oracle`` (gold actions, offline), ``noop`` (declines every request,
offline: a deliberately bad teacher, for mixed-quality warm-up data such as the embedded default policy's) and
``openai`` (any OpenAI-compatible chat endpoint, e.g. vLLM serving Qwen2.5-72B-Instruct-AWQ).

Both are ``Agent``s of ``tau2_rl.envs.runner.run_episodes`` (the one episode loop): a batch of live episodes in,
one assistant turn of text per episode out. The environment parses that text (Hermes ``<tool_call>`` blocks), so a
teacher's tool calls reach the episode exactly as a policy model's would.

``OpenAITeacher`` sends the episode's messages in OpenAI chat format (``tool_calls`` with ids and JSON-string
arguments, ``tool`` messages with the matching ``tool_call_id``) together with the tool schemas, and turns the reply
(structured ``tool_calls`` when the server parses them, e.g. ``vllm serve ... --enable-auto-tool-choice
--tool-call-parser hermes``; raw ``<tool_call>`` text otherwise) into Hermes text. Requests of a wave run concurrently
on the event-loop thread of the LLM user simulator (``tau2_rl.envs.users.llm._LoopRuntime``: one ``AsyncOpenAI``
client, a semaphore capping requests in flight), each bounded by a timeout and retried with exponential backoff. An
episode whose requests keep failing ends at once as ``agent_error`` (``AgentTurn.error``, also kept in
``episode.agent_state["teacher_error"]``); the collector does not count it as an attempt and evaluate.py leaves it out
of pass^k, so a rerun retries it.

The same class is evaluate.py's served agent (``--model openai:<name>``): there it gets the protocol's tool schemas
(τ²'s under ``tau2``), temperature 0 and τ²'s per-trial request seed (``seed_of``), as τ²'s harness sends them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import openai

from tau2_rl.envs.agents import get_agent
from tau2_rl.envs.protocol import agent_view
from tau2_rl.envs.runner import AgentTurn
from tau2_rl.envs.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedToolCall,
    ParsedTurn,
    format_tool_call,
)
from tau2_rl.envs.users.llm import (
    MAX_BACKOFF_S,
    NON_RETRYABLE_STATUS,
    EndpointUnreachableError,
    _LoopRuntime,
    _Stats,
    check_openai_endpoint,
)

if TYPE_CHECKING:
    from tau2_rl.envs.episode import Episode
    from tau2_rl.envs.runner import Agent

logger = logging.getLogger(__name__)

TEACHERS = ("oracle", "noop", "openai")


@dataclass
class OpenAITeacherConfig:
    """The teacher endpoint, its sampling and how requests are sent."""

    base_url: str = ""
    model: str = ""
    api_key: str = "EMPTY"
    temperature: float = 0.7
    top_p: float | None = 1.0
    max_tokens: int | None = 1024  # None (and top_p None): not sent, as τ²'s harness sends neither
    seed: int = 0
    timeout: float = 120.0
    max_retries: int = 3
    backoff: float = 1.0
    concurrency: int = 64

    def validate(self) -> None:
        """Raises a ValueError naming the flag of the first unusable setting."""
        if not self.base_url.strip():
            raise ValueError(
                "--teacher openai needs an endpoint: set --teacher_base_url to an OpenAI-compatible URL such as "
                "http://localhost:8000/v1"
            )
        if not self.model.strip():
            raise ValueError(
                "--teacher openai needs a model name: set --teacher_model to the model served at "
                f"{self.base_url} (e.g. Qwen/Qwen2.5-72B-Instruct-AWQ)"
            )
        checks = [
            (self.timeout > 0, "--teacher_timeout must be > 0 seconds"),
            (self.max_retries >= 0, "--teacher_max_retries must be >= 0"),
            (self.backoff >= 0, "--teacher_backoff must be >= 0 seconds"),
            (self.concurrency >= 1, "--teacher_concurrency must be >= 1"),
            (self.max_tokens is None or self.max_tokens >= 1, "--teacher_max_tokens must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Invalid teacher setting: {message}")


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The episode's messages in OpenAI chat format.

    Assistant ``tool_calls`` get ids (``call_<message>_<k>``) and JSON-string arguments; each following ``tool``
    message answers the next id. A tool message with no call to answer (the result of a malformed ``<tool_call>``
    block, which the environment keeps as raw assistant text) is shown as a user message, so the request stays valid.
    """
    converted: list[dict[str, Any]] = []
    pending: list[str] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            calls = message.get("tool_calls") or []
            pending = [f"call_{index}_{k}" for k in range(len(calls))]
            content = message.get("content") or ("" if not calls else None)
            entry: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                entry["tool_calls"] = [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": call["function"]["name"],
                            "arguments": json.dumps(call["function"].get("arguments") or {}),
                        },
                    }
                    for call_id, call in zip(pending, calls, strict=True)
                ]
            converted.append(entry)
        elif role == "tool":
            if pending:
                converted.append({"role": "tool", "tool_call_id": pending.pop(0), "content": message.get("content")})
            else:
                converted.append({"role": "user", "content": f"[tool {message.get('name')}] {message.get('content')}"})
        else:
            converted.append({"role": role, "content": message.get("content") or ""})
    return converted


def reply_text(message: Any) -> str:
    """Hermes text of a chat-completion message: its content, then one ``<tool_call>`` block per structured call.

    Arguments that are not a JSON object are written out as they came, so the environment records the malformed
    call (and the collector drops the episode) instead of this function guessing.
    """
    return hermes_text(api_turn(message))


def hermes_text(turn: ParsedTurn) -> str:
    """``api_turn``'s turn as Hermes text (what ``reply_text`` returns)."""
    blocks = [
        format_tool_call(call.name, call.arguments)
        if call.parse_error is None
        else f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(call.name)}, "arguments": {call.raw}}}\n{TOOL_CALL_CLOSE}'
        for call in turn.tool_calls
    ]
    return "\n".join(part for part in [turn.text.strip(), *blocks] if part)


def api_turn(message: Any) -> ParsedTurn:
    """A chat-completion message as the environment's turn, as τ²'s harness takes it from litellm: the content
    exactly as sent (None as ""), and the structured calls with their JSON arguments decoded. A call whose
    arguments are not a JSON object, or that has no name, is kept as malformed (τ²'s ``generate`` would raise)."""
    calls = []
    for call in getattr(message, "tool_calls", None) or []:
        function = getattr(call, "function", None)
        name = getattr(function, "name", None) or ""
        raw = getattr(function, "arguments", None)
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError as err:
            calls.append(
                ParsedToolCall(name, raw=str(raw), parse_error=f"Tool call arguments are not valid JSON: {err}")
            )
            continue
        if not isinstance(arguments, dict) or not name:
            error = "Tool call has no 'name' string" if not name else "Tool call 'arguments' must be a JSON object"
            calls.append(ParsedToolCall(name, raw=str(raw), parse_error=error))
            continue
        calls.append(ParsedToolCall(name, arguments=arguments, raw=str(raw)))
    content = getattr(message, "content", None)
    return ParsedTurn(text=content if isinstance(content, str) else "", tool_calls=calls)


class _TeacherError(Exception):
    pass


PROBE_SYSTEM = "You are a customer service agent. Use the tools to look up the customer before you answer."
PROBE_USER = "Hi, my user id is mia_li_3668. What is my membership level? Look me up with get_user_details."


class OpenAITeacher:
    """A teacher played by an OpenAI-compatible endpoint (see the module docstring)."""

    name = "openai"

    def __init__(
        self,
        config: OpenAITeacherConfig | None = None,
        seed_of: Callable[[Episode], int] | None = None,
        flags: tuple[str, str, str] = ("--teacher_base_url", "--teacher_api_key", "--teacher_model"),
        **overrides: Any,
    ):
        """``seed_of`` gives an episode's request seed (default: ``config.seed`` + the episode's seed); ``flags``
        names the (URL, key, model) options in endpoint errors."""
        if config is None:
            valid = {f.name for f in fields(OpenAITeacherConfig)}
            unknown = sorted(set(overrides) - valid)
            if unknown:
                raise TypeError(f"Unknown OpenAITeacher settings {unknown}; valid: {', '.join(sorted(valid))}")
            config = OpenAITeacherConfig(**overrides)
        elif overrides:
            config = replace(config, **overrides)
        config.validate()
        self.config = config
        self.seed_of = seed_of or (lambda episode: config.seed + episode.seed)
        self.flags = flags
        self._latency = _Stats()
        sampling = {"temperature": config.temperature, "top_p": config.top_p, "max_tokens": config.max_tokens}
        self._sampling = {key: value for key, value in sampling.items() if value is not None}
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "replies": 0, "retries": 0, "failures": 0, "prompt_tokens": 0}
        self.counts["completion_tokens"] = 0
        self._runtime: _LoopRuntime | None = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------------------------------- Agent protocol

    def act(self, episodes: list[Episode]) -> list[AgentTurn]:
        if not episodes:
            return []
        runtime = self._ensure_runtime()
        requests = [(openai_messages(agent_view(e.messages)), e.tools, self.seed_of(e), f"{e.task.task_id}:{e.seed}")
                    for e in episodes]  # fmt: skip
        answers = runtime.run(self._send_all(runtime, requests))
        turns = []
        for episode, answer in zip(episodes, answers, strict=True):
            if isinstance(answer, _TeacherError):
                episode.agent_state["teacher_error"] = str(answer)
                turns.append(AgentTurn(text="", error=str(answer)))  # ends the episode; a rerun retries it
            else:
                text, message = answer
                turns.append(AgentTurn(text=text, api_message=message))
        return turns

    # ------------------------------------------------------------------------------------------- endpoint

    def check_endpoint(self, timeout: float = 5.0) -> list[str]:
        """GETs ``<base_url>/models``; a clear error names the URL when it is unreachable or lacks the model."""
        return check_openai_endpoint(
            self.config.base_url,
            self.config.api_key,
            self.config.model,
            timeout,
            who=self.name,
            flags=self.flags,
            serve_hint=f"vllm serve {self.config.model} --enable-auto-tool-choice --tool-call-parser hermes",
        )

    def check_tool_calls(self, tools: list[dict[str, Any]], timeout: float = 30.0) -> None:
        """One probe request that a chat model with native tool calls answers with a call; raises ValueError (one
        line) when the endpoint refuses tools (vLLM without ``--enable-auto-tool-choice``), returns the call as raw
        text (no tool-call parser) or returns text only. Not counted in ``stats``."""
        config = self.config
        hint = (f"serve it with native tool calls, e.g. `vllm serve {config.model} --enable-auto-tool-choice "
                "--tool-call-parser hermes` (or python -m scripts.serve_policy_vllm --tool-calls)")  # fmt: skip
        client = openai.OpenAI(base_url=config.base_url, api_key=config.api_key, timeout=timeout, max_retries=0)
        try:
            response = client.chat.completions.create(
                model=config.model,
                messages=[
                    {"role": "system", "content": PROBE_SYSTEM},
                    {"role": "user", "content": PROBE_USER},
                ],
                tools=tools,
                tool_choice="auto",
                temperature=0.0,
                max_tokens=min(config.max_tokens or 256, 256),
            )
        except openai.APIStatusError as err:
            raise ValueError(
                f"The {self.name} endpoint {config.base_url} refused a request with tools (HTTP {err.status_code}: "
                f"{str(err.message)[:160]}); {hint}"
            ) from None
        except (openai.APIConnectionError, openai.APITimeoutError) as err:
            raise EndpointUnreachableError(
                f"The {self.name} endpoint {config.base_url} did not answer a tool-call probe ({err}); "
                f"fix {self.flags[0]}"
            ) from None
        finally:
            client.close()
        choices = getattr(response, "choices", None) or []
        message = choices[0].message if choices else None
        if message is not None and getattr(message, "tool_calls", None):
            return
        content = (getattr(message, "content", None) or "").strip()
        if TOOL_CALL_OPEN in content:
            why = "wrote the tool call as text (the server has no tool-call parser, or it could not read the call)"
        else:
            why = f"answered with text only ({content[:60]!r})"
        raise ValueError(
            f"The {self.name} endpoint {config.base_url} returned no tool calls to a probe that needs one: it {why}; "
            f"{hint}. --agent_tool_probe false skips this check"
        )

    def stats(self) -> dict[str, Any]:
        """Requests, replies, retries, failures, tokens and the latency (mean, p50/p90/p99 seconds) of requests."""
        with self._lock:
            latency = {k: v for k, v in self._latency.summary().items() if k.startswith("latency")}
            return {**self.counts, **{k: round(float(v), 4) for k, v in latency.items()}}

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._runtime = self._finalizer = None

    def __enter__(self) -> OpenAITeacher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- internals

    def _count(self, **counts: int) -> None:
        with self._lock:
            for key, value in counts.items():
                self.counts[key] += value

    def _ensure_runtime(self) -> _LoopRuntime:
        with self._lock:
            if self._runtime is None or self._runtime.loop.is_closed():
                self._runtime = _LoopRuntime(self.config)  # reads base_url, api_key, timeout, concurrency
                self._finalizer = weakref.finalize(self, self._runtime.close)
            return self._runtime

    def backoff_delay(self, key: str, retry: int) -> float:
        """Exponential backoff with a deterministic jitter in [0.5, 1) of the step (as the LLM user simulator)."""
        jitter = int.from_bytes(hashlib.sha256(f"{key}:{retry}".encode()).digest()[:8], "big") / 2**64
        return min(MAX_BACKOFF_S, self.config.backoff * 2 ** (retry - 1) * (0.5 + 0.5 * jitter))

    async def _send_all(self, runtime: _LoopRuntime, requests: list[tuple[list, list, int, str]]) -> list:
        return list(await asyncio.gather(*(self._send(runtime, *request) for request in requests)))

    async def _send(
        self, runtime: _LoopRuntime, messages: list[dict], tools: list[dict], seed: int, key: str
    ) -> tuple[str, ParsedTurn] | _TeacherError:
        """``tools``: the episode's schemas (its domain's, as the protocol shows them)."""
        """One assistant turn (its Hermes text, and the message as the API sent it) with retries; never raises, so
        one episode's failure cannot touch the others."""
        assert runtime.client is not None and runtime.semaphore is not None
        config = self.config
        last_error = "no attempt made"
        attempt = 0
        for attempt in range(config.max_retries + 1):
            if attempt:
                self._count(retries=1)
                await asyncio.sleep(self.backoff_delay(f"{key}:{len(messages)}", attempt))
            async with runtime.semaphore:
                self._count(requests=1)
                start = time.perf_counter()
                try:
                    response = await asyncio.wait_for(
                        runtime.client.chat.completions.create(
                            model=config.model,
                            messages=messages,
                            tools=tools,
                            tool_choice="auto",
                            seed=seed,
                            **self._sampling,
                        ),
                        timeout=config.timeout,
                    )
                except (asyncio.TimeoutError, TimeoutError, openai.APITimeoutError):
                    last_error = f"request timed out after {config.timeout:g}s"
                    continue
                except openai.APIStatusError as err:
                    last_error = f"HTTP {err.status_code}: {err.message}"
                    if err.status_code in NON_RETRYABLE_STATUS:
                        break
                    continue
                except Exception as err:  # connection errors, malformed responses: this episode's problem only
                    last_error = f"{type(err).__name__}: {err}"
                    continue
                finally:
                    with self._lock:
                        self._latency.add_latency(time.perf_counter() - start)
            choices = getattr(response, "choices", None) or []
            turn = api_turn(choices[0].message) if choices else ParsedTurn(text="", tool_calls=[])
            text = hermes_text(turn)  # empty: τ²'s generate retries too
            if not text:
                last_error = "the endpoint returned an empty reply"
                continue
            usage = getattr(response, "usage", None)
            self._count(
                replies=1,
                prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
            )
            return text, turn
        self._count(failures=1)
        message = f"{self.name} {config.model} at {config.base_url} failed after {attempt + 1} attempt(s): "
        message += last_error
        logger.warning("%s", message)
        return _TeacherError(message)


def get_teacher(name: str, **kwargs: Any) -> Agent:
    """A teacher by name: ``oracle`` / ``noop`` (no settings) or ``openai`` (``OpenAITeacherConfig`` fields as
    keywords)."""
    if name in ("oracle", "noop"):
        return get_agent(name)
    if name == "openai":
        return OpenAITeacher(**kwargs)
    raise ValueError(f"Unknown teacher {name!r} (--teacher); valid teachers: {', '.join(TEACHERS)}")
