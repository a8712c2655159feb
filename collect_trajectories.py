"""Collect teacher trajectories on τ²-bench's domains into an HF dataset (see tau2_rl/data/collect.py).

    # the embedded default: the oracle (gold actions) on the covered train tasks of the seed split, scripted user
    python collect_trajectories.py
    # an LLM teacher behind an OpenAI-compatible endpoint, 8 attempts per task, LLM user simulator
    python collect_trajectories.py --teacher openai --teacher_base_url http://localhost:8000/v1 \
        --teacher_model Qwen/Qwen2.5-72B-Instruct-AWQ --attempts 8 \
        --user_simulator llm --user_base_url http://localhost:8001/v1 --user_model Qwen/Qwen2.5-72B-Instruct-AWQ
    # τ²'s own results files as the teacher: every conversation replayed and re-scored, the successes kept
    python collect_trajectories.py --domain telecom --teacher tau2_results --results_files results.json

Rerunning the same command resumes: finished (task, attempt) pairs are skipped. Any field of ``CollectArguments``
can be given as a flag or in a YAML file passed with ``--config``.
"""

from __future__ import annotations

import json
import logging
import sys

from trl import TrlParser

from tau2_rl.configs import CollectArguments
from tau2_rl.data.collect import CollectError, collect
from tau2_rl.envs.splits import SplitError
from tau2_rl.envs.users.llm import EndpointUnreachableError
from tau2_rl.rewards.judge import JudgeError
from tau2_rl.run.cli import exit_with_error, parse_or_exit, run_main
from tau2_rl.run.hub import HubError


def main(args: CollectArguments) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    result = collect(args)
    print(json.dumps(result.to_dict(), indent=2))


PROG = "collect_trajectories.py"
INPUT_ERRORS = (CollectError, HubError, SplitError, EndpointUnreachableError, ValueError)


def cli(argv: list[str] | None = None) -> None:
    """The command line: bad input exits with status 2 and one line naming the flag, file or field; a judge that
    kept failing (an endpoint, not the input) exits 1 in one line, the trajectories collected before it kept (a rerun
    resumes)."""
    try:
        run_main(lambda: main(*parse_or_exit(TrlParser((CollectArguments,)), argv, PROG)), INPUT_ERRORS, PROG)
    except JudgeError as err:
        exit_with_error(str(err), code=1, prog=PROG)


if __name__ == "__main__":
    cli()
