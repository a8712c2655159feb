"""Several domains in one run (issue 61.3): tasks keyed <domain>/<id>, each domain's figures apart.

``--domain airline,retail`` gives one ``MultiDomainEnv``: an evaluation plays every task of both (the oracle all
164), results.json, summary.md and the τ² export keep each domain's figures and task set apart, a GRPO batch holds
episodes of both (a group stays one task's) and its step line, TensorBoard and last line show each domain's reward.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import datasets
import pytest
from test_evaluate import load, tiny_args
from test_trainer import make_args

from tau2_rl.data import default_policy
from tau2_rl.domains import UnknownDomainError, get_domain, parse_domains
from tau2_rl.envs.agents import get_agent
from tau2_rl.envs.data import DomainDataError
from tau2_rl.envs.episode import DomainEnv, EnvConfig
from tau2_rl.envs.multi import MultiDomainEnv, run_env, run_split
from tau2_rl.envs.prompt_style import write_prompt_style
from tau2_rl.envs.protocol import tau2_reference
from tau2_rl.envs.runner import run_episodes
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.evaluation import run_evaluation
from tau2_rl.evaluation.evaluator import plan
from tau2_rl.evaluation.results import task_meta
from tau2_rl.rewards.outcome import outcome_reward
from tau2_rl.run.console import format_step_line, summary_line
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

AIRLINE, RETAIL = get_domain("airline"), get_domain("retail")


@pytest.fixture(scope="module")
def both() -> MultiDomainEnv:
    return run_env([AIRLINE, RETAIL])


def test_a_run_over_two_domains_keys_every_task_with_its_domain(both: MultiDomainEnv) -> None:
    assert [member.spec for member in both.members] == [AIRLINE, RETAIL]
    keys = both.task_keys
    assert len(keys) == 164 and keys[0] == "airline/0" and keys[50] == "retail/0"
    episode = both.reset("retail/5", seed=3)
    assert episode.task.task_id == "5" and episode.task.domain == "retail" and episode.record.task_id == "retail/5"
    prompts = {domain: both.env_of(f"{domain}/5").system_prompt for domain in ("airline", "retail")}
    assert episode.messages[0]["content"] == prompts["retail"] != prompts["airline"]
    assert both.task("airline/3").spec is AIRLINE and both.key(both.task("retail/24")) == "retail/24"
    with pytest.raises(KeyError, match="names a task <domain>/<task id>"):
        both.task("3")  # a plain id is ambiguous: both domains have a task 3
    split = run_split(both)  # each domain's own default split, keyed
    assert split.name == "seed,tau2" and len(split.test) == 10 + 40 and split.group_of("retail/5") == "unseen"
    assert split.group_of("airline/3") == run_split(DomainEnv(AIRLINE)).group_of("3")
    assert [spec.name for spec in parse_domains("airline,retail")] == ["airline", "retail"]
    with pytest.raises(UnknownDomainError, match="unknown domain 'rail'.*choose among airline, retail"):
        parse_domains("airline,rail")
    with pytest.raises(DomainDataError, match="with several domains it must be a τ²-bench checkout's data/"):
        run_env([AIRLINE, RETAIL], data_dir="/nonexistent")


def test_the_oracle_plays_all_164_tasks_in_one_evaluation_reported_per_domain(tmp_path: Path) -> None:
    args = tiny_args(tmp_path, "oracle", num_samples=1, domain="airline,retail", protocol="tau2", tasks=None)
    (path,) = run_evaluation(args)
    data = load(path)
    config, metrics = data["config"], data["metrics"]
    assert config["domain"] == "airline,retail" and set(config["tasks_sha256"]) == {"airline", "retail"}
    assert len(data["tasks"]) == 164 and metrics["pass1"]["overall"]["value"] == 1.0
    assert {d: m["pass1"]["overall"]["tasks"] for d, m in metrics["domains"].items()} == {"airline": 50, "retail": 114}
    assert data["tasks"]["retail/12"]["domain"] == "retail"
    summary = path.with_name("summary.md").read_text(encoding="utf-8")
    assert "- domains: `airline` (tasks.json sha256" in summary and "| retail | 114 | 1.000 |" in summary
    for name in ("airline", "retail"):  # each domain's release beside its task set's sha256
        assert get_domain(name).release in summary and data["config"]["domains"][name]["release"]
    # one τ² export per domain, its tasks under τ²'s own ids, read back by τ²'s own loader
    reference = tau2_reference()
    for domain, count in (("airline", 50), ("retail", 114)):
        results = reference.Results.load(path.with_name(f"tau2_results.{domain}.json"))
        assert results.info.environment_info.domain_name == domain and len(results.simulations) == count
        ids = {t.id for t in results.tasks}
        assert {s.task_id for s in results.simulations} == ids and "0" in ids


def test_the_noop_floor_is_what_tau2_gives_the_empty_conversation() -> None:
    """Retail task 12's gold writes leave the database as it was: the floor counts it, as the noop scores it."""
    env = DomainEnv(RETAIL)
    ids = list(env.domain.tasks)
    records = run_episodes(env, get_agent("noop"), get_user_simulator("scripted"), [(t, 0) for t in ids],
                           score=outcome_reward)  # fmt: skip
    passed = {r.task_id for r in records if r.reward["reward"] == 1.0}
    floor = {t for t in ids if task_meta(env.task(t), "unseen", env.base)["refusal_passes"]}
    assert floor == passed and "12" in floor and len(floor) == 7  # 5 by the old count (no write, nothing to say)
    assert env.task("12").writes
    # every term of the basis: telecom's transfer tasks meet their assertions untouched and fail ACTION (0/114);
    # mock's tasks set up by initialization, a message history or assertions alone
    for name, count in (("telecom", 0), ("mock", 1)):
        env = DomainEnv(get_domain(name))
        records = run_episodes(env, get_agent("noop"), get_user_simulator("scripted"),
                               [(t, 0) for t in env.task_keys], score=outcome_reward)  # fmt: skip
        passed = {r.task_id for r in records if r.reward["reward"] == 1.0}
        floor = {t for t in env.task_keys if task_meta(env.task(t), "unseen", env.base)["refusal_passes"]}
        assert floor == passed and len(floor) == count, name


