"""Which system prompt a policy was trained with, kept next to its weights so that evaluation prompts it the same way.

The embedded CPU default is trained and run with a one-line system prompt and no tool schemas in the prompt (the
full ~4.4k-token prompt makes every CPU step minutes long); the tools, their results, the user and the reward stay
the real ones. A real run keeps the full prompt. A policy prompted differently from its training plays from a context
it never saw, so the default-policy build and ``train_grpo.py`` write ``tau2_rl_prompt.json`` into the model
directories they produce, and ``train_grpo.py`` / ``evaluate.py`` follow it unless ``--compact_prompt`` says
otherwise. A directory without the file (any ordinary checkpoint) gets the full prompt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tau2_rl.envs.episode import DomainEnv
    from tau2_rl.envs.spec import DomainSpec

PROMPT_STYLE_FILE = "tau2_rl_prompt.json"
LEGACY_PROMPT_STYLE_FILE = "airline_rl_prompt.json"  # its name before the package's rename; still read
COMPACT, FULL = "compact", "full"


def compact_env(env: DomainEnv) -> DomainEnv:
    """Gives ``env`` its domain's one-line system prompt and no tool schemas in the prompt (the tools still run)."""
    env.system_prompt = env.spec.compact_prompt
    env.tools = []
    return env


def style_name(compact: bool) -> str:
    return COMPACT if compact else FULL


def write_prompt_style(model_dir: str | os.PathLike[str], compact: bool, specs: Sequence[DomainSpec]) -> Path:
    """Records the prompt a model in ``model_dir`` was trained with, and on which domains (``specs``), atomically."""
    path = Path(model_dir) / PROMPT_STYLE_FILE
    payload: dict[str, Any] = {"system_prompt": style_name(compact)}
    if compact and len(specs) == 1:
        payload["text"] = specs[0].compact_prompt
    elif compact and specs:
        payload["texts"] = {spec.name: spec.compact_prompt for spec in specs}
    if specs:
        payload["domains"] = [spec.name for spec in specs]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_prompt_style(model_dir: str | os.PathLike[str] | None) -> str | None:
    """``compact`` / ``full`` as recorded in ``model_dir``; None when nothing is recorded (or no directory)."""
    if model_dir is None:
        return None
    path = Path(model_dir) / PROMPT_STYLE_FILE
    if not path.is_file():
        path = Path(model_dir) / LEGACY_PROMPT_STYLE_FILE
    if not path.is_file():
        return None
    try:
        style = json.loads(path.read_text(encoding="utf-8")).get("system_prompt")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{path} is unreadable ({err}); delete it or pass --compact_prompt true/false") from None
    if style not in (COMPACT, FULL):
        raise ValueError(f"{path}: system_prompt must be {COMPACT!r} or {FULL!r}, got {style!r}")
    return style


def read_prompt_domains(model_dir: str | os.PathLike[str] | None) -> list[str] | None:
    """The domains ``model_dir``'s prompt record says the model was trained on; None when it says nothing."""
    if model_dir is None:
        return None
    for name in (PROMPT_STYLE_FILE, LEGACY_PROMPT_STYLE_FILE):
        path = Path(model_dir) / name
        if path.is_file():
            try:
                domains = json.loads(path.read_text(encoding="utf-8")).get("domains")
            except (OSError, ValueError, AttributeError):
                return None
            return [str(d) for d in domains] if isinstance(domains, list) and domains else None
    return None


def use_compact_prompt(explicit: bool | None, model_dir: str | os.PathLike[str] | None, default: bool = False) -> bool:
    """The flag when given, else what ``model_dir`` records, else ``default``."""
    if explicit is not None:
        return explicit
    recorded = read_prompt_style(model_dir)
    return default if recorded is None else recorded == COMPACT
