"""Importing real agent conversations (OpenAI chat format) so PRM-Lite can score them as it scores our own episodes.

A conversation recorded elsewhere in that format (τ-bench's historical trajectories: a JSON list of
``{"task_id", "trial", "reward", "traj": [OpenAI messages]}``) is *replayed*: every assistant tool call runs through
our environment on a fresh database under the τ² task the source task maps to, so the rules read our own
observations, exactly as during training. The recorded ``reward`` is the label; the recorded task details (``info``:
gold actions, outputs) are never read.

τ²'s own results files (``tau2 run``'s JSON: tasks, both sides' messages, τ²'s rewards) are read by
``tau2_rl.data.tau2_results`` instead, which replays a task's initial state and the user's own tool calls; this
importer refuses a domain whose user holds tools and a task with an initial state (the chat format carries neither).

How it departs from a plain copy:

1. v1's ``think`` tool has no τ² counterpart: its calls and their tool messages are dropped (counted per
   conversation); an assistant message that only thought disappears.
2. The tool messages are ours (replayed), not the recorded ones; ``observation_mismatches`` counts those that say
   something else (``same_observation``: JSON compared on the fields both print).
3. A conversation that cannot be replayed (malformed, unknown task id, arguments that are not JSON) is not scored:
   it is listed in ``ImportReport.skipped`` with the file, the conversation index and the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tau2_rl.envs.episode import (
    AGENT_STOP,
    AGENT_STOP_TOKEN,
    USER_OUT_OF_SCOPE,
    USER_STOP,
    USER_TRANSFER,
    DomainEnv,
    EpisodeRecord,
    ToolCallRecord,
    TurnRecord,
)
from tau2_rl.envs.tool_calls import format_tool_call

DROPPED_TOOLS = frozenset({"think"})
"""Source tools without a τ² counterpart: v1's ``think`` (a scratchpad that changes nothing and returns nothing)."""

_USER_STOPS = (("###TRANSFER###", USER_TRANSFER), ("###OUT-OF-SCOPE###", USER_OUT_OF_SCOPE), ("###STOP###", USER_STOP))


class ConversationFileError(ValueError):
    """A conversation or task-map file that cannot be read at all; the message names the file and the field."""


class ConversationError(ValueError):
    """One conversation that cannot be replayed; the message names the file, the conversation index and the field."""


@dataclass
class ImportedConversation:
    """A replayed conversation: the record PRM-Lite scores and the recorded label."""

    index: int  # position in the source file
    source_task: str  # the task id in the source benchmark (v1)
    task_id: str  # the τ² task it was replayed under
    trial: int | None
    reward: float  # the recorded reward: the label
    record: EpisodeRecord
    dropped_calls: int = 0  # think calls removed
    observation_mismatches: int = 0  # replayed tool results that say something else than the recorded ones

    @property
    def success(self) -> bool:
        return self.reward >= 1.0


