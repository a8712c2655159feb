"""End to end, the event-driven episode loop against waves with the LLM user behind a stub server whose replies
take seeded log-normal times (slow): evaluate.py and train_grpo.py play the same episodes and train the same weights
under ``--schedule events`` and ``--schedule waves``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.openai_stub_server import StubServer
from tests.test_sharded import ONE, grpo_argv, hub_weights, max_difference, run, step_one

pytestmark = pytest.mark.slow

LATENCY = (0.05, 1.0)  # median 50 ms, σ 1: replies land in a different order than they were asked


def test_evaluate_records_the_same_samples_in_both_schedules(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tau2_rl.configs import EvalArguments
    from tau2_rl.evaluation import run_evaluation

    samples, runs = {}, {}
    with StubServer("echo", latency=LATENCY) as server:
        for mode in ("waves", "events"):
            args = EvalArguments(
                model=str(tiny_model_dir), tasks="0,18,27", num_samples=3, max_turn_tokens=8, max_new_tokens=96,
                max_turns=4, device="cpu", dtype="float32", temperature=1.0, output_dir=str(tmp_path / mode),
                progress=False, bootstrap_samples=200, protocol="tau2_rl", save_messages=True,
                user_simulator="llm", user_base_url=server.base_url, user_model=server.model, schedule=mode,
            )  # fmt: skip
            (path,) = run_evaluation(args)
            data = json.loads(path.read_text(encoding="utf-8"))
            samples[mode] = {t: [{k: v for k, v in s.items() if k != "seconds"} for s in task["samples"]]
                             for t, task in data["tasks"].items()}  # fmt: skip
            runs[mode] = data["runs"][0]
    assert samples["events"] == samples["waves"]
    assert all(s["messages"] and s["user_error"] is None for task in samples["events"].values() for s in task)
    assert runs["waves"]["schedule"]["mode"] == "waves" and runs["events"]["schedule"]["mode"] == "events"
    assert runs["events"]["waves"] > runs["waves"]["waves"]  # smaller policy calls, as replies land
    assert runs["events"]["schedule"]["user_requests_in_flight_max"] >= 2
    assert 0.0 < runs["events"]["schedule"]["agent_idle_fraction"] < 1.0


def test_train_grpo_plays_and_trains_the_same_in_both_schedules(tmp_path: Path) -> None:
    """Two steps of the quick start's recipe against the LLM user: the same episodes (token ids) and the same
    weights (the rollouts sample each turn from the episode's own generator on the prefix-reuse path)."""
    transcripts, weights = {}, {}
    with StubServer("echo", latency=LATENCY) as server:
        user = ["--user_simulator", "llm", "--user_base_url", server.base_url, "--user_model", server.model,
                "--user_timeout", "60"]  # fmt: skip
        for mode in ("waves", "events"):
            argv = grpo_argv(ONE, tmp_path, mode, 8, *user, "--schedule", mode, "--max_turns", "4")
            text = run(argv, tmp_path / f"{mode}.log", tmp_path / f"probe-{mode}")
            assert "done: 2 steps" in text
            transcripts[mode], weights[mode] = step_one(tmp_path / f"probe-{mode}"), hub_weights(tmp_path, mode)
    assert len(transcripts["events"]) == 8 and transcripts["events"] == transcripts["waves"]
    assert max_difference(weights["events"], weights["waves"]) == 0.0
