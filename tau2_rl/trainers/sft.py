"""SFT on teacher trajectories: validation, Render-Twice-Diff tokenisation, truncation report, accuracy, export.

``prepare_sft_dataset`` turns a trajectory dataset (``tau2_rl.data.collect``) into what TRL's ``SFTTrainer`` trains
on: pre-tokenised ``input_ids`` with ``assistant_masks`` (TRL turns the mask into ``labels`` = -100 outside the
assistant tokens). The masks come from ``tau2_rl.render.assistant_mask_rows``, the same code that gives the RL
rollouts their environment tokens, so an SFT row is token for token what a rollout of the same conversation holds.
Truncation to ``max_length`` happens here (TRL's own truncation then has nothing left to do), so that the report says
exactly how many examples were cut and how many lost every assistant token (dropped).

Bad input fails with a ``SFTDataError`` that names the row or the flag: missing columns, a malformed message or tool
call, test tasks without ``--allow_test_tasks``, a dataset left empty by the filters or by truncation.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from trl import SFTTrainer

from tau2_rl.data.collect import REQUIRED_COLUMNS, decode_rows, task_sort_key
from tau2_rl.envs.splits import Split
from tau2_rl.envs.tool_calls import TOOL_CALL_OPEN
from tau2_rl.render import TemplateNotPrefixPreserving, UnmaskableTurn, assistant_mask_rows, trained_turns
from tau2_rl.run.hub import model_card as hub_model_card
from tau2_rl.run.hub import record_revision, revision_name
from tau2_rl.run.sharding import ShardedLaunch
from tau2_rl.trainers.fused_head import score_labelled_positions_on_cpu

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
REPORT_FILE = "sft_data_report.json"


class ShardedSFTTrainer(ShardedLaunch, SFTTrainer):
    """TRL's ``SFTTrainer``; what changes: the accelerator (FSDP2 on CPU really shards, a launch that would silently
    not shard is refused: ``tau2_rl.run.sharding.ShardedLaunch``) and, on CPU, the fused LM head scores only the
    assistant tokens (``tau2_rl.trainers.fused_head``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        score_labelled_positions_on_cpu()
        super().__init__(*args, **kwargs)


class SFTDataError(ValueError):
    """A trajectory dataset SFT cannot use; the message names the row, column or flag."""


@dataclass
class SFTDataReport:
    """What ``prepare_sft_dataset`` made of a trajectory dataset."""

    conversations: int = 0
    rows: int = 0
    per_turn_conversations: int = 0
    per_turn_rows: int = 0
    truncated: int = 0
    dropped_fully_masked: int = 0
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    tokens: int = 0
    assistant_tokens: int = 0
    longest: int = 0
    filtered_out: dict[str, int] = field(default_factory=dict)
    tasks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        text = (
            f"{self.conversations} conversations over {len(self.tasks)} tasks → {self.rows} rows, "
            f"{self.tokens} tokens ({self.assistant_tokens} trained), longest {self.longest}"
        )
        if self.max_length is not None:
            text += (
                f"; max_length {self.max_length} ({self.truncation_mode}) truncated {self.truncated} of "
                f"{self.rows + self.dropped_fully_masked} examples, dropped {self.dropped_fully_masked} left with no "
                "assistant token"
            )
        if self.per_turn_rows:
            text += f"; {self.per_turn_rows} per-turn rows from {self.per_turn_conversations} conversations"
        return text


# ------------------------------------------------------------------------------------------------ validation


def validate_columns(dataset: datasets.Dataset) -> None:
    missing = [name for name in REQUIRED_COLUMNS if name not in dataset.column_names]
    if missing:
        raise SFTDataError(
            f"the trajectory dataset lacks the required column(s) {missing} (it has {dataset.column_names}); expected "
            f"{list(REQUIRED_COLUMNS)} as written by collect_trajectories.py"
        )


def _where(row: int, task_id: Any, message: int | None = None) -> str:
    where = f"row {row} (task {task_id})"
    return where if message is None else f"{where}, message {message}"


def normalize_messages(messages: Any, row: int, task_id: Any) -> list[dict[str, Any]]:
    """Checks one conversation and returns it with tool-call arguments as objects (a JSON-string is decoded).

    A malformed tool call (no function name, arguments that are not a JSON object, or a raw ``<tool_call>`` block
    left in the text because it did not parse) is an error naming the row and message.
    """
    if not isinstance(messages, list) or not messages:
        raise SFTDataError(f"{_where(row, task_id)}: 'messages' must be a non-empty list of messages")
    result = []
    for index, message in enumerate(messages):
        where = _where(row, task_id, index)
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else type(message).__name__
            raise SFTDataError(f"{where}: expected a message with a role in {list(ROLES)}, got {role!r}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise SFTDataError(f"{where}: 'content' must be a string, got {type(content).__name__}")
        message = dict(message)
        if message["role"] == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                message["tool_calls"] = _normalize_calls(calls, where)
            if not message.get("tool_calls") and TOOL_CALL_OPEN in (content or ""):
                raise SFTDataError(
                    f"{where}: assistant turn with a malformed tool call (a raw {TOOL_CALL_OPEN} block that did not "
                    "parse); drop the row or re-collect it"
                )
        result.append(message)
    return result


def _normalize_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise SFTDataError(f"{where}: malformed tool call: 'tool_calls' must be a list, got {type(calls).__name__}")
    normalized = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise SFTDataError(
                f"{where}: malformed tool call {k}: expected {{'type': 'function', 'function': {{...}}}}"
            )
        name, arguments = function.get("name"), function.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise SFTDataError(f"{where}: malformed tool call {k}: the function has no name")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as err:
                raise SFTDataError(
                    f"{where}: malformed tool call {k} ({name}): arguments are not JSON: {err}"
                ) from err
        if not isinstance(arguments, dict):
            raise SFTDataError(f"{where}: malformed tool call {k} ({name}): arguments must be a JSON object")
        normalized.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return normalized


# ------------------------------------------------------------------------------------------------ preparation


def select_rows(
    rows: list[dict[str, Any]],
    *,
    tasks: Sequence[str] | None = None,
    min_reward: float | None = None,
    split: Split | None = None,
    allow_test_tasks: bool = False,
) -> tuple[list[tuple[int, dict[str, Any]]], dict[str, int]]:
    """(row index, row) pairs that pass the filters, and how many each filter removed. Test tasks of ``split`` are an
    error unless ``allow_test_tasks`` (checked after the ``tasks`` filter, so selecting train tasks out of a mixed
    dataset is fine)."""
    counts = {"tasks": 0, "min_reward": 0}
    wanted = set(tasks) if tasks is not None else None
    selected = []
    for index, row in enumerate(rows):
        task_id = str(row["task_id"])
        if wanted is not None and task_id not in wanted:
            counts["tasks"] += 1
            continue
        reward = row.get("reward")
        if min_reward is not None and reward is not None and float(reward) < min_reward:
            counts["min_reward"] += 1
            continue
        selected.append((index, row))
    if split is not None and not allow_test_tasks:
        leaked = sorted({str(row["task_id"]) for _, row in selected if str(row["task_id"]) in split.test})
        if leaked:
            first = next(index for index, row in selected if str(row["task_id"]) in leaked)
            raise SFTDataError(
                f"the dataset holds test tasks {leaked} of split {split.name!r} (first at row {first}); training on "
                "them leaks the test set. Select other tasks with --tasks, or pass --allow_test_tasks."
            )
    return selected, counts


def _truncate(ids: list[int], mask: list[int], max_length: int | None, mode: str) -> tuple[list[int], list[int]]:
    if max_length is None or len(ids) <= max_length:
        return ids, mask
    if mode == "keep_start":
        return ids[:max_length], mask[:max_length]
    if mode == "keep_end":
        return ids[-max_length:], mask[-max_length:]
    raise SFTDataError(f"--truncation_mode must be 'keep_start' or 'keep_end', got {mode!r}")


def prepare_sft_dataset(
    dataset: datasets.Dataset,
    tokenizer: Any,
    *,
    tasks: Sequence[str] | None = None,
    min_reward: float | None = 1.0,
    split: Split | None = None,
    allow_test_tasks: bool = False,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
) -> tuple[datasets.Dataset, SFTDataReport]:
    """Validates, filters and tokenises trajectories → (dataset of ``input_ids`` + ``assistant_masks``, report)."""
    validate_columns(dataset)
    rows = decode_rows(dataset)
    selected, filtered = select_rows(
        rows, tasks=tasks, min_reward=min_reward, split=split, allow_test_tasks=allow_test_tasks
    )
    if not selected:
        raise SFTDataError(
            f"the trajectory dataset is empty after filtering ({len(rows)} rows; removed by --tasks: "
            f"{filtered['tasks']}, by --min_reward {min_reward}: {filtered['min_reward']})"
        )
    report = SFTDataReport(max_length=max_length, truncation_mode=truncation_mode, filtered_out=filtered)
    columns: dict[str, list] = {"input_ids": [], "assistant_masks": [], "task_id": [], "source_row": []}
    for index, row in selected:
        task_id = row["task_id"]
        messages = normalize_messages(row["messages"], index, task_id)
        tools = row.get("tools") or None
        if not trained_turns(messages):
            raise SFTDataError(f"{_where(index, task_id)}: no assistant turn after a user message: nothing to train")
        try:
            masks = assistant_mask_rows(tokenizer, messages, tools)
        except (TemplateNotPrefixPreserving, UnmaskableTurn) as err:
            raise SFTDataError(f"{_where(index, task_id)}: cannot mask the assistant tokens: {err}") from err
        except Exception as err:  # the chat template itself failed (jinja raise_exception, missing variables...)
            raise SFTDataError(f"{_where(index, task_id)}: the chat template failed to render: {err}") from err
        report.conversations += 1
        if masks.per_turn:
            report.per_turn_conversations += 1
            report.per_turn_rows += len(masks.rows)
        for masked in masks.rows:
            ids, mask = _truncate(masked.input_ids, masked.assistant_masks, max_length, truncation_mode)
            if len(ids) < len(masked.input_ids):
                report.truncated += 1
            if not any(mask):
                report.dropped_fully_masked += 1
                continue
            columns["input_ids"].append(ids)
            columns["assistant_masks"].append(mask)
            columns["task_id"].append(str(task_id))
            columns["source_row"].append(index)
            report.rows += 1
            report.tokens += len(ids)
            report.assistant_tokens += sum(mask)
            report.longest = max(report.longest, len(ids))
    report.tasks = sorted(set(columns["task_id"]), key=task_sort_key)
    if report.per_turn_rows:
        logger.warning(
            "the chat template is not prefix-preserving: %d conversations were split into %d per-turn rows (one per "
            "assistant turn, each with the history the template renders for it)",
            report.per_turn_conversations,
            report.per_turn_rows,
        )
    if report.truncated:
        logger.warning(
            "max_length %s truncated %d examples (%s); %d lost every assistant token and were dropped",
            max_length,
            report.truncated,
            truncation_mode,
            report.dropped_fully_masked,
        )
    if not report.rows:
        raise SFTDataError(
            f"every example lost all its assistant tokens to --max_length {max_length} ({truncation_mode}); the "
            f"longest example has {max(len(i) for i in columns['input_ids']) if columns['input_ids'] else 'n/a'} "
            "tokens: raise --max_length"
        )
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "assistant_masks": datasets.List(datasets.Value("int8")),
            "task_id": datasets.Value("string"),
            "source_row": datasets.Value("int64"),
        }
    )
    return datasets.Dataset.from_dict(columns, features=features), report


