"""Whether each stage's outputs are complete (the driver skips complete stages, so a rerun resumes)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from .settings import COMPARE_FILES, ROOT

# ---------------------------------------------------------------------------------------------------------------------
# completeness of each stage's outputs


@dataclass
class Status:
    complete: bool
    reason: str

    def __bool__(self) -> bool:
        return self.complete


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def recipe_value(recipe: str | None, flags: Sequence[str], name: str, default: Any = None) -> Any:
    """What a script will see for ``name``: the last ``--name value`` in ``flags``, else the recipe's, else default."""
    value = default
    if recipe:
        data = yaml.safe_load((ROOT / recipe).read_text(encoding="utf-8")) if (ROOT / recipe).is_file() else None
        if isinstance(data, dict) and name in data:
            value = data[name]
    for index, flag in enumerate(flags):
        if flag in (f"--{name}", f"--{name.replace('_', '-')}") and index + 1 < len(flags):
            value = flags[index + 1]
        elif flag.startswith(f"--{name}="):
            value = flag.split("=", 1)[1]
    return value


def collect_status(
    output_dir: Path, hub_dir: Path, attempts: int | None = None, tasks: Sequence[str] | None = None
) -> Status:
    info = read_json(output_dir / "collect_info.json")
    if not isinstance(info, dict):
        return Status(False, f"no {output_dir}/collect_info.json")
    if tasks is not None and sorted(map(str, info.get("tasks") or [])) != sorted(map(str, tasks)):
        return Status(False, f"collected tasks {info.get('tasks')}, asked {list(tasks)}")
    expected = len(info.get("tasks") or []) * int(info.get("attempts_per_task") or 0)
    if attempts is not None and int(info.get("attempts_per_task") or 0) != int(attempts):
        return Status(False, f"collected with {info.get('attempts_per_task')} attempts per task, {attempts} asked")
    if not expected or int(info.get("attempts_finished") or 0) < expected:
        return Status(False, f"{info.get('attempts_finished')} of {expected} attempts finished")
    if not (output_dir / "dataset" / "state.json").is_file():
        return Status(False, f"no saved dataset in {output_dir}/dataset")
    exported = read_json(hub_dir / "datasets" / output_dir.name / "collect_info.json")
    if not isinstance(exported, dict) or exported.get("attempts_finished") != info.get("attempts_finished"):
        return Status(False, f"dataset not exported to {hub_dir}/datasets/{output_dir.name} yet")
    return Status(True, f"{info['attempts_finished']} attempts, {sum((info.get('counts') or {}).values())} episodes")


def model_dir_status(path: Path) -> Status:
    if not (path / "config.json").is_file():
        return Status(False, f"no {path}/config.json")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        return Status(False, f"no weights in {path}")
    return Status(True, str(path))


def sft_status(output_dir: Path, hub_dir: Path, run_name: str) -> Status:
    model = model_dir_status(output_dir)
    if not model:
        return model
    if not (output_dir / "train_results.json").is_file():
        return Status(False, f"no {output_dir}/train_results.json (training did not finish)")
    refs = read_json(hub_dir / run_name / "refs.json")
    if not isinstance(refs, dict) or not refs.get("main"):
        return Status(False, f"not exported to {hub_dir}/{run_name} yet")
    return Status(True, f"model in {output_dir}, hub revision {refs['main']}")


def grpo_status(hub_dir: Path, run_name: str, steps: Sequence[int]) -> Status:
    run_dir = hub_dir / run_name
    refs = read_json(run_dir / "refs.json")
    if not isinstance(refs, dict):
        return Status(False, f"no {run_dir}/refs.json")
    have = {
        int(step) for name, step in (refs.get("revisions") or {}).items() if (run_dir / name / "config.json").is_file()
    }
    missing = [s for s in steps if s not in have]
    if missing:
        return Status(False, f"steps {missing} not exported yet (have {sorted(have)})")
    return Status(True, f"steps {sorted(steps)} exported to {run_dir}")


def results_status(path: Path, tasks: Sequence[str] | None = None, num_samples: int | None = None) -> Status:
    """A results.json holds a valid sample for every (task, sample index) it was asked for (and that we ask for)."""
    data = read_json(path)
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("config"), dict)
        or not isinstance(data.get("tasks"), dict)
    ):
        return Status(False, f"no results in {path}")
    config = data["config"]
    wanted_tasks = [str(t) for t in config.get("tasks") or []]
    n = int(config.get("num_samples") or 0)
    if tasks is not None and sorted(map(str, tasks)) != sorted(wanted_tasks):
        return Status(False, f"{path} covers other tasks than asked")
    if num_samples is not None and int(num_samples) != n:
        return Status(False, f"{path} has {n} samples per task, {num_samples} asked")
    if not wanted_tasks or n < 1:
        return Status(False, f"{path} names no task")
    missing = 0
    for task_id in wanted_tasks:
        samples = (data["tasks"].get(task_id) or {}).get("samples") or []
        done = {s.get("sample") for s in samples if not s.get("user_error")}
        missing += sum(1 for i in range(n) if i not in done)
    if missing:
        return Status(False, f"{missing} of {len(wanted_tasks) * n} samples missing in {path}")
    return Status(True, f"{len(wanted_tasks) * n} samples")


def all_complete(statuses: Sequence[Status]) -> Status:
    for status in statuses:
        if not status:
            return status
    reasons = [s.reason for s in statuses]
    if len(set(reasons)) == 1 and len(reasons) > 1:
        return Status(True, f"{len(reasons)} × {reasons[0]}")
    return Status(True, "; ".join(reasons))


def compare_status(output_dir: Path, results: Sequence[Path], labels: Sequence[str]) -> Status:
    files = [output_dir / name for name in COMPARE_FILES]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        return Status(False, f"missing {', '.join(missing)} in {output_dir}")
    oldest = min(f.stat().st_mtime for f in files)
    stale = [str(r) for r in results if r.is_file() and r.stat().st_mtime > oldest]
    if stale:
        return Status(False, f"older than {stale[0]}")
    table = files[0].read_text(encoding="utf-8")
    absent = [label for label in labels if label not in table]
    if absent:
        return Status(False, f"{files[0]} does not show {absent}")
    return Status(True, f"{', '.join(COMPARE_FILES)} in {output_dir}")


def _health_url(base_url: str) -> str:
    parsed = urlparse(base_url)
    return f"{parsed.scheme or 'http'}://{parsed.hostname or '127.0.0.1'}:{parsed.port or 80}/health"


def endpoint_status(base_url: str) -> Status:
    url = _health_url(base_url)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            if response.status == 200:
                return Status(True, f"{url} is healthy")
    except (urllib.error.URLError, OSError):
        pass
    return Status(False, f"{url} does not answer")
