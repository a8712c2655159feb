"""The start of every training entry script (seed, logging, device sanity), in one place."""

from __future__ import annotations

import logging
import sys
from typing import Any

import datasets
import torch
import transformers
from transformers import set_seed


def setup_run(training_args: Any, script_logger: logging.Logger) -> None:
    """Seeds everything, routes logs to stdout at the process's log level, and refuses bf16 on a CPU-only machine."""
    set_seed(training_args.seed)
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    # Our own INFO lines ("resuming from ...", "local hub revision ...") are what a user needs to see: at the default
    # ("passive") level the main process shows them; libraries stay at their warning level.
    ours = logging.INFO if training_args.log_level == "passive" and training_args.should_log else log_level
    script_logger.setLevel(ours)
    logging.getLogger("airline_rl").setLevel(ours)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    if training_args.bf16 and not torch.cuda.is_available():
        raise SystemExit("error: --bf16 true needs a GPU; on CPU pass --bf16 false (the CPU recipes do)")
