"""Task splits and the three generalisation groups, read from one committed file (``tau2_rl/data/splits.json``).

Every split assigns each of the 50 tasks to exactly one group:
- ``covered_seen``: training tasks for which teacher trajectories exist (the SFT warm-up sees them);
- ``uncovered_seen``: training tasks without teacher trajectories (only GRPO sees them);
- ``unseen``: test tasks, never trained on.
``tau2_rl/data/make_splits.py`` generates the file deterministically; docs/splits.md explains how.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

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


def default_splits_path() -> Path:
    return Path(str(resources.files("tau2_rl").joinpath("data", DEFAULT_SPLITS_FILE)))


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
def load_splits(path: str | None = None, task_ids: frozenset[str] | None = None) -> dict[str, Split]:
    """All splits in the file (default: the committed one), validated against ``task_ids`` when given."""
    location = path or str(default_splits_path())
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


def get_split(name: str, path: str | None = None, task_ids: frozenset[str] | None = None) -> Split:
    """The split called ``name``; an unknown name lists the valid ones."""
    splits = load_splits(path, task_ids)
    if name not in splits:
        raise SplitError(f"unknown split {name!r} (--split); valid splits: {sorted(splits)}")
    return splits[name]


OFFICIAL_SPLIT_NAMES = ("seed", "tau2")
"""A domain other than the airline has no split file of its own: both names are τ²'s official train / test split."""


def split_for(domain: Domain, name: str, path: str | None = None) -> Split:
    """The split ``name`` of a loaded domain: the airline's from the split file (``--split_file``, default the
    committed one); another domain's, unless ``path`` names a file, τ²'s official train / test split of its
    split_tasks.json, every train task covered (the oracle plays them all: teacher trajectories exist)."""
    if domain.name == "airline" or path is not None:
        return get_split(name, path, frozenset(domain.tasks))
    if name not in OFFICIAL_SPLIT_NAMES:
        raise SplitError(
            f"unknown split {name!r} (--split) for the {domain.name} domain; valid splits: "
            f"{list(OFFICIAL_SPLIT_NAMES)} (τ²'s official train/test) or a --split_file"
        )
    official = domain.official_split
    train, test = tuple(official["train"]), tuple(official["test"])
    return Split(
        name, train, test, train, f"τ²'s official {domain.name} split ({len(train)} train / {len(test)} test)"
    )