def trainer_columns(dataset: datasets.Dataset) -> datasets.Dataset:
    """Only what ``SFTTrainer`` reads (it builds ``labels`` from ``assistant_masks``)."""
    return dataset.select_columns(["input_ids", "assistant_masks"])


# ------------------------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def teacher_forced_accuracy(model: Any, dataset: datasets.Dataset, max_examples: int | None = None) -> dict[str, Any]:
    """Share of assistant tokens the model predicts exactly (argmax) given the true prefix, over the dataset."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    per_task: dict[str, list[int]] = {}
    count = len(dataset) if max_examples is None else min(len(dataset), max_examples)
    for index in range(count):
        example = dataset[index]
        ids = torch.tensor([example["input_ids"]], device=device)
        mask = torch.tensor(example["assistant_masks"][1:], device=device, dtype=torch.bool)
        logits = model(input_ids=ids).logits[0, :-1]
        hits = (logits.argmax(-1) == ids[0, 1:]) & mask
        n_correct, n_total = int(hits.sum()), int(mask.sum())
        correct += n_correct
        total += n_total
        task = per_task.setdefault(str(example.get("task_id", index)), [0, 0])
        task[0] += n_correct
        task[1] += n_total
    if was_training:
        model.train()
    return {
        "accuracy": correct / total if total else 0.0,
        "tokens": total,
        "per_task": {k: v[0] / v[1] if v[1] else 0.0 for k, v in per_task.items()},
    }


# ------------------------------------------------------------------------------------------------ export


SFT_CARD_TEXT = (
    "Policy fine-tuned with SFT on teacher trajectories of the τ²-bench {domains} (tau2_rl on TRL's "
    "SFTTrainer, assistant-token masks by Render-Twice-Diff). Use it as `--model_name_or_path` of train_grpo.py."
)


def model_card(run_name: str, step: int, info: dict[str, Any], hub_dir: str | os.PathLike[str] = "hub") -> str:
    """The local hub's card (``run.hub.model_card``) for an SFT revision: tagged ``sft``, with its data summary."""
    return hub_model_card(run_name, step, info, hub_dir, method="sft", text=SFT_CARD_TEXT)


def export_model_dir(
    model_dir: str | os.PathLike[str], hub_dir: str | os.PathLike[str], run_name: str, step: int, info: dict
) -> Path:
    """Copies the files of a saved model directory to ``<hub_dir>/<run_name>/step-<N>`` (the local-hub layout of
    ``tau2_rl.run.hub``: written to a temporary sibling, renamed into place, ``refs.json`` replaced atomically)."""
    run_dir = Path(hub_dir) / run_name
    final = run_dir / revision_name(step)
    tmp = run_dir / f".{revision_name(step)}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        for path in Path(model_dir).iterdir():
            if path.is_file():
                shutil.copy2(path, tmp / path.name)
        (tmp / "README.md").write_text(model_card(run_name, step, info, hub_dir), encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record_revision(run_dir, final.name, step, model_dir)  # the SFT run's output_dir wrote it
    return final
