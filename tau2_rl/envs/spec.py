"""``DomainSpec``: everything one τ² domain brings, in one object; the rest of the project takes it and never asks
which domain it runs.

The episode loop, the protocol, rendering, the trainer, pass^k, the results and the hub read a domain through this
object (or the task and episode that carry it). A domain lives in one folder, ``tau2_rl/domains/<name>/``, whose
``SPEC`` fills every field below, and one line of the registry (``tau2_rl.domains.DOMAINS``). The fields are the
checklist for a new domain, in the order a domain is built:

1. **Files**: the installed package and directory its τ² files ship in (by default db.json, tasks.json, policy.md,
   split_tasks.json; a domain may read others: a TOML database, a user's database, a policy in two files), and
   which τ²-bench release they are.
2. **Data**: τ²'s database model, each table's record model, the fields every record must have.
3. **Tools**: ``execute_tool`` (one agent call on an episode's copy-on-write state, answered as τ²'s
   ``Environment.get_response``), each tool's type (read / write / generic), the tools that end a conversation, and
   the schemas the project's own protocol shows (``None``: τ²'s own schemas of ``tau2.domains.<tau2_name>``).
4. **Conversation**: the business the project protocol's first line names, the one-line compact prompt, and the
   offline parties' lines (``Dialogue``: the oracle's questions and confirmations, the scripted user's answers).
5. **Splits**: the domain's committed split file (train / test and the covered tasks: the generalization groups)
   and its default split's name.
6. **Process reward**: PRM-Lite's terms (``prm_terms``: tool-description examples, the record whose cancelled status
   makes a write dead, the id prefix, and the policy rules that are this domain's alone, or none).
7. **Training defaults**: the embedded default policy's warm-up mix and the ablation profiles' task picks.

Callables are looked up lazily (τ²'s modules import litellm, ~5 s). A spec pickles as a reference to its module
(``module``), so a rollout worker process gets the same object back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pydantic import BaseModel

# The spec is the bottom of the package: it imports no module of the project (they import it), so the types of the
# callables a domain gives are named in their docstrings: ``Task`` (tau2_rl.envs.data), ``EpisodeState``
# (tau2_rl.envs.state), ``ToolResult`` (tau2_rl.envs.toolkit).


@dataclass(frozen=True)
class TaskSet:
    """Another release of a domain's four files, installed as a package (``--task_set``)."""

    package: str
    package_path: str
    release: str
    requirement: str
    """What to ``pip install`` for it (README, and the error when it is missing)."""
    missing_tools: frozenset[str] = frozenset()
    """Tools of that release the domain's toolkit lacks: its files load, and a task whose gold calls one is refused
    at start (its agent would lack a tool τ² offers), never scored."""


@dataclass(frozen=True)
class SplitRecipe:
    """How ``tau2_rl.data.make_splits`` draws a domain's split file from τ²'s official train / test split."""

    covered: int
    """How many official train tasks get teacher trajectories (the covered group), drawn stratified by write /
    no-write gold actions."""
    seed_test: int | None = None
    """With a number: a ``seed`` split too, whose test set is that many official test tasks (the rest train)."""
    order_salt: str = ""
    """Within a stratum tasks are drawn in the order of ``sha256("<salt>:<task id>")``."""


class Dialogue(Protocol):
    """What the offline scripted parties say in a domain (the rest of both is domain-neutral)."""

    IDENTIFIERS: str
    """The identifying details a customer of the domain is asked for ("user id, reservation number"): the examples the
    LLM user's project-protocol prompt lists."""

    def opening_question(self, task: Any) -> str:
        """The oracle's first message: the identification its gold look-ups need, and the ids the user knows."""
        ...

    def describe_action(self, name: str, arguments: dict[str, Any]) -> str:
        """A write in plain words, for the confirmation question the policy requires ("cancel reservation X")."""
        ...

    def identity(self, task: Any) -> Any:
        """What the scripted user can say to be identified, parsed once per task from its scenario."""
        ...

    def identity_answer(self, identity: Any, text: str) -> str:
        """The identification the agent's ``text`` asks for, or "" when it asks for none."""
        ...