def test_a_model_evaluated_off_its_training_domains_is_said_and_recorded(tmp_path, tiny_model_dir, caplog) -> None:
    model = tmp_path / "retail-model"
    shutil.copytree(tiny_model_dir, model)
    write_prompt_style(model, compact=False, specs=[RETAIL])
    with caplog.at_level(logging.WARNING, logger="tau2_rl.evaluation.evaluator"):
        planned = plan(tiny_args(tmp_path / "eval", model, tasks="0", num_samples=1))
    assert planned.configs[0]["trained_on"] == ["retail"] and planned.configs[0]["domain"] == "airline"
    assert "was trained on retail and is evaluated on airline" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tau2_rl.evaluation.evaluator"):
        plan(tiny_args(tmp_path / "eval2", model, tasks="0", num_samples=1, domain="retail"))
    assert "was trained on" not in caplog.text


def test_a_training_step_over_two_domains_shows_each_domains_reward(tmp_path, tiny_model, tiny_tokenizer) -> None:
    envs = []
    for spec in (AIRLINE, RETAIL):
        env = DomainEnv(spec, config=EnvConfig(max_turns=3))  # shrunk from 30
        env.system_prompt, env.tools = spec.compact_prompt, []  # the tiny model's short prompt, as the quick starts
        envs.append(env)
    env = MultiDomainEnv(envs)
    rows = [{"prompt": [{"role": "system", "content": env.env_of(t).system_prompt}], "task_id": t}
            for t in ("airline/3", "retail/24")]  # fmt: skip
    args = make_args(tmp_path, "joint", tiny_tokenizer, per_device_train_batch_size=8, shuffle_dataset=False)
    trainer = MultiTurnGRPOTrainer(
        model=tiny_model,
        args=args,
        env=env,
        user=get_user_simulator("scripted"),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["domain/airline/episodes"] == logs["domain/retail/episodes"] == 4  # a group (4) of each
    played = {episode.record.task_id for episode in trainer._rollout_episodes}
    assert played == {"airline/3", "retail/24"}
    line = format_step_line(1, 1, logs, 1.0)
    assert f"airline {logs['domain/airline/outcome_reward']:.3f} · retail" in line
    history = [
        {
            "step": s,
            "loss": 0.0,
            "episode/outcome_reward": 0.5,
            "domain/airline/outcome_reward": a,
            "domain/retail/outcome_reward": r,
        }
        for s, (a, r) in enumerate([(0.0, 0.5), (0.5, 0.5), (1.0, 0.25)])
    ]
    last = summary_line(history, str(tmp_path), None, None, None)
    assert "first → last quarter; airline +1.000; retail -0.250)" in last


def test_the_default_policy_of_two_domains_names_its_domains_and_tasks(tmp_path: Path) -> None:
    tasks = ["airline/3", "retail/24"]
    directory = default_policy.default_policy_dir(tmp_path, tasks, 96, [AIRLINE, RETAIL])
    assert directory.name == "default-policy-airline+retail-tairline.3_retail.24-e96"
    assert default_policy.default_policy_dir(tmp_path, ["3"], 96, [AIRLINE]).name == "default-policy-t3-e96"
    assert default_policy.warmup_teachers([AIRLINE, RETAIL]) == {"airline": {"oracle": 1, "noop": 2},
                                                                 "retail": {"oracle": 1, "noop": 1}}  # fmt: skip
    with pytest.raises(ValueError, match="--warmup_tasks 3: with several domains a warm-up task is <domain>/"):
        default_policy.build_default_policy(tmp_path / "p", ["3", "retail/24"], epochs=1, specs=[AIRLINE, RETAIL])
    record = json.loads(write_prompt_style(tmp_path, True, [AIRLINE, RETAIL]).read_text())
    assert record["domains"] == ["airline", "retail"] and set(record["texts"]) == {"airline", "retail"}


def test_collect_and_sft_data_over_two_domains(tmp_path: Path) -> None:
    """collect_trajectories.py --domain airline,retail: rows keyed by domain, each with its own domain's schemas."""
    from tau2_rl.configs import CollectArguments
    from tau2_rl.data.collect import collect, decode_rows, load_trajectories

    args = CollectArguments(domain="airline,retail", tasks="airline/3,retail/24", output_dir=str(tmp_path / "c"),
                            hub_dir=str(tmp_path / "hub"), progress=False)  # fmt: skip
    result = collect(args)
    rows = {row["task_id"]: row for row in decode_rows(load_trajectories(result.output_dir))}
    assert set(rows) == {"airline/3", "retail/24"} and all(row["reward"] == 1.0 for row in rows.values())
    names = {key: {tool["function"]["name"] for tool in row["tools"]} for key, row in rows.items()}
    assert "get_reservation_details" in names["airline/3"] and "get_order_details" in names["retail/24"]
    info = json.loads((Path(result.output_dir) / "collect_info.json").read_text())
    assert info["domains"] == ["airline", "retail"] and info["split"] == "seed,tau2"
    with pytest.raises(Exception, match="unknown task ids \\['24'\\]"):
        collect(CollectArguments(domain="airline,retail", tasks="24", output_dir=str(tmp_path / "d"),
                                 hub_dir=str(tmp_path / "hub"), progress=False))  # fmt: skip


def test_the_held_out_evaluation_logs_each_domain_apart() -> None:
    from tau2_rl.evaluation.heldout import log_values

    one = {"pass1": {"overall": {"value": 0.5}}, "episodes": 4}
    logs = log_values({**one, "domains": {"airline": one, "retail": {"pass1": {"overall": {"value": 0.25}}}}})
    assert logs["eval_pass^1"] == 0.5 and logs["eval_airline_pass^1"] == 0.5 and logs["eval_retail_pass^1"] == 0.25
    assert "eval_retail_episodes" not in logs  # missing values are left out, as for one domain


def test_play_py_reports_each_domain_of_a_run_over_several(capsys) -> None:
    """play.py over several domains prints each domain's count beside the pooled one (issue 68), as evaluate.py and
    training report each domain: the do-nothing agent's floor is the airline's 23 of 50 and retail's 7 of 114."""
    import play

    assert play.main(["--domain", "airline,retail", "--agent", "noop", "--no_progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].startswith("pass rate (noop agent, scripted user): 30/164")
    assert lines[-2:] == ["  airline: 23/50 = 46.0%", "  retail: 7/114 = 6.1%"]
