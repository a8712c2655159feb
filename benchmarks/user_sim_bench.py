"""Benchmark: one wave of LLM-user replies, concurrent versus one at a time, against a local 200 ms stub endpoint.

64 episodes each need one reply from an OpenAI-compatible server on 127.0.0.1 that answers after a fixed delay
(``tests/openai_stub_server.py``), as a busy vLLM server would. The same wave runs with ``concurrency=64`` and with
``concurrency=1``; the speed-up is printed last (target: at least 10x). Runs offline in about 15 s:

    python benchmarks/user_sim_bench.py [--episodes 64] [--delay 0.2]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the package and the stub server, when run as a script

from openai_stub_server import StubServer  # noqa: E402

from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.envs.episode import DomainEnv, Episode  # noqa: E402
from tau2_rl.envs.users.llm import LLMUser  # noqa: E402

AIRLINE = get_domain("airline")

logger = logging.getLogger(__name__)


def make_wave(env: DomainEnv, count: int) -> list[Episode]:
    """Fresh episodes waiting on their user (the agent's greeting), over the first tasks of the domain."""
    task_ids = list(env.domain.tasks)
    return [env.reset(task_ids[i % len(task_ids)], seed=i) for i in range(count)]


def timed_wave(server: StubServer, env: DomainEnv, count: int, concurrency: int) -> float:
    """Wall seconds for one ``reply_batch`` of ``count`` episodes; checks every episode got a reply."""
    with LLMUser(base_url=server.base_url, model=server.model, concurrency=concurrency, timeout=30.0) as user:
        user.reply(make_wave(env, 1)[0])  # starts the loop thread and a connection outside the measurement
        episodes = make_wave(env, count)
        start = time.perf_counter()
        replies = user.reply_batch(episodes)
        elapsed = time.perf_counter() - start
        failed = [reply.error for reply in replies if reply.error is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} replies failed, e.g. {failed[0]}")
        stats = user.stats()
    print(
        f"concurrency={concurrency:>3}: {count} replies in {elapsed:6.2f} s "
        f"(latency p50 {stats['latency_p50']:.3f} s, p99 {stats['latency_p99']:.3f} s, "
        f"server max in flight {server.max_in_flight})"
    )
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64, help="Episodes in the wave (one reply each).")
    parser.add_argument("--delay", type=float, default=0.2, help="Seconds the stub server takes per reply.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    env = DomainEnv(AIRLINE)
    with StubServer("slow", delay_s=args.delay) as server:
        server.reset_counters()
        concurrent = timed_wave(server, env, args.episodes, concurrency=args.episodes)
        server.reset_counters()
        sequential = timed_wave(server, env, args.episodes, concurrency=1)
    print(f"concurrent wall time: {concurrent:.2f} s")
    print(f"sequential wall time: {sequential:.2f} s")
    print(f"speed-up (sequential / concurrent): {sequential / concurrent:.1f}x")


if __name__ == "__main__":
    main()
