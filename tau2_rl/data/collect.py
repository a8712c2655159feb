"""Teacher trajectories → an HF dataset: play a teacher against a user simulator, keep the episodes it solves.

    python collect_trajectories.py                                   # oracle, covered tasks of the seed split
    python collect_trajectories.py --teacher openai --teacher_base_url http://localhost:8000/v1 \\
        --teacher_model Qwen/Qwen2.5-72B-Instruct-AWQ --attempts 8 --user_simulator llm ...

Episodes are played by ``run_episodes`` (the one episode loop), ``chunk_size`` at a time. Collection directory:

    <output_dir>/attempts/<task>/<attempt>.json   one finished attempt each (kept or not), written atomically
    <output_dir>/dataset/                         ``save_to_disk`` of the kept rows, swapped in atomically
    <output_dir>/collect_info.json                settings, counts and the covered task set
    <hub_dir>/datasets/<name>/                    the local-hub export: data/*.parquet, README.md, collect_info.json

Resumable: the attempt files are the record of what is finished; a rerun skips those (task, attempt) pairs and
rebuilds the dataset from all of them, so nothing collected is ever lost. An attempt that did not finish because
the teacher's or the user simulator's endpoint failed is not written, so the rerun plays it again.

Kept: reward ≥ ``min_reward`` and no malformed tool call (a malformed block stays in the messages as raw text and
would teach the model to write it). With ``deduplicate``, a task keeps one row per distinct conversation.

Columns: task_id, attempt, seed, messages, tools, reward, teacher, teacher_model, user_simulator, user_model,
termination. ``messages`` and ``tools`` are ``List(Json())``: each message is stored as its own JSON text, so Arrow
never unifies the structs of different rows (which would add ``null`` keys to tool arguments and change how the chat
template renders them). ``decode_rows`` reads that text with ``json.loads``: exact, unlike the generic ``Json``
decoder of ``datasets`` (pandas' ujson, which rounds some floats: 0.35 → 0.35000000000000003).

Leak guard: test tasks of the split are refused unless ``allow_test_tasks``. The covered task set of a dataset is the
set of tasks present in it (``covered_tasks``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
from datasets import Features, Json, List, Value
from tqdm.auto import tqdm

from tau2_rl.configs import CollectArguments
from tau2_rl.data.build_cache import swap_into_place
from tau2_rl.envs.episode import USER_ERROR, EpisodeRecord
from tau2_rl.envs.multi import RunEnv, run_env, run_split
from tau2_rl.envs.protocol import agent_view
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.splits import Split
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.rewards.outcome import require_scorable, scorer
from tau2_rl.run.hub import WRITERS_KEY, check_writer, ensure_writable, write_json_atomic, writer_id

logger = logging.getLogger(__name__)

ATTEMPT_FORMAT = 1
ATTEMPTS_DIR = "attempts"
DATASET_DIR = "dataset"
INFO_FILE = "collect_info.json"
HUB_DATASETS_DIR = "datasets"

FEATURES = Features(
    {
        "task_id": Value("string"),
        "attempt": Value("int32"),
        "seed": Value("int64"),
        "messages": List(Json()),
        "tools": List(Json()),
        "reward": Value("float64"),
        "teacher": Value("string"),
        "teacher_model": Value("string"),
        "user_simulator": Value("string"),
        "user_model": Value("string"),
        "termination": Value("string"),
        "source": Value("string"),
        "source_sha256": Value("string"),
        "source_simulation": Value("string"),
    }
)
"""``source*``: where a row read from a τ² results file came from (``--teacher tau2_results``: the file, its sha256,
the simulation's id); empty for an attempt played here."""
REQUIRED_COLUMNS = ("task_id", "messages", "tools")
"""What SFT needs; ``reward`` is used for filtering when present."""

# Settings that must not change between runs into the same collection directory.
RESUME_KEYS = ("teacher", "teacher_model", "user_simulator", "user_model", "seed", "data_dir", "results")
"""``results``: the sha256 of each results file a ``tau2_results`` collection read, in order."""


class CollectError(ValueError):
    """Bad collection settings or directory; the message names the flag or path."""


# ------------------------------------------------------------------------------------------------ task selection


def parse_task_list(value: str | None) -> list[str] | None:
    if value is None:
        return None
    tasks = [t.strip() for t in value.split(",") if t.strip()]
    return list(dict.fromkeys(tasks))


def select_tasks(
    tasks: Sequence[str] | None, split: Split, known: Iterable[str], allow_test_tasks: bool, flag: str = "--tasks"
) -> list[str]:
    """``tasks`` (validated), or the split's covered train tasks; test tasks need ``--allow_test_tasks``."""
    known = set(known)
    chosen = list(split.covered) if tasks is None else list(tasks)
    unknown = [t for t in chosen if t not in known]
    if unknown:
        ids = sorted(known, key=task_sort_key)
        valid = f"{ids[0]}..{ids[-1]} ({len(ids)} tasks)" if ids else "none"
        raise CollectError(f"{flag} names unknown task ids {unknown}; valid ids: {valid}")
    if not chosen:
        raise CollectError(f"{flag} selects no task")
    leaked = [t for t in chosen if t in split.test]
    if leaked and not allow_test_tasks:
        raise CollectError(
            f"tasks {leaked} are test tasks of split {split.name!r}; training on them leaks the test set. Pass "
            "--allow_test_tasks to do it anyway."
        )
    return chosen


def task_sort_key(task_id: str) -> tuple[int, str]:
    return (int(task_id), task_id) if task_id.isdigit() else (10**9, task_id)


# ------------------------------------------------------------------------------------------------ attempt files


def attempt_path(output_dir: Path, task_id: str, attempt: int) -> Path:
    return output_dir / ATTEMPTS_DIR / task_id / f"{attempt:05d}.json"


def write_attempt(output_dir: Path, payload: dict[str, Any]) -> None:
    write_json_atomic(attempt_path(output_dir, payload["task_id"], payload["attempt"]), payload)


def load_attempts(output_dir: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Every finished attempt in the directory, by (task, attempt). A file that does not parse is an error (it can
    only be a file someone else wrote: ours are replaced atomically)."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    root = output_dir / ATTEMPTS_DIR
    if not root.is_dir():
        return found
    for path in sorted(root.rglob("*.json")):  # attempts/<task id>/, <domain>/<task id>/ with several domains
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
            key = (str(payload["task_id"]), int(payload["attempt"]))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CollectError(f"attempt file {path} is unreadable ({err}); delete it to collect it again") from err
        found[key] = payload
    return found


def attempt_payload(
    record: EpisodeRecord, attempt: int, settings: dict[str, Any], tools: list[dict]
) -> dict[str, Any]:
    return {
        "format": ATTEMPT_FORMAT,
        "task_id": record.task_id,
        "attempt": attempt,
        "seed": record.seed,
        "teacher": settings["teacher"],
        "teacher_model": settings["teacher_model"],
        "user_simulator": settings["user_simulator"],
        "user_model": settings["user_model"],
        "termination": record.termination,
        "reward": record.reward,
        "messages": agent_view(record.messages),  # what the agent saw: the user's own calls are not trained on
        "tool_calls": [
            {"name": call.name, "error": call.error, "error_kind": call.error_kind} for call in record.tool_calls
        ],
        "num_tools": len(tools),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def keep_reason(payload: dict[str, Any], min_reward: float) -> str | None:
    """None when the attempt is kept, else why not."""
    reward = float((payload.get("reward") or {}).get("reward", 0.0))
    if any(call.get("error_kind") == "parse" for call in payload.get("tool_calls", [])):
        return "malformed_tool_call"
    if reward < min_reward:
        return "reward_below_min"
    return None


# ------------------------------------------------------------------------------------------------ dataset


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def rows_to_dataset(rows: list[dict[str, Any]]) -> datasets.Dataset:
    """Rows with python ``messages`` / ``tools`` → a dataset with ``FEATURES`` (each message as exact JSON text)."""
    columns: dict[str, list] = {name: [] for name in FEATURES}
    for row in rows:
        for name in FEATURES:
            value = row.get(name)
            if name in ("messages", "tools"):
                value = [_dumps(item) for item in value]
            columns[name].append(value)
    return datasets.Dataset.from_dict(columns, features=FEATURES)


def decode_rows(dataset: datasets.Dataset) -> list[dict[str, Any]]:
    """The rows as python values, ``messages`` and ``tools`` decoded exactly (``json.loads`` of the stored text)."""
    table = dataset.with_format("arrow")[:]
    columns = {}
    for name in table.column_names:
        values = table.column(name).to_pylist()
        if isinstance(dataset.features.get(name), List) and isinstance(dataset.features[name].feature, Json):
            values = [None if items is None else [_loads(item) for item in items] for items in values]
        elif isinstance(dataset.features.get(name), Json):
            values = [_loads(item) for item in values]
        columns[name] = values
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def _loads(item: Any) -> Any:
    return json.loads(item) if isinstance(item, str) else item


def covered_tasks(dataset: datasets.Dataset) -> list[str]:
    """The covered task set: every task present in the dataset."""
    return sorted(set(dataset["task_id"]), key=task_sort_key)


def build_rows(
    attempts: dict[tuple[str, int], dict[str, Any]],
    tools_of: Callable[[str], list[dict]],
    min_reward: float,
    deduplicate: bool,
) -> tuple[list[dict[str, Any]], Counter]:
    """The dataset rows of the kept attempts, in (task, attempt) order, and counts of what was dropped and why
    (``tools_of``: a task's tool schemas, as its episodes showed them)."""
    rows: list[dict[str, Any]] = []
    counts: Counter = Counter()
    seen: set[tuple[str, str]] = set()
    for key in sorted(attempts, key=lambda k: (task_sort_key(k[0]), k[1])):
        payload = attempts[key]
        reason = keep_reason(payload, min_reward)
        if reason is not None:
            counts[reason] += 1
            continue
        fingerprint = (payload["task_id"], _dumps(payload["messages"]))
        if deduplicate and fingerprint in seen:
            counts["duplicate"] += 1
            continue
        seen.add(fingerprint)
        counts["kept"] += 1
        rows.append(
            {
                "task_id": payload["task_id"],
                "attempt": payload["attempt"],
                "seed": payload["seed"],
                "messages": payload["messages"],
                "tools": tools_of(payload["task_id"]),
                "reward": float(payload["reward"]["reward"]),
                "teacher": payload["teacher"],
                "teacher_model": payload["teacher_model"],
                "user_simulator": payload["user_simulator"],
                "user_model": payload["user_model"],
                "termination": payload["termination"],
                **_provenance(payload),
            }
        )
    return rows, counts


def _provenance(payload: dict[str, Any]) -> dict[str, str]:
    source = payload.get("source") or {}
    return {"source": str(source.get("file") or ""), "source_sha256": str(source.get("sha256") or ""),
            "source_simulation": str(source.get("simulation_id") or "")}  # fmt: skip


def save_dataset_atomic(dataset: datasets.Dataset, path: Path) -> None:
    """``save_to_disk`` into a temporary sibling, then swap it in: readers see the old or the new dataset, whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        dataset.save_to_disk(str(tmp))
        swap_into_place(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dataset_card(name: str, info: dict[str, Any]) -> str:
    counts = info.get("counts", {})
    lines = [
        "---",
        "configs:",
        "- config_name: default",
        "  data_files:",
        "  - split: train",
        "    path: data/*.parquet",
        f"tags: [tau2-bench, {', '.join(info.get('domains') or [])}, tool-calling, sft, trajectories]",
        "---",
        f"# {name}",
        "",
        f"Teacher trajectories on τ²-bench ({', '.join(info.get('domains') or [])}): teacher `{info.get('teacher')}`"
        + (f" ({info['teacher_model']})" if info.get("teacher_model") else "")
        + f", user simulator `{info.get('user_simulator')}`"
        + (f" ({info['user_model']})" if info.get("user_model") else "")
        + f", split `{info.get('split')}`. Only episodes with reward ≥ {info.get('min_reward')} are kept.",
        "",
        f"- rows: {counts.get('kept', 0)}; covered tasks ({len(info.get('covered_tasks', []))}): "
        f"{', '.join(info.get('covered_tasks', []))}",
        f"- attempts finished: {info.get('attempts_finished')}; not kept: "
        + (", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "kept") or "none"),
        "",
        "`messages` and `tools` are `List(Json())`; decode them exactly with "
        "`tau2_rl.data.collect.decode_rows(dataset)`.",
        "",
        "```python",
        "import datasets",
        f'ds = datasets.load_dataset("<hub_dir>/datasets/{name}", split="train")',
        "```",
        "",
    ]
    return "\n".join(lines)


def hub_dataset_dir(hub_dir: str | os.PathLike[str], name: str) -> Path:
    return Path(hub_dir) / HUB_DATASETS_DIR / name


def claim_hub_dataset(hub_dir: str | os.PathLike[str], name: str, output_dir: Path, *, overwrite: bool) -> None:
    """Refuses, before anything is played, ``<hub_dir>/datasets/<name>`` exported by another collection (another
    output_dir with the same name): the export would replace it (``HubError``, one line)."""
    final = hub_dataset_dir(hub_dir, name)
    info_path = final / INFO_FILE
    if not final.is_dir():
        return
    try:
        recorded = json.loads(info_path.read_text(encoding="utf-8")).get(WRITERS_KEY)
    except (OSError, ValueError, AttributeError):
        recorded = None
    check_writer(recorded, output_dir, final, what=str(final), rename_flag="--dataset_name", overwrite=overwrite)


def export_dataset(
    dataset: datasets.Dataset,
    hub_dir: str | os.PathLike[str],
    name: str,
    info: dict,
    output_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Writes ``<hub_dir>/datasets/<name>/`` (parquet shard, dataset card, collect_info.json), swapped in whole;
    its collect_info.json records the collection (``output_dir``) that wrote it."""
    final = hub_dataset_dir(hub_dir, name)
    if output_dir is not None:
        info = {**info, WRITERS_KEY: writer_id(output_dir, final)}
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        (tmp / "data").mkdir(parents=True)
        dataset.to_parquet(str(tmp / "data" / "train-00000-of-00001.parquet"))
        (tmp / "README.md").write_text(dataset_card(name, info), encoding="utf-8")
        write_json_atomic(tmp / INFO_FILE, info)
        swap_into_place(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------------------ collection


@dataclass
class CollectResult:
    """What a collection run did and where the dataset is."""

    output_dir: str
    dataset_dir: str
    hub_path: str | None
    tasks: list[str]
    played: int = 0
    skipped: int = 0
    unfinished: int = 0
    user_errors: int = 0
    """Attempts of ``unfinished`` that the user simulator failed (the others: the teacher's endpoint)."""
    last_error: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    covered_tasks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_output_dir(args: CollectArguments, split: str) -> Path:
    """``outputs/trajectories/<teacher>-<split>`` (``split``: the split's name, the domain's default if unnamed)."""
    return Path("outputs") / "trajectories" / f"{args.teacher}-{split}"


def _settings(args: CollectArguments) -> dict[str, Any]:
    return {
        "teacher": args.teacher,
        "teacher_model": (args.teacher_model or "") if args.teacher == "openai" else "",
        "user_simulator": args.user_simulator,
        "user_model": (args.user_model or "") if args.user_simulator == "llm" else "",
        "seed": args.seed,
        "data_dir": args.data_dir,
    }


def _check_resume(output_dir: Path, settings: dict[str, Any], attempts: dict) -> None:
    info_path = output_dir / INFO_FILE
    if not info_path.is_file():
        previous = next(iter(attempts.values()), None)
        if previous is None:
            return
        old = {key: previous.get(key) for key in RESUME_KEYS if key in previous}
    else:
        old = json.loads(info_path.read_text(encoding="utf-8")).get("settings", {})
    changed = [key for key in RESUME_KEYS if key in old and old[key] != settings.get(key)]
    if changed:
        details = ", ".join(f"--{key} was {old[key]!r}, now {settings[key]!r}" for key in changed)
        raise CollectError(
            f"{output_dir} was collected with other settings ({details}); resume with the same settings or choose "
            "another --output_dir"
        )


def _validate(args: CollectArguments) -> None:
    if args.attempts < 1:
        raise CollectError(f"--attempts must be >= 1, got {args.attempts}")
    if args.chunk_size < 1:
        raise CollectError(f"--chunk_size must be >= 1, got {args.chunk_size}")
    try:
        args.episode_schedule()
    except ValueError as err:
        raise CollectError(str(err)) from None


def collect(
    args: CollectArguments, teacher: Any | None = None, user: Any | None = None, env: RunEnv | None = None
) -> CollectResult:
    """Runs (or resumes) a collection and writes the dataset; ``teacher`` / ``user`` / ``env`` override the named
    ones (``env``: e.g. the compact-prompt environment of the embedded default policy)."""
    from tau2_rl.data.teachers import get_teacher

    if args.teacher == RESULTS_TEACHER:
        return collect_from_results(args, env)
    start = time.perf_counter()
    _validate(args)
    try:
        env = env or run_env(args.domain_specs(), args.data_dirs(), args.env_config())
    except ValueError as err:  # --task_set, --domain
        raise CollectError(str(err)) from None
    split = run_split(env, args.split, args.split_file)
    tasks = select_tasks(parse_task_list(args.tasks), split, env.task_keys, args.allow_test_tasks)
    try:  # every term of these tasks' rewards (the min_reward filter reads it), or one line now
        judge = args.judge()
        require_scorable({key: env.task(key) for key in tasks}, judge is not None)
    except ValueError as err:
        raise CollectError(str(err)) from None
    output_dir = Path(args.output_dir) if args.output_dir else default_output_dir(args, split.name)
    name = args.dataset_name or output_dir.name
    ensure_writable(args.hub_dir)
    claim_hub_dataset(args.hub_dir, name, output_dir, overwrite=args.overwrite_hub)
    output_dir.mkdir(parents=True, exist_ok=True)
    settings = _settings(args)
    schedule = args.episode_schedule()

    attempts = load_attempts(output_dir)
    _check_resume(output_dir, settings, attempts)
    pending = [
        (task_id, attempt)
        for attempt in range(args.attempts)
        for task_id in tasks
        if (task_id, attempt) not in attempts
    ]
    result = CollectResult(
        output_dir=str(output_dir),
        dataset_dir=str(output_dir / DATASET_DIR),
        hub_path=None,
        tasks=tasks,
        skipped=len(tasks) * args.attempts - len(pending),
    )
    if result.skipped:
        logger.info(
            "resuming %s: %d of %d attempts already finished", output_dir, result.skipped, len(tasks) * args.attempts
        )

    owns_teacher, owns_user = teacher is None, user is None
    if pending:
        teacher = teacher if teacher is not None else get_teacher(args.teacher, **args.teacher_kwargs())
        user = user if user is not None else get_user_simulator(args.user_simulator, **args.user_kwargs())
        for component in (teacher, user):
            check = getattr(component, "check_endpoint", None)
            if check is not None:
                check()
    bar = tqdm(total=len(pending), desc=f"collect {name}", disable=not args.progress or not pending)
    written: tuple[datasets.Dataset, dict[str, Any]] | None = None
    try:
        for begin in range(0, len(pending), args.chunk_size):
            chunk = pending[begin : begin + args.chunk_size]
            specs = [(task_id, args.seed + attempt) for task_id, attempt in chunk]
            episodes = [env.reset(task_id, seed) for task_id, seed in specs]  # kept: agent_state says teacher errors
            records = run_episodes(env, teacher, user, specs, episodes=episodes, progress=False, score=scorer(judge),
                                   schedule=schedule)  # fmt: skip
            for (task_id, attempt), episode, record in zip(chunk, episodes, records, strict=True):
                teacher_error = episode.agent_state.get("teacher_error")
                if teacher_error or record.termination == USER_ERROR:
                    result.unfinished += 1  # an endpoint failed: not the teacher's fault, play it again next run
                    result.user_errors += int(not teacher_error)
                    result.last_error = str(teacher_error or record.user_error)
                    continue
                payload = attempt_payload(record, attempt, settings, episode.tools)
                write_attempt(output_dir, payload)
                attempts[(task_id, attempt)] = payload
                result.played += 1
            bar.update(len(chunk))
            bar.set_postfix(kept=sum(keep_reason(p, args.min_reward) is None for p in attempts.values()))
            written = _write_dataset(output_dir, attempts, env, args, settings, split, result)
    finally:
        bar.close()
        for component, owned in ((teacher, owns_teacher), (user, owns_user)):
            if owned and hasattr(component, "close"):
                component.close()

    if not pending:  # nothing played: (re)build from the attempt files, e.g. after --min_reward changed
        written = _write_dataset(output_dir, attempts, env, args, settings, split, result)
    dataset, info = written
    if result.unfinished:
        logger.warning(
            "%d attempts did not finish (teacher or user-simulator endpoint failures); rerun to retry them",
            result.unfinished,
        )
    if len(dataset) == 0 and result.unfinished:  # the endpoints, not the teacher's skill: say which one failed
        teacher_errors = result.unfinished - result.user_errors
        raise CollectError(
            f"no dataset written to {output_dir}: {result.unfinished} of {len(pending)} attempts did not finish "
            f"({result.user_errors} failed in the user simulator, {teacher_errors} in the teacher; last error: "
            f"{result.last_error}). Fix the endpoint and rerun the same command (finished attempts are kept)."
        )
    if len(dataset) == 0:
        raise CollectError(
            f"no episode in {output_dir} reached reward >= {args.min_reward} with well-formed tool calls "
            f"({dict(result.counts)}); no dataset was written. Check the teacher, or lower --min_reward."
        )
    result.hub_path = str(export_dataset(dataset, args.hub_dir, name, info, output_dir))
    result.seconds = round(time.perf_counter() - start, 3)
    logger.info(
        "%d rows over %d covered tasks in %s (hub: %s); %s",
        len(dataset),
        len(result.covered_tasks),
        result.dataset_dir,
        result.hub_path,
        dict(result.counts),
    )
    return result


def _write_dataset(
    output_dir: Path,
    attempts: dict[tuple[str, int], dict[str, Any]],
    env: RunEnv,
    args: CollectArguments,
    settings: dict[str, Any],
    split: Split,
    result: CollectResult,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    rows, counts = build_rows(attempts, lambda key: env.env_of(key).tools, args.min_reward, args.deduplicate)
    dataset = rows_to_dataset(rows)
    result.counts = dict(counts)
    result.covered_tasks = covered_tasks(dataset) if len(dataset) else []
    if len(dataset):
        save_dataset_atomic(dataset, output_dir / DATASET_DIR)
    else:  # never an empty dataset on disk (datasets cannot even load one back); nor a stale one of other settings
        shutil.rmtree(output_dir / DATASET_DIR, ignore_errors=True)
    info = {
        "settings": settings,
        **settings,
        "domains": [member.spec.name for member in env.members],
        "split": split.name,
        "tasks": result.tasks,
        "attempts_per_task": args.attempts,
        "attempts_finished": len(attempts),
        "min_reward": args.min_reward,
        "deduplicate": args.deduplicate,
        "counts": dict(counts),
        "covered_tasks": result.covered_tasks,
        "max_turns": args.max_turns,
        "max_tool_errors": args.max_tool_errors,
    }
    write_json_atomic(output_dir / INFO_FILE, info)
    return dataset, info


# ------------------------------------------------------------------------------------------------ loading


def _readable(path: str | os.PathLike[str], load: Any, *args: Any, **kwargs: Any) -> datasets.Dataset:
    """``load(...)``; a corrupt or truncated .arrow / .parquet file becomes one ``CollectError`` naming the dataset."""
    import pyarrow

    empty = CollectError(f"--dataset_path {path}: the dataset is empty (0 rows): nothing to train on")
    try:
        dataset = load(*args, **kwargs)
        dataset.data.validate(full=True)  # damage inside the record batches, not only in their headers
    except IndexError:  # datasets' load_from_disk of a directory saved with 0 rows: it holds no data file
        raise empty from None
    except (pyarrow.ArrowException, OSError, ValueError) as err:
        message = " ".join(str(err).split()) or type(err).__name__
        raise CollectError(f"--dataset_path {path}: the dataset files are corrupt or unreadable ({message})") from None
    if len(dataset) == 0:
        raise empty
    return dataset


def collection_domains(path: str | os.PathLike[str], hub_dir: str | os.PathLike[str] = "hub") -> list[str] | None:
    """The domains a collection (or its local-hub export) recorded in its ``collect_info.json``: the legacy domain's
    for one written before domains were recorded, None for a dataset no collection wrote (nothing to compare)."""
    from tau2_rl.domains import legacy_domain

    for candidate in (Path(path), Path(hub_dir) / HUB_DATASETS_DIR / str(path)):
        info_path = candidate / INFO_FILE
        if candidate.is_dir() and info_path.is_file():
            try:
                info = json.loads(info_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None  # unreadable: the rows' task ids are still checked
            if not isinstance(info, dict):
                return None
            domains = info.get("domains")
            if domains is None:
                return [legacy_domain().name]
            return [str(d) for d in domains] if isinstance(domains, list) else None
    return None


def load_trajectories(path: str | os.PathLike[str], hub_dir: str | os.PathLike[str] = "hub") -> datasets.Dataset:
    """A trajectory dataset from a collection directory, a ``save_to_disk`` directory, a local-hub dataset directory
    (``data/*.parquet``) or a dataset name in ``<hub_dir>/datasets``."""
    candidates = [Path(path), Path(hub_dir) / HUB_DATASETS_DIR / str(path)]
    for candidate in candidates:
        if not candidate.is_dir():
            continue
        if (candidate / DATASET_DIR / "state.json").is_file():
            candidate = candidate / DATASET_DIR
        if (candidate / "state.json").is_file():
            return _readable(path, datasets.load_from_disk, str(candidate))
        shards = sorted((candidate / "data").glob("*.parquet"))
        if shards:
            files = [str(s) for s in shards]
            return _readable(path, datasets.load_dataset, "parquet", data_files=files, split="train")
    raise CollectError(
        f"--dataset_path {path}: no trajectory dataset there (expected a collection directory, a save_to_disk "
        f"directory, a directory with data/*.parquet, or a name in {Path(hub_dir) / HUB_DATASETS_DIR})"
    )


# ------------------------------------------------------------------------------------------------ τ² results files

RESULTS_TEACHER = "tau2_results"
"""``--teacher tau2_results``: the teacher is what τ² results files recorded (``--results_files``)."""


def collect_from_results(args: CollectArguments, env: RunEnv | None = None) -> CollectResult:
    """Teacher rows from τ² results files (``tau2_rl.data.tau2_results``): each conversation replayed and re-scored,
    kept by its re-scored reward (``--min_reward``), deduplicated, the test tasks of the split refused unless
    ``--allow_test_tasks``, written as collected attempts are (attempt files, dataset, hub export) with the file it
    came from. A row holds the agent's view only, under the system prompt and tools of ``--protocol`` (the user's
    own calls and their results are never in it)."""
    from tau2_rl.data.tau2_results import ResultsFileError, read_results
    from tau2_rl.rewards.outcome import RewardTermError

    start = time.perf_counter()
    paths = [path for path in (args.results_files or "").split(",") if path.strip()]
    if not paths:
        raise CollectError("--teacher tau2_results reads τ² results files: pass --results_files FILE[,FILE...]")
    try:
        env = env or run_env(args.domain_specs(), args.data_dirs(), args.env_config())
    except ValueError as err:
        raise CollectError(str(err)) from None
    if len(env.members) != 1:
        raise CollectError("--teacher tau2_results: a results file holds one domain; pass that one as --domain")
    member = env.members[0]
    split = run_split(env, args.split, args.split_file)
    wanted = parse_task_list(args.tasks)
    if wanted is not None:
        select_tasks(wanted, split, env.task_keys, allow_test_tasks=True)  # unknown ids: one line
    try:
        judge = args.judge()
    except ValueError as err:
        raise CollectError(str(err)) from None
    read = []
    bar = tqdm(desc="replay results", unit="conversation", disable=not args.progress)
    try:
        for path in paths:
            path = path.strip()
            try:
                results = read_results(path, domain=member.spec.name, data_dir=args.data_dir, task_set=args.task_set,
                                       judge=judge, flag="--results_files", on_progress=bar.update)  # fmt: skip
            except ResultsFileError as err:
                for refusal in err.refused:
                    logger.warning("not replayed: %s", refusal.line(path))
                raise CollectError(str(err)) from None
            except RewardTermError as err:
                raise CollectError(f"--results_files {path}: {err}") from None
            for refusal in results.refused:
                logger.warning("not replayed: %s", refusal.line(path))
            logger.info("%s", results.summary())
            read.append(results)
    finally:
        bar.close()

    output_dir = Path(args.output_dir) if args.output_dir else default_output_dir(args, split.name)
    name = args.dataset_name or output_dir.name
    ensure_writable(args.hub_dir)
    claim_hub_dataset(args.hub_dir, name, output_dir, overwrite=args.overwrite_hub)
    output_dir.mkdir(parents=True, exist_ok=True)
    settings = {**_settings(args), "teacher_model": "", "user_simulator": "recorded", "user_model": "",
                "results": [results.sha256 for results in read]}  # fmt: skip
    _check_resume(output_dir, settings, load_attempts(output_dir))
    attempts: dict[tuple[str, int], dict[str, Any]] = {}
    numbers: Counter = Counter()
    refused: Counter = Counter()
    tasks: list[str] = []
    for results in read:
        refused.update(refusal.kind for refusal in results.refused)
        for replayed in results.replayed:
            key = env.key(replayed.episode.task)
            if wanted is not None and key not in wanted:
                refused["not in --tasks"] += 1
                continue
            if key in split.test and not args.allow_test_tasks:
                refused["test_task"] += 1  # the leak guard
                continue
            attempt = numbers[key]
            numbers[key] += 1
            payload = attempt_payload(replayed.record, attempt, settings, member.tools)
            payload["messages"] = [{"role": "system", "content": member.system_prompt}, *payload["messages"][1:]]
            source = {"file": results.path, "sha256": results.sha256, "simulation_id": replayed.simulation_id,
                      "simulation_index": replayed.index}  # fmt: skip
            payload.update(teacher_model=results.agent_model, user_model=results.user_model, source=source)
            write_attempt(output_dir, payload)
            attempts[(key, attempt)] = payload
            tasks += [key] if key not in tasks else []
    result = CollectResult(output_dir=str(output_dir), dataset_dir=str(output_dir / DATASET_DIR), hub_path=None,
                           tasks=sorted(tasks, key=task_sort_key), played=len(attempts))  # fmt: skip
    if refused["test_task"] and not attempts:
        raise CollectError(
            f"every conversation that replayed is on a test task of split {split.name!r} ({refused['test_task']}); "
            "training on them leaks the test set. Pass --allow_test_tasks to do it anyway."
        )
    if refused["test_task"]:
        logger.warning("%d conversations on test tasks of split %r left out (the leak guard; --allow_test_tasks "
                       "keeps them)", refused["test_task"], split.name)  # fmt: skip
    dataset, info = _write_dataset(output_dir, attempts, env, args, settings, split, result)
    info["not_replayed"] = {kind: n for kind, n in refused.items() if n}
    info["results_files"] = [
        {"file": r.path, "sha256": r.sha256, "agent_model": r.agent_model, "user_model": r.user_model,
         "domain": r.domain, "release": r.release, "replayed": len(r.replayed), "refused": len(r.refused)}
        for r in read
    ]  # fmt: skip
    write_json_atomic(output_dir / INFO_FILE, info)
    if len(dataset) == 0:
        raise CollectError(
            f"no conversation of {', '.join(paths)} reached reward >= {args.min_reward} ({dict(result.counts)}); no "
            "dataset was written. Lower --min_reward to keep failures."
        )
    result.hub_path = str(export_dataset(dataset, args.hub_dir, name, info, output_dir))
    result.counts = {**result.counts, **{f"not_replayed:{k}": n for k, n in refused.items() if n}}
    result.seconds = round(time.perf_counter() - start, 3)
    logger.info("%d rows over %d covered tasks in %s (hub: %s); %s", len(dataset), len(result.covered_tasks),
                result.dataset_dir, result.hub_path, dict(result.counts))  # fmt: skip
    return result
