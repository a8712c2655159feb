"""``DomainSpec``: what one τ² domain brings to the project, and nothing else.

The episode loop, the protocol, rendering, the trainer, pass^k, the results and the hub do not know which domain
they run. A domain brings its data (where the four τ² files ship, which release they are, how its database is
validated and typed), its tools (how a call runs on an episode's copy-on-write state, and which tools read, write or
end the conversation). Telecom, next, adds the user's side: its user tools (τ²'s ``user_tools``) would be a second
``execute_tool`` for the user simulator's calls, and its environment assertions a further reward basis
(docs/layout.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

    from tau2_rl.envs.state import EpisodeState
    from tau2_rl.envs.tools import ToolResult


@dataclass(frozen=True)
class DomainSpec:
    """One τ² domain: its data files and its tools. Callables are looked up lazily (τ²'s modules import litellm)."""

    name: str
    package: str
    """The installed package whose data directory holds the domain's default files."""
    package_path: str
    """The files' directory inside ``package`` (τ²'s layout: ``data/tau2/domains/<name>``)."""
    release: str
    """Which τ²-bench release the default files are (README: per domain, which tasks a score is on)."""
    models: Callable[[], Mapping[str, type[BaseModel]]]
    """Each database table's record model (τ²'s data model), in the database's table order."""
    required_fields: Mapping[str, tuple[str, ...]]
    """Per table, the fields every record must have: a clear error before τ²'s model validates the rest."""
    validate_db: Callable[[Any, str], dict[str, dict[str, Any]]]
    """The raw db.json → τ²'s ``model_dump`` of it (plain dicts: the field order and nulls τ² shows and hashes)."""
    execute_tool: Callable[[EpisodeState, str, Any], ToolResult]
    """One agent call on an episode's state, as τ²'s ``Environment.get_response`` answers it."""
    tool_types: Callable[[], Mapping[str, str]]
    """Every agent tool's name → ``read``, ``write`` or ``generic`` (τ²'s ``ToolType``)."""
    terminal_tools: frozenset[str] = frozenset({"transfer_to_human_agents"})
    """Tools that end the conversation in effect (the user answers the transfer)."""

    def write_tools(self) -> frozenset[str]:
        return frozenset(name for name, kind in self.tool_types().items() if kind == "write")

    def read_tools(self) -> frozenset[str]:
        return frozenset(name for name, kind in self.tool_types().items() if kind == "read")