@dataclass(frozen=True, eq=False)
class DomainSpec:
    """One τ² domain (see the module docstring for what each group of fields is for). Compared and hashed by
    identity: each domain's spec is one object per process."""

    name: str
    """The domain's name (``--domain``), as τ² names it."""
    module: str
    """The module whose ``SPEC`` this is (``tau2_rl.domains.<name>``): how a spec pickles."""
    release: str
    """Which τ²-bench release the default files are (README: per domain, which tasks a score is on)."""
    package: str
    """The installed package whose data directory holds the domain's default files."""
    package_path: str
    """The files' directory inside ``package`` (τ²'s layout: ``data/tau2/domains/<name>``)."""
    models: Callable[[], Mapping[str, type[BaseModel]]]
    """Each database table's record model (τ²'s data model), in the database's table order."""
    required_fields: Mapping[str, tuple[str, ...]]
    """Per table, the fields every record must have: a clear error before τ²'s model validates the rest."""
    db_model: Callable[[], type[BaseModel]]
    """τ²'s model of the whole database: db.json is validated by it and kept as its ``model_dump`` (plain dicts: the
    field order and nulls τ² shows and hashes)."""
    execute_tool: Callable[[Any, str, Any], Any]
    """One agent call (``EpisodeState``, tool name, arguments) → its ``ToolResult``, as τ²'s
    ``Environment.get_response`` answers it."""
    tool_types: Callable[[], Mapping[str, str]]
    """Every agent tool's name → ``read``, ``write`` or ``generic`` (τ²'s ``ToolType``), in τ²'s order."""
    business: str
    """What the project protocol's first line calls the business ("an airline")."""
    compact_prompt: str
    """The one-line system prompt of the embedded default (``tau2_rl.envs.prompt_style``)."""
    dialogue: Dialogue
    """The offline parties' lines (``Dialogue``)."""
    split_file: Callable[[], str]
    """The path of the domain's committed split file (``tau2_rl.envs.splits``; made by ``tau2_rl.data.make_splits
    --domain <name>``)."""
    default_split: str
    """The split ``--split`` means when not given."""
    split_recipe: SplitRecipe
    """How its split file is drawn from τ²'s official split (``tau2_rl.data.make_splits``)."""
    prm_terms: Callable[[], Any]
    """PRM-Lite's terms of the domain (``tau2_rl.rewards.prm.vocabulary.PrmTerms``)."""
    warmup_teachers: Mapping[str, int]
    """The embedded default policy's warm-up data: teacher → copies of its dialogues."""
    profile_tasks: Mapping[str, Mapping[str, str]]
    """Ablation profile → stage kind (collect, grpo, eval) → its ``--tasks`` (empty: the split's tasks)."""
    default_task_set: str = ""
    """The name of the release the default package's files are (``--task_set`` with it keeps the default)."""
    task_sets: Mapping[str, TaskSet] = field(default_factory=dict)
    """Other releases of its files, by name (``--task_set 1.0.1``: τ²-bench 1.0.1's retail); the default is the
    package above."""
    own_tool_schemas: Callable[[], list[dict[str, Any]]] | None = None
    """The schemas the project's own protocol (``tau2_rl``) shows; ``None``: τ²'s own, as under ``tau2``."""
    terminal_tools: frozenset[str] = frozenset({"transfer_to_human_agents"})
    """Tools that end the conversation in effect (the user answers the transfer)."""
    tau2_name: str = ""
    """The domain's name in τ²'s package (``tau2.domains.<tau2_name>``); default ``name``."""
    files: tuple[str, ...] = ("db.json", "tasks.json", "policy.md", "split_tasks.json")
    """The files the domain reads from its directory (all must be there; τ²'s layout)."""
    db_file: str = "db.json"
    """The agent's database file among ``files`` (JSON, or TOML as τ²'s ``load_file`` reads it)."""
    user_db_file: str | None = None
    """The user's database file, for a domain whose user holds tools (validated by ``user_db_model``)."""
    user_db_model: Callable[[], type[BaseModel]] | None = None
    policy_files: tuple[str, ...] = ("policy.md",)
    """The policy's files among ``files``; with ``compose_policy``, what joins their texts (τ²'s own composition)."""
    compose_policy: Callable[[list[str]], str] | None = None
    task_split: str | None = None
    """τ²'s split whose tasks the domain plays (telecom ships 2,285 tasks and scores its ``base`` 114); ``None``:
    every task of tasks.json."""
    user_tool_types: Callable[[], Mapping[str, str]] | None = None
    """The user's tools → their type, for a domain whose user holds tools (a gold action of the user names one)."""
    environment: Callable[[Any, Any, str], Any] | None = None
    """For a domain whose episodes run in τ²'s own ``Environment`` (``tau2_rl.envs.world``): (agent database,
    user database or None, policy) → a τ² ``Environment`` on them. ``None``: the copy-on-write state
    (``tau2_rl.envs.state``) and ``execute_tool``."""
    variant_of: str = ""
    """The domain this one is under another policy (τ²'s ``telecom-workflow``: telecom's tasks, tools and data, the
    workflow policy), whose folder holds it; "" for a domain of its own. Listings of what differs by domain (PRM-Lite's
    policy checks) give the variant under its domain."""
    unnamed_before_domains: bool = False
    """The domain of everything written before the project recorded domains: a results file, a fingerprint, a cache
    entry or a model card without a domain means this one, and its runs' fingerprints and cache names stay as they
    were (no domain in them). Exactly one domain has it (``tau2_rl.domains.legacy_domain``)."""

    @property
    def tau2_domain(self) -> str:
        """The domain's folder in τ²'s package and data (``tau2.domains.<it>``, ``data/tau2/domains/<it>``); its
        name in τ²'s registry (``tau2 run --domain``) is ``name``."""
        return self.tau2_name or self.variant_of or self.name

    def task_set_dir(self, name: str) -> str:
        """The installed directory of the task set ``name`` (``--task_set``); a name the domain does not have, or a
        package not installed, is a ValueError naming the flag and what to install."""
        from importlib import resources

        if name not in self.task_sets:
            known = ", ".join(self.task_sets) or "none"
            raise ValueError(f"--task_set {name!r}: the {self.name} domain has no such task set (its others: {known})")
        task_set = self.task_sets[name]
        try:
            root = resources.files(task_set.package).joinpath(task_set.package_path)
        except ModuleNotFoundError:
            raise ValueError(
                f"--task_set {name} needs the {self.name} files of {task_set.release}: pip install "
                f"{task_set.requirement}"
            ) from None
        return str(root)

    def task_set_of(self, data_dir: str | None) -> TaskSet | None:
        """The installed task set whose directory ``data_dir`` is, if any."""
        for name, task_set in self.task_sets.items():
            try:
                if data_dir is not None and str(self.task_set_dir(name)) == str(data_dir):
                    return task_set
            except ValueError:
                continue
        return None

    def release_of(self, data_dir: str | None) -> str:
        """Which release the files a run reads are: the default package's, an installed task set's, or a
        directory's own (``--data_dir``)."""
        if data_dir is None:
            return self.release
        task_set = self.task_set_of(data_dir)
        return task_set.release if task_set is not None else f"the files of {data_dir}"

    def write_tools(self) -> frozenset[str]:
        return frozenset(name for name, kind in self.tool_types().items() if kind == "write")

    def user_write_tools(self) -> frozenset[str]:
        types = self.user_tool_types() if self.user_tool_types is not None else {}
        return frozenset(name for name, kind in types.items() if kind == "write")

    def read_tools(self) -> frozenset[str]:
        return frozenset(name for name, kind in self.tool_types().items() if kind == "read")

    def __reduce__(self) -> tuple[Callable[[str], DomainSpec], tuple[str]]:
        return (spec_of_module, (self.module,))

    def __repr__(self) -> str:
        return f"DomainSpec({self.name!r})"


def spec_of_module(module: str) -> DomainSpec:
    """The ``SPEC`` of ``module`` (how a pickled spec comes back)."""
    return importlib.import_module(module).SPEC


def task_key(domain: str, task_id: str) -> str:
    """A task's id in a run over several domains: ``<domain>/<task id>`` (τ²'s ids hold no ``/``)."""
    return f"{domain}/{task_id}"


def split_task_key(key: str) -> tuple[str | None, str]:
    """(domain, task id) of a key of ``task_key``; (None, key) for a plain task id."""
    domain, sep, task_id = str(key).partition("/")
    return (domain, task_id) if sep else (None, str(key))
