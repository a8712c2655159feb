"""A checkpoint is whole or it is not resumed: a seal written last, a check of what a resume would load, and file
modes that honour the umask.

Why: the HF Trainer resumes ``get_last_checkpoint``, the highest ``checkpoint-N`` directory, whatever it holds. A rank
killed mid-save leaves ``checkpoint-N/`` with an empty ``pytorch_model_fsdp_0/``, a full disk leaves a truncated
``model.safetensors``, and every rerun then dies in a deep traceback on that same directory. So:

1. ``CheckpointSeal`` (a callback): after every checkpoint save, once every rank has finished writing (a barrier),
   rank 0 writes ``checkpoint_complete.json`` into it, atomically, listing every file with its size. A checkpoint
   without the seal was never finished: ``run_config.json`` records the step after which the run seals
   (``sealed_from_step``: 0 for a fresh run; the resumed step for a run that began before seals existed, whose older
   checkpoints are checked by their contents alone).
2. ``checkpoint_problem`` checks a checkpoint before it is resumed: the seal (and each file it lists, at its size),
   ``trainer_state.json``, every safetensors file's header against its size, every ``torch.distributed.checkpoint``
   directory (FSDP's sharded model and optimizer) against its ``.metadata``, and DeepSpeed's ``latest`` tag.
3. ``newest_complete_checkpoint`` resumes the newest checkpoint that passes, logging one line for each newer one it
   skips (``skipping outputs/x/checkpoint-3: model.safetensors is truncated``); nothing is ever deleted.
4. ``files.honour_umask``: transformers 5.17's ``save_pretrained`` writes ``model.safetensors`` with mode 0600
   whatever the umask; every file a run writes gets the mode the umask gives (0644 under 022), so another account
   can load the hub on a shared disk.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from tau2_rl.files import honour_umask

logger = logging.getLogger(__name__)

SEAL_FILE = "checkpoint_complete.json"
TRAINER_STATE_FILE = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def _listing(checkpoint: Path) -> dict[str, int]:
    return {
        str(p.relative_to(checkpoint)): p.stat().st_size
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p.name != SEAL_FILE
    }


def seal_checkpoint(checkpoint: str | os.PathLike[str], global_step: int) -> Path:
    """Rank 0, after every rank wrote its part: the seal that says ``checkpoint`` is whole (files and sizes)."""
    from tau2_rl.run.hub import write_json_atomic

    checkpoint = Path(checkpoint)
    honour_umask(checkpoint)
    path = checkpoint / SEAL_FILE
    write_json_atomic(path, {"format": 1, "global_step": global_step, "files": _listing(checkpoint)})
    honour_umask(path)
    return path


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be loaded (a header that does not parse, data shorter than it says), or None."""
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                return "truncated"
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                return "truncated"
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError, UnicodeDecodeError):
        return "not a safetensors file (its header does not parse)"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    if 8 + header_len + max(ends, default=0) > size:
        return "truncated"
    return None


def dcp_problem(directory: Path) -> str | None:
    """Why a ``torch.distributed.checkpoint`` directory (FSDP's sharded state) is incomplete, or None: its
    ``.metadata`` (written last, by the coordinator) must load and name files that exist at the sizes it records."""
    metadata_file = directory / ".metadata"
    if not metadata_file.is_file():
        return "has no .metadata (the save did not finish on every rank)"
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any failure to read it means it cannot be resumed
        return f"has an unreadable .metadata ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            return f"lacks {name}"
        if file.stat().st_size < end:
            return f"has a truncated {name}"
    return None


def deepspeed_problem(checkpoint: Path) -> str | None:
    """DeepSpeed writes its shards under ``<tag>/`` and the ``latest`` file naming the tag last."""
    tags = [p for p in checkpoint.iterdir() if p.is_dir() and p.name.startswith("global_step")]
    latest = checkpoint / "latest"
    if not tags and not latest.exists():
        return None
    if not latest.is_file():
        return "has DeepSpeed shards but no 'latest' tag (the save did not finish)"
    tag_dir = checkpoint / latest.read_text(encoding="utf-8").strip()
    states = list(tag_dir.glob("*model_states.pt")) if tag_dir.is_dir() else []
    if not states:
        return f"names DeepSpeed tag {tag_dir.name} but has no model states there"
    empty = [p.name for p in tag_dir.iterdir() if p.is_file() and p.stat().st_size == 0]
    return f"has an empty {tag_dir.name}/{empty[0]}" if empty else None


