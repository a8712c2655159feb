"""Optional dependencies: one place that says which flag needs which package and how to install it.

The base install (``requirements.txt``) runs everything on CPU; vLLM and DeepSpeed come from
``requirements-gpu.txt``. Configs only *record* a choice such as ``use_vllm: true`` (so a GPU recipe parses and its
cross-field checks run on any machine); the package is required where a run actually starts, with one line that
names the flag and the install command. Nothing here imports an optional package: ``find_spec`` only looks.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from tau2_rl.run.deepspeed_cpu import check_deepspeed_cpu_launch

OPTIONAL_PACKAGES: dict[str, dict[str, str]] = {
    "vllm": {"name": "vLLM", "install": "pip install -r requirements-gpu.txt (vllm==0.31.0)"},
    "deepspeed": {"name": "DeepSpeed", "install": "pip install -r requirements-gpu.txt (deepspeed==0.19.8)"},
}


class MissingDependencyError(ValueError):
    """An optional package a flag needs is not installed (a ValueError: the scripts print it as one line)."""


def is_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, flag: str) -> None:
    """Fails at once, naming ``flag`` and the install command, when ``module`` is not importable."""
    if module not in OPTIONAL_PACKAGES:
        raise KeyError(f"unknown optional package {module!r}; known: {sorted(OPTIONAL_PACKAGES)}")
    if not is_installed(module):
        info = OPTIONAL_PACKAGES[module]
        raise MissingDependencyError(f"{flag} needs {info['name']}, which is not installed: {info['install']}")


def uses_deepspeed(training_args: Any) -> bool:
    """DeepSpeed is asked for by ``--deepspeed`` or by an accelerate config (``accelerate launch`` sets the env)."""
    env_flag = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes")
    return bool(getattr(training_args, "deepspeed", None)) or env_flag


def require_for_training(training_args: Any) -> None:
    """What a training run's settings need beyond the base install; called before any model is loaded."""
    if getattr(training_args, "use_vllm", False):
        require("vllm", "--use_vllm")
    if uses_deepspeed(training_args):
        flag = "--deepspeed" if getattr(training_args, "deepspeed", None) else "a DeepSpeed accelerate config"
        require("deepspeed", flag)
        check_deepspeed_cpu_launch(training_args)  # no GPU: the two flags ZeRO on CPU needs
