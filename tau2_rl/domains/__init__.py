"""The τ² domains this project runs, by name (``--domain``): a plain-dict registry of ``DomainSpec`` builders."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from tau2_rl.domains.base import DomainSpec

DOMAINS: dict[str, str] = {
    "airline": "tau2_rl.domains.airline",
    "retail": "tau2_rl.domains.retail",
}
"""Domain name → the module whose ``SPEC`` describes it."""


class UnknownDomainError(ValueError):
    """A domain name this project does not know; the message lists the known ones."""


@functools.cache
def get_domain(name: str) -> DomainSpec:
    """The ``DomainSpec`` of ``name`` (``--domain``)."""
    if name not in DOMAINS:
        raise UnknownDomainError(f"--domain {name!r}: unknown domain; choose one of {', '.join(DOMAINS)}")
    return importlib.import_module(DOMAINS[name]).SPEC


def execute_tool(state: Any, name: str, arguments: Any) -> Any:
    """Runs one agent tool call on ``state`` with the tools of the domain its database is from."""
    return get_domain(state.base.domain).execute_tool(state, name, arguments)


__all__ = ["DOMAINS", "DomainSpec", "UnknownDomainError", "execute_tool", "get_domain"]