def checkpoint_step(checkpoint: str | os.PathLike[str]) -> int | None:
    match = _CHECKPOINT_RE.match(Path(checkpoint).name)
    return int(match.group(1)) if match else None


def checkpoint_problem(checkpoint: str | os.PathLike[str], *, require_seal: bool = False) -> str | None:
    """Why ``checkpoint`` must not be resumed, in a few words, or None when it is whole.

    ``require_seal``: the run that wrote it seals its checkpoints, so one without a seal was cut short, even when
    rank 0 got as far as ``trainer_state.json`` (another rank's RNG state or shards may be missing). Without it (a
    checkpoint written before seals existed) the contents alone are checked."""
    checkpoint = Path(checkpoint)
    seal = checkpoint / SEAL_FILE
    listed: dict[str, int] = {}
    if seal.is_file():
        try:
            listed = json.loads(seal.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"has an unreadable {SEAL_FILE}"
    elif not (checkpoint / TRAINER_STATE_FILE).is_file():
        return f"has no {TRAINER_STATE_FILE} (the save did not finish)"
    elif require_seal:
        return f"has no {SEAL_FILE} (a process stopped before every rank had finished writing it)"
    for name, size in sorted(listed.items()):
        file = checkpoint / name
        if not file.is_file():
            return f"lacks {name}"
        if file.stat().st_size != size:
            return f"{name} is truncated" if file.stat().st_size < size else f"{name} changed since it was saved"
    state = checkpoint / TRAINER_STATE_FILE
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"has no readable {TRAINER_STATE_FILE}"
    for file in sorted(checkpoint.rglob("*.safetensors")):
        why = safetensors_problem(file)
        if why:
            return f"{file.relative_to(checkpoint)} is {why}" if why == "truncated" else f"{file.name}: {why}"
    for metadata in sorted(checkpoint.rglob(".metadata")):
        why = dcp_problem(metadata.parent)
        if why:
            return f"{metadata.parent.relative_to(checkpoint)} {why}"
    for directory in sorted(p for p in checkpoint.iterdir() if p.is_dir() and p.name.startswith("pytorch_model_fsdp")):
        if not (directory / ".metadata").is_file():  # the dirs with one were checked above
            return f"{directory.name} {dcp_problem(directory)}"
    return deepspeed_problem(checkpoint)


def checkpoints_newest_first(output_dir: str | os.PathLike[str]) -> list[Path]:
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(step, p) for p in folder.iterdir() if p.is_dir() and (step := checkpoint_step(p)) is not None]
    return [p for _, p in sorted(found, reverse=True)]


def newest_complete_checkpoint(
    output_dir: str | os.PathLike[str], sealed_from_step: int | None = None, *, report: bool = True
) -> str | None:
    """The newest ``checkpoint-N`` of ``output_dir`` that is whole; each newer one is skipped with one line
    (``report``: rank 0 says it, the other ranks decide the same in silence).

    ``sealed_from_step``: the run seals every checkpoint after that step (None: seals are not required)."""
    for checkpoint in checkpoints_newest_first(output_dir):
        step = checkpoint_step(checkpoint) or 0
        why = checkpoint_problem(checkpoint, require_seal=sealed_from_step is not None and step > sealed_from_step)
        if why is None:
            return str(checkpoint)
        if report:
            logger.warning("skipping %s: %s", checkpoint, why)
    return None


class CheckpointSeal(TrainerCallback):
    """Seals each checkpoint once every rank has written it (the last callback of a save: add it last)."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's shards are on disk
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            seal_checkpoint(checkpoint, state.global_step)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank goes on (or is killed by a stop) before the seal exists
