"""What PRM-Lite's rules know of a domain: its tools' id arguments, look-ups, examples, read and terminal tools.

The rules are statements about a trajectory ("a failed call with an id nobody showed", "a write on a record the agent
fetched first"), not about one domain; what makes them a domain's rules is only which arguments are ids, which tools
fetch one record, which values the tool descriptions give as examples, and which records can be cancelled. A
``Vocabulary`` holds exactly that per domain, derived from the domain's tool schemas where it can be (one place; no
per-tool lists) and from the few terms its folder gives (``PrmTerms``: ``DomainSpec.prm_terms``).

What is not derivable is a domain's *policy*: v2's P9–P11, B8 and P7's exemption for justified refusals check writes
and refusals against the policy on the records the agent's tool results showed. A domain whose folder has such checks
(``DomainPolicy``: the airline's reservations, fares, bags and certificates) gets them; on a domain without
(``policy=None``) those rules never fire (docs/prm_lite.md says why, per domain).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tau2_rl.envs.episode import ToolCallRecord
    from tau2_rl.envs.spec import DomainSpec


class PolicyFacts(Protocol):
    """The records a domain policy's checks have seen so far in an episode, and what each side said."""

    user_said: list[str]
    agent_said: list[str]

    def observe(self, call: ToolCallRecord) -> None: ...


class DomainPolicy(Protocol):
    """A domain policy as checks on writes and refusals, judged only on the trajectory's own tool results (v2's
    P9–P11, B8, P7's exemption)."""

    violations: Mapping[str, str]
    """Each check's key → the policy sentence it enforces (P9's rationale lists them)."""

    def new_facts(self) -> PolicyFacts:
        """An empty record of what the episode showed (updated call by call: ``observe``)."""
        ...

    def write_violations(self, facts: Any, call: ToolCallRecord) -> list[str]:
        """The keys of the checks a successful write breaks (P9)."""
        ...

    def consent_issues(self, facts: Any, call: ToolCallRecord, quoted_in: str) -> list[str]:
        """``misquoted_charge`` (P10) / ``over_budget`` (P11): what the call's charge was not agreed to."""
        ...

    def justified_refusal(self, facts: Any, text: str) -> bool:
        """Whether a refusal is one the policy and the records back (B8, P7's exemption)."""
        ...

    def denies(self, text: str) -> bool:
        """Whether ``text`` refuses the request (B8)."""
        ...


@dataclass(frozen=True)
class PrmTerms:
    """What a domain's folder tells PRM-Lite (``DomainSpec.prm_terms``); the rest is derived from its tools."""

    examples: Sequence[str]
    """The example values of the tool descriptions: a model that copies them has looked nothing up (P1)."""
    record_id_field: str
    """The id field of the records whose latest status, "cancelled", makes a write on them dead (B6)."""
    id_prefix: str = ""
    """Leading characters of ids that are not part of a word token (retail's ``#W…`` order ids)."""
    policy: DomainPolicy | None = None
    """The domain policy's checks (v2's P9–P11, B8); ``None``: those rules are off on the domain."""
    real_set: tuple[str, str] | None = None
    """The domain's real calibration set in τ-bench v1's chat format, if it has one: (real agents' conversations,
    their task map: source task id → τ² task id), the report's v1 section (``python prm_report.py``)."""
    real_results: tuple[tuple[str, ...], str | None] | None = None
    """Real agents' τ² results files on the domain (paths) and the ``--task_set`` they were recorded on (None: the
    default): the per-domain table of docs/prm_lite.md (``python prm_report.py --update-docs``)."""


REAL_RESULTS_DIR = Path(__file__).resolve().parents[3] / "tests" / "data" / "tau2_results"
"""Real agents' τ² results files in the repository (its README: τ²'s gpt-4.1 and its SFT'd gpt-4.1, per domain)."""


