"""Temporary files for atomic writes that end up with the mode a plain ``open`` would give them.

``tempfile.mkstemp`` creates its file 0600 whatever the umask, so a file written through it and ``os.replace``
(results.json, refs.json, run_config.json...) was readable by its owner only, while ``summary.md`` next to it was
0644: on a shared machine others could not read results or resolve hub ids. transformers 5.17's ``save_pretrained``
writes ``model.safetensors`` 0600 too; ``honour_umask`` fixes a saved directory's modes before it is published.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def current_umask() -> int:
    """The process umask (read by setting and restoring it: there is no getter before Python 3.13's ``os``)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def mkstemp_honouring_umask(directory: Path, prefix: str, suffix: str = "") -> tuple[int, str]:
    """``tempfile.mkstemp`` in ``directory``, its mode set to 0666 less the umask (what ``open(path, "w")`` gives)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd, tmp


def honour_umask(path: str | os.PathLike[str]) -> None:
    """Gives every file under ``path`` (or ``path`` itself) the mode a plain ``open`` would under the umask."""
    mode = 0o666 & ~current_umask()
    root = Path(path)
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    for file in files:
        try:
            if file.stat().st_mode & 0o777 != mode:
                os.chmod(file, mode)
        except OSError:  # gone meanwhile (another rank's temporary file): nothing to publish
            continue
