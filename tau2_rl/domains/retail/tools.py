"""τ²'s 16 retail tools, run by τ²'s own ``RetailTools`` over an episode's copy-on-write state.

Why τ²'s own toolkit: its tools are the reference, so every observation, error text and half-done write is τ²'s by
construction; what this module adds is the state they run on. τ²'s ``RetailTools`` reads ``self.db.<table>`` as a
mapping of pydantic records and mutates the records it gets in place. Here ``self.db`` is a ``_TableView`` per table
over the episode's ``EpisodeState`` (the domain-neutral copy-on-write state of ``tau2_rl.envs.state``):

- ``view[key]`` (τ²'s ``_get_order`` / ``_get_user`` / ``_get_product``: the records a tool may write) copies the
  record into the episode's overlay on first use, as a fresh model validated from the base record;
- ``items()`` / ``values()`` (the name and email look-ups, ``list_all_product_types``: reads only) hand out the
  overlay's record where the episode has one, else a read-only model shared by the process, so a look-up over the
  500 users copies nothing.

A call goes through the same steps as τ²'s ``Environment.get_response``: ``make_tool_call``'s keyword collisions,
the tool, any exception as ``"Error: <message>"``, the result shown by ``Environment.to_json_str``. ``calculate``
is the airline's guarded one (τ²'s retail and airline ``calculate`` are the same code; ``tau2_rl.envs.calculator``
answers where τ² would hang).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel

from tau2_rl.envs.calculator import calculate
from tau2_rl.envs.protocol import tau2_module
from tau2_rl.envs.state import EpisodeState
from tau2_rl.envs.toolkit import ToolResult, respond

TABLES = ("products", "users", "orders")


@functools.cache
def table_models() -> dict[str, type[BaseModel]]:
    """τ²'s retail record models, by table (imported on first use: τ² pulls in litellm)."""
    data_model = tau2_module("tau2.domains.retail.data_model")
    return {"products": data_model.Product, "users": data_model.User, "orders": data_model.Order}


@functools.cache
def _toolkit() -> Any:
    return tau2_module("tau2.domains.retail.tools").RetailTools


def tool_names() -> dict[str, str]:
    """Every retail tool's name → τ²'s tool type (``read``, ``write``, ``generic``), in τ²'s order."""
    TOOL_TYPE_ATTR = tau2_module("tau2.environment.toolkit").TOOL_TYPE_ATTR  # noqa: N806 (τ²'s name)

    toolkit = _toolkit()
    return {name: getattr(func, TOOL_TYPE_ATTR).value for name, func in toolkit(None)._func_tools.items()}


class _SharedReads:
    """Read-only models of the base records, validated once per process and base (the look-ups' iteration)."""

    def __init__(self) -> None:
        self.models: dict[tuple[int, str, str], BaseModel] = {}

    def get(self, state: EpisodeState, table: str, key: str) -> BaseModel:
        slot = (id(state.base), table, key)
        model = self.models.get(slot)
        if model is None:
            model = state.base.models[table].model_validate(state.base.db[table][key])
            self.models[slot] = model
        return model


_SHARED = _SharedReads()


class _TableView(Mapping):
    """What τ²'s ``RetailTools`` sees as one table of ``self.db``."""

    __slots__ = ("state", "table")

    def __init__(self, state: EpisodeState, table: str) -> None:
        self.state = state
        self.table = table

    def __contains__(self, key: object) -> bool:
        return self.state.contains(self.table, key)  # type: ignore[arg-type]

    def __getitem__(self, key: str) -> BaseModel:
        if not self.state.contains(self.table, key):
            raise KeyError(key)
        return self.state.model(self.table, key)

    def __iter__(self) -> Iterator[str]:
        overlay = self.state.overlay[self.table]
        base = self.state.base.db[self.table]
        yield from base
        yield from (key for key in overlay if key not in base)

    def __len__(self) -> int:
        base = self.state.base.db[self.table]
        return len(base) + sum(key not in base for key in self.state.overlay[self.table])

    def _read(self, key: str) -> BaseModel:
        record = self.state.overlay[self.table].get(key)
        return record if record is not None else _SHARED.get(self.state, self.table, key)

    def items(self) -> Iterator[tuple[str, BaseModel]]:  # type: ignore[override]
        return ((key, self._read(key)) for key in self)

    def values(self) -> Iterator[BaseModel]:  # type: ignore[override]
        return (self._read(key) for key in self)


class _DB:
    """``RetailTools.db``: the three tables as views of one episode's state."""

    def __init__(self, state: EpisodeState) -> None:
        for table in TABLES:
            setattr(self, table, _TableView(state, table))


def execute_tool(state: EpisodeState, name: str, arguments: Any) -> ToolResult:
    """Runs one retail call as τ²'s ``Environment.get_response`` does. Never raises: failures become
    ``Error: ...``."""
    tools = _toolkit()(_DB(state))
    method = getattr(tools, name) if name in tools._func_tools else None
    return respond(name, arguments, method, run=calculate if name == "calculate" else None)
