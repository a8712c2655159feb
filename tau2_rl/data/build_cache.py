"""Locally built artefacts cached on disk (the tiny model, the warmed default policy): never loaded half-written.

One protocol for every such build:

- a build is *complete* when its ``build_info.json`` names the same parameters and lists every file with its size,
  and they are all there at that size; anything else (missing, half-written, other parameters or builder version)
  is rebuilt;
- concurrent builders are serialised by a lock file next to the directory, and the second one reuses the first's
  build;
- the build happens in temporary siblings (``.<name>.work-*`` for scratch, ``.<name>.tmp-*`` for the result),
  ``build_info.json`` is written last, and the result is renamed into place (the previous directory moved aside
  first): a reader sees the old build or the new one, whole;
- a non-empty directory that holds no build is not replaced unless ``force``, except the files an interrupted build
  of the same kind leaves (``replaceable``); siblings left by a killed build are removed under the lock.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from filelock import FileLock

from tau2_rl.files import honour_umask

logger = logging.getLogger(__name__)

BUILD_INFO_FILE = "build_info.json"


def read_build_info(directory: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((directory / BUILD_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def is_complete_build(directory: Path, params: dict[str, Any]) -> bool:
    """True if ``directory`` holds a build with these params whose recorded files are all present and intact."""
    info = read_build_info(directory)
    if info is None or info.get("params") != params or not isinstance(info.get("files"), dict):
        return False
    files: dict[str, int] = info["files"]
    required = {"config.json", "tokenizer.json", "tokenizer_config.json"}
    if not required <= files.keys() or not any(name.endswith((".safetensors", ".bin")) for name in files):
        return False
    for name, size in files.items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def swap_into_place(tmp_dir: Path, output_dir: Path) -> None:
    """Rename ``tmp_dir`` to ``output_dir``, moving any previous directory aside first and deleting it after."""
    honour_umask(tmp_dir)  # save_pretrained writes model.safetensors 0600 whatever the umask
    old_dir: Path | None = None
    if output_dir.exists():
        old_dir = output_dir.parent / f".{output_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(output_dir, old_dir)
    os.replace(tmp_dir, output_dir)
    if old_dir is not None:
        shutil.rmtree(old_dir, ignore_errors=True)


def cached_build(
    output_dir: Path,
    params: dict[str, Any],
    build: Callable[[Path, Path], dict[str, Any]],
    *,
    what: str,
    force: bool = False,
    replaceable: Collection[str] = (),
    before_build: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """Reuses the complete build in ``output_dir`` (returns None) or makes one and returns its ``build_info``.

    ``build(work_dir, tmp_dir)`` writes the artefact's files into ``tmp_dir`` (``work_dir`` is scratch, removed
    after) and returns the build info; it must hold ``params`` and ``files`` (name → size), and gets
    ``build_seconds``. ``what`` names the artefact in the error for a foreign directory; ``before_build`` runs
    under the lock just before a build starts (the place for a "building once, this takes ..." line).
    """
    if not force and is_complete_build(output_dir, params):
        return None
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(output_dir.parent / f".{output_dir.name}.lock")):
        if not force and is_complete_build(output_dir, params):  # another process built it while we waited
            return None
        if output_dir.exists() and not force and read_build_info(output_dir) is None and any(output_dir.iterdir()):
            leftovers = {p.name for p in output_dir.iterdir()}
            if not (replaceable and leftovers <= set(replaceable)):  # not an interrupted build of ours
                raise FileExistsError(f"{output_dir} is not empty and holds no {what} build; remove it")
        for stale in output_dir.parent.glob(f".{output_dir.name}.*-*"):  # left by a killed build (we hold the lock)
            if stale.is_dir() and any(f".{kind}-" in stale.name for kind in ("work", "tmp", "old")):
                shutil.rmtree(stale, ignore_errors=True)
        if before_build is not None:
            before_build()
        start = time.perf_counter()
        work = output_dir.parent / f".{output_dir.name}.work-{uuid.uuid4().hex[:8]}"
        tmp_dir = output_dir.parent / f".{output_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            info = build(work, tmp_dir)
            info["build_seconds"] = round(time.perf_counter() - start, 3)
            # Written last: its presence (with the file sizes) is what marks a build complete.
            (tmp_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            swap_into_place(tmp_dir, output_dir)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    return info