@dataclass
class ImportReport:
    """What an import produced: the replayed conversations and, one line each, the ones it could not replay."""

    path: str
    conversations: list[ImportedConversation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # τ² task id -> the task map's ``gold_writes`` note ("identical_writes": τ² expects the writes the source task
    # did, so the recorded label is the one τ² would give); empty when the map has no notes
    label_notes: dict[str, str] = field(default_factory=dict)

    @property
    def dropped_calls(self) -> int:
        return sum(c.dropped_calls for c in self.conversations)

    @property
    def tool_calls(self) -> int:
        return sum(len(c.record.tool_calls) for c in self.conversations)

    @property
    def observation_mismatches(self) -> int:
        return sum(c.observation_mismatches for c in self.conversations)


def _read_json(path: str | Path, flag: str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ConversationFileError(f"{flag}: no such file {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConversationFileError(f"{flag}: {path} is not valid JSON ({err})") from None


def load_label_notes(path: str | Path) -> dict[str, str]:
    """τ² task id → the ``gold_writes`` note of its task-map entry, where entries carry one."""
    raw = _read_json(path, "--task_map")
    notes: dict[str, str] = {}
    for target in raw.values() if isinstance(raw, dict) else []:
        if isinstance(target, dict) and isinstance(target.get("gold_writes"), str) and target.get("tau2_task"):
            notes[str(target["tau2_task"])] = target["gold_writes"]
    return notes


def load_task_map(path: str | Path) -> dict[str, str]:
    """Source task id → τ² task id, from ``{"<id>": {"tau2_task": "<id>", ...}}`` or ``{"<id>": "<id>"}``."""
    raw = _read_json(path, "--task_map")
    if not isinstance(raw, dict):
        raise ConversationFileError(f"--task_map: {path} must be a JSON object of source task id -> τ² task")
    mapping: dict[str, str] = {}
    for source, target in raw.items():
        value = target.get("tau2_task") if isinstance(target, dict) else target
        if value is None:
            continue  # a source task without a τ² counterpart: its conversations are reported as skipped
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConversationFileError(
                f"--task_map: {path}: entry {source!r} field 'tau2_task' must be a task id string, got {value!r}"
            )
        mapping[str(source)] = str(value)
    return mapping


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError as err:
            raise ConversationError(f"{where}: arguments are not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ConversationError(f"{where}: arguments must be a JSON object, got {type(raw).__name__}")
    return raw


def _common(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_common(a[key], b[key]) for key in a.keys() & b.keys())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_common(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def same_observation(recorded: str, replayed: str) -> bool:
    """Whether a recorded tool result says what ours says: equal text, or JSON equal on the keys both have (v1 and
    τ² print records with different key orders and a few renamed or added fields, e.g. ``province``/``state``)."""
    if recorded.strip().lower() == replayed.strip().lower():  # v1 capitalises its error messages differently
        return True
    try:
        return _common(json.loads(recorded), json.loads(replayed))
    except ValueError:
        return False


def _termination(last_user: str, last_agent: str) -> str | None:
    for token, termination in _USER_STOPS:
        if token in last_user:
            return termination
    return AGENT_STOP if AGENT_STOP_TOKEN in last_agent else None


def replay_conversation(
    env: DomainEnv, task_id: str, messages: Sequence[Any], where: str
) -> tuple[EpisodeRecord, int, int]:
    """Replays ``messages`` (OpenAI chat format) under ``task_id``: (record, dropped calls, observation mismatches).

    ``where`` prefixes every error ("FILE: conversation 3"); field paths follow it ("traj[5].tool_calls[0]")."""
    record = EpisodeRecord(task_id=task_id, seed=0)
    record.messages.append({"role": "system", "content": env.system_prompt})
    state = env.base.new_state()
    write_tools = env.spec.write_tools()
    dropped = mismatches = 0
    last_user = last_agent = ""
    # the recorded results of the calls we replayed, in order; v1 may reuse an id, so pair by position
    pending: list[tuple[str, str]] = []  # (name, replayed result) awaiting the recorded tool message
    for position, message in enumerate(messages):
        at = f"{where}: traj[{position}]"
        if not isinstance(message, Mapping):
            raise ConversationError(f"{at}: a message must be an object, got {type(message).__name__}")
        role = message.get("role")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ConversationError(f"{at}.content: must be a string or null, got {type(content).__name__}")
        text = (content or "").strip()
        if role == "system":
            continue  # our own policy prompt stands in for the source's
        if role == "user":
            record.messages.append({"role": "user", "content": text})
            last_user = text
        elif role == "tool":
            name = message.get("name")
            if name in DROPPED_TOOLS:
                continue
            if not pending:
                raise ConversationError(f"{at}: a tool message with no assistant tool call before it")
            expected_name, replayed = pending.pop(0)
            if name is not None and name != expected_name:
                raise ConversationError(f"{at}.name: {name!r} answers a call of {expected_name!r}")
            mismatches += not same_observation(text, replayed)
        elif role == "assistant":
            raw_calls = message.get("tool_calls") or []
            if not isinstance(raw_calls, list):
                raise ConversationError(f"{at}.tool_calls: must be a list, got {type(raw_calls).__name__}")
            calls: list[tuple[str, dict[str, Any]]] = []
            for k, raw in enumerate(raw_calls):
                call_at = f"{at}.tool_calls[{k}]"
                function = raw.get("function") if isinstance(raw, Mapping) else None
                name = function.get("name") if isinstance(function, Mapping) else None
                if not isinstance(name, str) or not name:
                    raise ConversationError(f"{call_at}.function.name: expected a tool name string")
                if name in DROPPED_TOOLS:
                    dropped += 1
                    continue
                calls.append((name, _arguments(function.get("arguments", {}), f"{call_at}.function.arguments")))
            if not calls and not text:
                continue  # only thought: nothing the user or the database saw
            turn = TurnRecord(
                index=len(record.turns),
                raw_text="\n".join([text, *(format_tool_call(name, args) for name, args in calls)]).strip(),
                message=text.replace(AGENT_STOP_TOKEN, "").strip(),
                last_user_message=last_user,
            )
            record.turns.append(turn)
            assistant: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                assistant["tool_calls"] = [
                    {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls
                ]
            record.messages.append(assistant)
            last_agent = text or last_agent
            for name, args in calls:
                outcome = env.spec.execute_tool(state, name, args)
                record.tool_calls.append(
                    ToolCallRecord(
                        turn=turn.index,
                        name=name,
                        arguments=args,
                        result=outcome.content,
                        error=outcome.error,
                        error_kind=outcome.error_kind,
                        is_write=name in write_tools,
                    )
                )
                turn.tool_call_indices.append(len(record.tool_calls) - 1)
                record.messages.append({"role": "tool", "name": name, "content": outcome.content})
                pending.append((name, outcome.content))
        else:
            raise ConversationError(f"{at}.role: expected system, user, assistant or tool, got {role!r}")
    record.termination = _termination(last_user, last_agent)
    return record, dropped, mismatches


def import_conversations(path: str | Path, task_map: str | Path | Mapping[str, str], env: DomainEnv) -> ImportReport:
    """Replays every conversation of ``path`` under its mapped τ² task of ``env``'s domain; unreplayable ones go to
    ``skipped``."""
    if env.spec.user_tool_types is not None:  # its user acts on its own tools: the chat format has no place for that
        raise ConversationFileError(
            f"--trajectories {path}: the {env.spec.name} domain's user holds tools of its own, whose calls the chat "
            "format cannot carry; pass the τ² results files the conversations came from (tau2 run's JSON)"
        )
    mapping = load_task_map(task_map) if isinstance(task_map, (str, Path)) else dict(task_map)
    raw = _read_json(path, "--trajectories")
    if not isinstance(raw, list):
        raise ConversationFileError(f"--trajectories: {path} must be a JSON list of conversations")
    report = ImportReport(path=str(path))
    unknown: list[str] = []  # conversations mapped to a task the domain does not have: the wrong domain or map
    if isinstance(task_map, (str, Path)):
        report.label_notes = load_label_notes(task_map)
    for index, item in enumerate(raw):
        where = f"{path}: conversation {index}"
        try:
            if not isinstance(item, Mapping):
                raise ConversationError(f"{where}: must be an object, got {type(item).__name__}")
            for key in ("task_id", "reward", "traj"):
                if key not in item:
                    raise ConversationError(f"{where}: missing field {key!r}")
            reward = item["reward"]
            if not isinstance(reward, (int, float)) or isinstance(reward, bool):
                raise ConversationError(f"{where}.reward: expected a number, got {reward!r}")
            source = str(item["task_id"])
            if source not in mapping:
                raise ConversationError(f"{where}.task_id: {source!r} is not in the task map")
            task_id = mapping[source]
            if task_id not in env.domain.tasks:
                unknown.append(f"{source!r} → {task_id!r}")
                continue
            if env.domain.tasks[task_id].initial_state.features():
                raise ConversationError(f"{where}: task {task_id} starts from an initial state (initialization data, "
                                        "actions or a message history) the chat format does not replay; pass the "
                                        "τ² results files")  # fmt: skip
            if not isinstance(item["traj"], list):
                raise ConversationError(f"{where}.traj: expected a list of messages")
            record, dropped, mismatches = replay_conversation(env, task_id, item["traj"], where)
        except ConversationError as err:
            report.skipped.append(str(err))
            continue
        record.reward = {"reward": float(reward), "source": "recorded"}
        trial = item.get("trial")
        report.conversations.append(
            ImportedConversation(
                index=index,
                source_task=source,
                task_id=task_id,
                trial=trial if isinstance(trial, int) else None,
                reward=float(reward),
                record=record,
                dropped_calls=dropped,
                observation_mismatches=mismatches,
            )
        )
    check_domain_match(report, unknown, env, path)
    return report


MISMATCH_LIMIT = 0.5
"""More than this share of replayed tool observations differing from the recorded ones means the conversations were
not held against this domain's database (the airline's own real set, τ-bench v1's conversations on τ²'s data,
differs on 54 of 563: a changed airport list's shape and one reservation)."""


def check_domain_match(report: ImportReport, unknown: list[str], env: DomainEnv, path: str | Path) -> None:
    """Refuses conversations that are not of ``env``'s domain, with the counts: a task id the domain does not have
    (any), or replays that disagree with what was recorded on most observations. A figure computed on them would be
    another domain's tasks scored under this one's."""
    domain = env.spec.name
    if unknown:
        total = len(unknown) + len(report.conversations) + len(report.skipped)
        raise ConversationFileError(
            f"--trajectories {path}: {len(unknown)} of {total} conversations map to tasks the {domain} domain does "
            f"not have ({', '.join(unknown[:3])}"
            f"{' …' if len(unknown) > 3 else ''}): another domain's conversations, or the wrong --task_map "
            f"(--domain {domain})"
        )
    calls = sum(len(c.record.tool_calls) for c in report.conversations)
    mismatched = sum(c.observation_mismatches for c in report.conversations)
    if calls and mismatched > MISMATCH_LIMIT * calls:
        raise ConversationFileError(
            f"--trajectories {path}: {mismatched} of the {calls} replayed tool observations differ from the recorded "
            f"ones: these conversations were not held against the {domain} domain's database (--domain {domain})"
        )