def real_results_files(domain: str, agents: Sequence[str] = ("gpt-4.1", "ft-gpt-4.1")) -> tuple[str, ...]:
    """The paths of ``agents``' results files of ``domain`` in ``REAL_RESULTS_DIR`` (τ²'s file names)."""
    return tuple(str(REAL_RESULTS_DIR / f"{agent}_{domain}_default_gpt-4.1_1trials.json") for agent in agents)


def walk_properties(schema: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every (property name, property schema) of a JSON schema, nested objects and array items included."""
    for name, prop in schema.get("properties", {}).items():
        yield name, prop
        yield from walk_properties(prop)
    if "items" in schema:
        yield from walk_properties(schema["items"])


def is_id_name(name: str) -> bool:
    """An argument that names entities: ``*_id``, ``*_ids`` (retail's item lists) or a flight number."""
    return name.endswith("_id") or name.endswith("_ids") or name.endswith("flight_number")


@dataclass(frozen=True)
class Vocabulary:
    """One domain's terms for PRM-Lite (``vocabulary(spec)``)."""

    domain: str
    id_argument_names: frozenset[str]
    """Argument names whose values are entity ids, at any depth of a call's arguments."""
    lookup_tools: Mapping[str, str]
    """Read tools that fetch one record by its id (tool → id argument): what counts as verifying an entity (B6)."""
    example_values: frozenset[str]
    """Example values of the tool descriptions, lower-cased: a model that copies them has looked nothing up (P1)."""
    enum_argument_names: frozenset[str]
    """Arguments whose value is one of a fixed set: chosen, never looked up (B6)."""
    read_tools: frozenset[str]
    terminal_tools: frozenset[str]
    record_id_field: str
    """The id field of the records whose latest status, "cancelled", makes a write on them dead (B6)."""
    id_prefix: str = ""
    """Leading characters of ids that are not part of a word token (retail's ``#W…`` order ids): stripped when ids are
    matched against the tokens of messages and results."""
    policy: DomainPolicy | None = None
    """The domain policy's checks: P9–P11, B8 and P7's refusal exemption apply only with them."""

    @property
    def verifiable_id_names(self) -> frozenset[str]:
        return frozenset(self.lookup_tools.values())

    def normalize_id(self, value: Any) -> str:
        """An id argument's value as the rules compare it (lower-cased, the domain's prefix stripped)."""
        text = str(value).strip().lower()
        return text.lstrip(self.id_prefix) if self.id_prefix else text


def derive_vocabulary(
    domain: str,
    schemas: list[dict[str, Any]],
    read_tools: frozenset[str],
    terminal_tools: frozenset[str],
    terms: PrmTerms,
) -> Vocabulary:
    """A domain's vocabulary from its tool schemas, tool types and ``terms``."""
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in schemas}
    lookups = {}
    for name in sorted(read_tools):
        properties = list(parameters.get(name, {}).get("properties", {}))
        if len(properties) == 1 and is_id_name(properties[0]):
            lookups[name] = properties[0]
    return Vocabulary(
        domain=domain,
        id_argument_names=frozenset(
            name for params in parameters.values() for name, _ in walk_properties(params) if is_id_name(name)
        ),
        lookup_tools=lookups,
        example_values=frozenset(value.lower() for value in terms.examples),
        enum_argument_names=frozenset(
            name for params in parameters.values() for name, prop in walk_properties(params) if "enum" in prop
        ),
        read_tools=read_tools,
        terminal_tools=terminal_tools,
        record_id_field=terms.record_id_field,
        id_prefix=terms.id_prefix,
        policy=terms.policy,
    )


@functools.cache
def vocabulary(spec: DomainSpec) -> Vocabulary:
    """The PRM-Lite vocabulary of the domain ``spec``: derived from the schemas its agent is shown under the
    project's protocol (``tau2_rl.envs.protocol.agent_tool_schemas``) and its folder's ``PrmTerms``."""
    from tau2_rl.envs.protocol import TAU2_RL, agent_tool_schemas

    return derive_vocabulary(spec.name, agent_tool_schemas(TAU2_RL, spec), spec.read_tools(), spec.terminal_tools,
                             spec.prm_terms())  # fmt: skip
