"""Task splits and the three generalisation groups, read from each domain's committed split file.

Every split assigns each of the domain's tasks to exactly one group:
- ``covered_seen``: training tasks for which teacher trajectories exist (the SFT warm-up sees them);
- ``uncovered_seen``: training tasks without teacher trajectories (only GRPO sees them);
- ``unseen``: test tasks, never trained on.
A domain's file (``DomainSpec.split_file``: ``tau2_rl/domains/<domain>/splits.json``) names its splits (the airline:
``seed`` and ``tau2``; retail: ``tau2``) and ``DomainSpec.default_split`` the one ``--split`` means when not given.
``tau2_rl/data/make_splits.py`` generates the files deterministically; docs/splits.md explains how.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tau2_rl.envs.spec import SplitRecipe as SplitRecipe  # a domain's recipe for its split file, re-exported

if TYPE_CHECKING:
    from tau2_rl.envs.data import Domain

GROUPS = ("covered_seen", "uncovered_seen", "unseen")
DEFAULT_SPLITS_FILE = "splits.json"


class SplitError(ValueError):
    """A split file or split name is wrong; the message names the file, split and field."""


@dataclass(frozen=True)
class Split:
    """One named split: train / test task ids and the covered subset of train."""

    name: str
    train: tuple[str, ...]
    test: tuple[str, ...]
    covered: tuple[str, ...]
    description: str = ""

    def group_of(self, task_id: str) -> str:
        task_id = str(task_id)
        if task_id in self.covered:
            return "covered_seen"
        if task_id in self.train:
            return "uncovered_seen"
        if task_id in self.test:
            return "unseen"
        raise SplitError(f"task {task_id!r} is in no group of split {self.name!r}")

    def group(self, name: str) -> tuple[str, ...]:
        if name == "covered_seen":
            return self.covered
        if name == "uncovered_seen":
            return tuple(t for t in self.train if t not in self.covered)
        if name == "unseen":
            return self.test
        raise SplitError(f"unknown group {name!r}; expected one of {GROUPS}")

    @property
    def all_tasks(self) -> tuple[str, ...]:
        return self.train + self.test


def _parse_split(name: str, raw: object, location: str, task_ids: set[str] | None) -> Split:
    if not isinstance(raw, dict):
        raise SplitError(f"{location}: split {name!r} must be an object with 'train', 'test' and 'covered' lists")
    lists: dict[str, tuple[str, ...]] = {}
    for field in ("train", "test", "covered"):
        value = raw.get(field)
        if not isinstance(value, list) or not all(isinstance(t, str | int) for t in value):
            raise SplitError(f"{location}: field {name}.{field} must be a list of task ids")
        lists[field] = tuple(str(t) for t in value)
        if len(set(lists[field])) != len(lists[field]):
            raise SplitError(f"{location}: field {name}.{field} lists a task twice")
    train, test, covered = lists["train"], lists["test"], lists["covered"]
    if set(train) & set(test):
        raise SplitError(
            f"{location}: split {name!r} has tasks in both train and test: {sorted(set(train) & set(test))}"
        )
    if not set(covered) <= set(train):
        raise SplitError(
            f"{location}: {name}.covered must be a subset of {name}.train (extra: {sorted(set(covered) - set(train))})"
        )
    if task_ids is not None:
        unknown = sorted((set(train) | set(test)) - task_ids)
        if unknown:
            raise SplitError(f"{location}: split {name!r} names unknown task ids {unknown}")
        missing = sorted(task_ids - set(train) - set(test))
        if missing:
            raise SplitError(f"{location}: split {name!r} leaves tasks {missing} in no group")
    return Split(name, train, test, covered, str(raw.get("description", "")))


@functools.lru_cache(maxsize=8)
def load_splits(path: str, task_ids: frozenset[str] | None = None) -> dict[str, Split]:
    """All splits in the file ``path``, validated against ``task_ids`` when given."""
    location = str(path)
    try:
        raw = json.loads(Path(location).read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise SplitError(f"split file {location} does not exist") from err
    except json.JSONDecodeError as err:
        raise SplitError(f"split file {location} is not valid JSON: {err}") from err
    splits = raw.get("splits") if isinstance(raw, dict) else None
    if not isinstance(splits, dict) or not splits:
        raise SplitError(f"{location}: expected an object with a non-empty 'splits' mapping")
    return {
        name: _parse_split(name, value, location, set(task_ids) if task_ids else None)
        for name, value in splits.items()
    }


def get_split(name: str, path: str, task_ids: frozenset[str] | None = None) -> Split:
    """The split called ``name`` of the file ``path``; an unknown name lists the valid ones."""
    splits = load_splits(str(path), task_ids)
    if name not in splits:
        raise SplitError(f"unknown split {name!r} (--split); valid splits: {sorted(splits)}")
    return splits[name]


def split_for(domain: Domain, name: str | None = None, path: str | None = None) -> Split:
    """The split ``name`` of a loaded domain (default: the domain's default split), from ``path`` (``--split_file``)
    or the domain's own committed file, checked against the domain's tasks."""
    spec = domain.spec
    name = name or spec.default_split
    try:
        return get_split(name, path or spec.split_file(), frozenset(domain.tasks))
    except SplitError as err:
        raise SplitError(f"{err} (the {spec.name} domain)") from None
