"""The types of a results file's fields, checked when it is read: a hand-edited or foreign file is one line naming the
field (``tasks['0'].samples[1].success must be a bool, got 'yes'``), not a ``TypeError`` deep in the metrics."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

NUMBER = (int, float)
SAMPLE_TYPES: dict[str, tuple[type, ...]] = {
    "sample": (int,),
    "seed": (int,),
    "success": (bool,),
    "reward": (dict,),
    "termination": (str, type(None)),
    "turns": (int,),
    "tool_calls": (int,),
    "tool_errors": (int,),
    "tool_error_kinds": (dict,),
    "write_calls": (int,),
    "policy_tokens": (list,),
    "truncated": (bool,),
    "user_error": (str, type(None)),
    "agent_error": (str, type(None)),
    "messages": (list,),
}
TASK_TYPES: dict[str, tuple[type, ...]] = {
    "samples": (list,),
    "group": (str,),
    "communicate": (bool,),
    "refusal_passes": (bool,),
    "writes": (bool,),
    "successes": (int,),
    "valid_samples": (int,),
}
TOP_TYPES: dict[str, tuple[type, ...]] = {"metrics": (dict,), "runs": (list,), "updated": (str,)}


class SchemaError(ValueError):
    """A field of a results file has the wrong type (the message names the field)."""


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def _check(where: str, value: Any, types: tuple[type, ...]) -> None:
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)  # True is not an int here
    if not ok:
        raise SchemaError(f"{where} must be {_type_names(types)}, got {value!r:.40}")


def _check_fields(prefix: str, entry: Mapping[str, Any], types: Mapping[str, tuple[type, ...]]) -> None:
    for key, allowed in types.items():
        if key in entry:
            _check(f"{prefix}{key}", entry[key], allowed)


def check_results_types(path: str | Path, data: Mapping[str, Any]) -> None:
    """Raises ``SchemaError`` ("results file <path>: <field> must be <type>, got <value>") on the first wrong type,
    and on a sample index that repeats within a task or lies outside ``0..num_samples-1`` (a resume would play the
    "missing" one again and pass^k would count more episodes than ``num_samples``)."""
    num_samples = data.get("config", {}).get("num_samples")
    try:
        _check_fields("", data, TOP_TYPES)
        for task_id, entry in data["tasks"].items():
            _check(f"tasks[{task_id!r}]", entry, (dict,))
            _check_fields(f"tasks[{task_id!r}].", entry, TASK_TYPES)
            seen: dict[int, int] = {}
            for i, sample in enumerate(entry.get("samples", [])):
                where = f"tasks[{task_id!r}].samples[{i}]"
                _check(where, sample, (dict,))
                _check_fields(f"{where}.", sample, SAMPLE_TYPES)
                index = sample.get("sample")
                if isinstance(index, int) and index in seen:
                    raise SchemaError(f"{where}.sample {index} repeats samples[{seen[index]}].sample")
                if isinstance(index, int) and isinstance(num_samples, int) and not 0 <= index < num_samples:
                    raise SchemaError(f"{where}.sample must be in 0..{num_samples - 1} (num_samples), got {index}")
                if isinstance(index, int):
                    seen[index] = i
                if "reward" in sample.get("reward", {}):
                    _check(f"{where}.reward.reward", sample["reward"]["reward"], NUMBER)
                for j, tokens in enumerate(sample.get("policy_tokens", [])):
                    _check(f"{where}.policy_tokens[{j}]", tokens, (int,))
    except SchemaError as err:
        raise SchemaError(f"results file {path}: {err}; fix or move the file away") from None
