"""The τ² domains this project runs, by name (``--domain``): a plain-dict registry of the domain folders.

Each domain is one folder below this package whose ``SPEC`` (``tau2_rl.envs.spec.DomainSpec``) holds all that is the
domain's; nothing outside this package names a domain (tests/test_domain_layer.py). Adding one: docs/layout.md,
"Adding a domain".
"""

from __future__ import annotations

import functools
import importlib

from tau2_rl.envs.spec import DomainSpec

DOMAINS: dict[str, str] = {
    "airline": "tau2_rl.domains.airline",
    "retail": "tau2_rl.domains.retail",
    "telecom": "tau2_rl.domains.telecom",
    "telecom-workflow": "tau2_rl.domains.telecom.workflow",  # telecom under τ²'s workflow policy
    "mock": "tau2_rl.domains.mock",
}
"""Domain name → the module whose ``SPEC`` describes it."""

DEFAULT_DOMAIN = "airline"
"""What ``--domain`` means when not given."""


class UnknownDomainError(ValueError):
    """A domain name this project does not know; the message lists the known ones."""


@functools.cache
def get_domain(name: str) -> DomainSpec:
    """The ``DomainSpec`` of ``name`` (``--domain``)."""
    if name not in DOMAINS:
        raise UnknownDomainError(f"--domain {name!r}: unknown domain; choose among {', '.join(DOMAINS)}")
    return importlib.import_module(DOMAINS[name]).SPEC


def parse_domains(value: str | list[str] | tuple[str, ...] | None, flag: str = "--domain") -> list[DomainSpec]:
    """``airline`` or ``airline,retail`` (several domains in one run) → their specs, in the order given; an unknown
    or repeated name is an error naming ``flag`` and the known domains."""
    text = DEFAULT_DOMAIN if value is None else value
    items = text if isinstance(text, list | tuple) else str(text).split(",")
    names = [str(item).strip() for item in items if str(item).strip()]
    if not names:
        raise UnknownDomainError(f"{flag} names no domain; choose among {', '.join(DOMAINS)}")
    unknown = [name for name in names if name not in DOMAINS]
    if unknown:
        raise UnknownDomainError(
            f"{flag} {','.join(names)!r}: unknown domain {', '.join(map(repr, unknown))}; choose among "
            f"{', '.join(DOMAINS)} (several: comma-separated)"
        )
    if len(set(names)) != len(names):
        raise UnknownDomainError(f"{flag} {','.join(names)!r} names a domain twice")
    return [get_domain(name) for name in names]


def task_files(
    specs: list[DomainSpec], data_dir: str | None = None, task_set: str | None = None
) -> str | dict[str, str | None] | None:
    """Where each domain's files come from: ``--data_dir`` as it is, or with ``--task_set`` each domain's installed
    release (None: the domain's default already is it); a ValueError names the flag."""
    if not task_set:
        return data_dir
    if data_dir:
        raise ValueError("--task_set and --data_dir both name the task files: pass one of them")
    return {spec.name: None if task_set == spec.default_task_set else spec.task_set_dir(task_set) for spec in specs}


def legacy_domain() -> DomainSpec:
    """The domain of everything written before the project recorded domains (``DomainSpec.unnamed_before_domains``)."""
    (spec,) = [spec for spec in map(get_domain, DOMAINS) if spec.unnamed_before_domains]
    return spec


__all__ = ["DEFAULT_DOMAIN", "DOMAINS", "DomainSpec", "UnknownDomainError", "get_domain", "legacy_domain",
           "parse_domains", "task_files"]  # fmt: skip
