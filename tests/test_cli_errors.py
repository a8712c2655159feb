"""Bad input is one line, exit status 2, no traceback and no usage block (``tau2_rl/run/cli.py``); evaluate.py exits
non-zero when its results are not a finished evaluation."""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path

import datasets
import pytest

import evaluate
import train_grpo
import train_sft
from tau2_rl.envs.users.base import UserReply, UserSimulator
from tau2_rl.evaluation import evaluator as evaluator_module

CPU = ["--use_cpu", "true", "--bf16", "false", "--report_to", "none"]


def one_line_exit(capsys: pytest.CaptureFixture[str], run, *args) -> str:
    with pytest.raises(SystemExit) as info:
        run(*args)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and "usage:" not in err, err
    return err


def test_train_sft_missing_data_dir(tmp_path: Path, capsys) -> None:
    err = one_line_exit(capsys, train_sft.cli, ["--data_dir", "/nope", "--output_dir", str(tmp_path / "o"), *CPU])
    assert err.startswith("train_sft.py: error: Domain file /nope/db.json is missing")


def test_train_sft_corrupt_arrow_dataset(tmp_path: Path, capsys) -> None:
    datasets.Dataset.from_dict({"task_id": ["1"] * 20, "messages": ["x" * 50] * 20}).save_to_disk(tmp_path / "d")
    (arrow,) = glob.glob(str(tmp_path / "d" / "*.arrow"))
    data = bytearray(Path(arrow).read_bytes())
    data[300:340] = b"\xff" * 40
    Path(arrow).write_bytes(bytes(data))
    capsys.readouterr()  # the progress bar of save_to_disk
    argv = ["--dataset_path", str(tmp_path / "d"), "--output_dir", str(tmp_path / "o"), "--hub_dir",
            str(tmp_path / "hub"), *CPU]  # fmt: skip
    err = one_line_exit(capsys, train_sft.cli, argv)
    assert err.startswith(f"train_sft.py: error: --dataset_path {tmp_path / 'd'}: the dataset files are corrupt")


def test_train_sft_on_an_empty_or_foreign_dataset_is_one_line(tmp_path: Path, capsys) -> None:
    from tau2_rl.data.collect import rows_to_dataset

    rows_to_dataset([]).save_to_disk(str(tmp_path / "empty"))  # what a failed collection used to leave behind
    datasets.Dataset.from_dict({"text": ["hello"], "label": [1]}).save_to_disk(str(tmp_path / "foreign"))
    capsys.readouterr()
    common = ["--output_dir", str(tmp_path / "o"), "--hub_dir", str(tmp_path / "hub"), *CPU]
    err = one_line_exit(capsys, train_sft.cli, ["--dataset_path", str(tmp_path / "empty"), *common])
    assert err == (f"train_sft.py: error: --dataset_path {tmp_path / 'empty'}: the dataset is empty (0 rows): nothing "
                   "to train on")  # fmt: skip
    err = one_line_exit(capsys, train_sft.cli, ["--dataset_path", str(tmp_path / "foreign"), *common])
    assert err.startswith(f"train_sft.py: error: --dataset_path {tmp_path / 'foreign'}: the trajectory dataset lacks "
                          "the required column(s) ['task_id', 'messages', 'tools'] (it has ['text', "
                          "'label'])"), err  # fmt: skip
    assert not (tmp_path / "o").exists()  # refused before any model was built or any directory claimed


def test_train_sft_unknown_task_id_is_named(tmp_path: Path, capsys) -> None:
    argv = ["--tasks", "999", "--output_dir", str(tmp_path / "o"), "--hub_dir", str(tmp_path / "hub"), *CPU]
    err = one_line_exit(capsys, train_sft.cli, argv)
    assert err == "train_sft.py: error: --tasks names unknown task ids ['999']; valid ids: 0..49 (50 tasks)"


def test_train_grpo_llm_user_without_url(tmp_path: Path, capsys) -> None:
    argv = ["--user_simulator", "llm", "--output_dir", str(tmp_path / "o"), "--hub_dir", str(tmp_path / "h"), *CPU]
    err = one_line_exit(capsys, train_grpo.cli, argv)
    assert err.startswith("train_grpo.py: error: The LLM user simulator needs an endpoint: set --user_base_url")


@pytest.mark.parametrize(("script", "prog"), [(train_grpo.cli, "train_grpo.py"), (train_sft.cli, "train_sft.py")])
def test_missing_config_file(script, prog, capsys) -> None:
    err = one_line_exit(capsys, script, ["--config", "missing.yaml"])
    assert err == f"{prog}: error: --config missing.yaml: no such file"


def test_collect_run_ablation_and_play_bad_input_is_one_line(tmp_path: Path, capsys) -> None:
    import collect_trajectories
    import play
    from tau2_rl.experiment import main as run_ablation_main

    assert one_line_exit(capsys, collect_trajectories.cli, ["--config", "missing.yaml"]) == (
        "collect_trajectories.py: error: --config missing.yaml: no such file"
    )
    err = one_line_exit(capsys, collect_trajectories.cli, ["--tasks", "999", "--output_dir", str(tmp_path / "c")])
    assert err == "collect_trajectories.py: error: --tasks names unknown task ids ['999']; valid ids: 0..49 (50 tasks)"
    assert "invalid choice: 'foo'" in one_line_exit(capsys, collect_trajectories.cli, ["--teacher", "foo"])
    assert one_line_exit(capsys, run_ablation_main, ["--config", "missing.yaml"]) == (
        "run_ablation.py: error: --config missing.yaml: no such file"
    )
    assert "invalid choice: 'nope'" in one_line_exit(capsys, run_ablation_main, ["--profile", "nope"])
    assert "unknown task id(s) ['999']" in one_line_exit(capsys, play.main, ["--tasks", "999"])


def test_evaluate_missing_config_file(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        evaluate.cli(["--config", "missing.yaml"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == "evaluate.py: error: --config missing.yaml: no such file"


def test_evaluate_parse_errors_carry_its_prefix_and_unknown_keys_are_named(tmp_path: Path, capsys) -> None:
    """Every evaluate.py error reads ``evaluate.py: error:`` (docs/metrics.md), and unknown flags and recipe keys are
    named without TRL's advice to set ``fail_with_unknown_args=False``."""
    (tmp_path / "typo.yaml").write_text("num_sample: 4\nmodel: oracle\n")
    (tmp_path / "broken.yaml").write_text("model: [\n")
    cases = [
        (["--bogus", "1"], "evaluate.py: error: unrecognized argument(s): --bogus (see --help)"),
        (["--config", str(tmp_path / "typo.yaml")], f"evaluate.py: error: --config {tmp_path / 'typo.yaml'}: unknown "
         "key(s) num_sample; remove them or fix their spelling (see --help for the fields)"),
        (["--config", str(tmp_path / "broken.yaml")], "evaluate.py: error: --config: not a valid YAML recipe ("),
    ]  # fmt: skip
    for argv, expected in cases:
        with pytest.raises(SystemExit) as info:
            evaluate.cli(argv)
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and err.startswith(expected) and "\n" not in err, err
        assert "fail_with_unknown_args" not in err


def test_unknown_variant_is_one_line_without_the_usage_block(capsys) -> None:
    err = one_line_exit(capsys, train_grpo.cli, ["--variant", "foo"])
    assert err.startswith("train_grpo.py: error: argument --variant: invalid choice: 'foo'")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max_staleness", "-1"], "--max_staleness must be >= 0, got -1"),  # a config's __post_init__
        (["--rollout_worker_threads", "0"], "--rollout_worker_threads must be >= 1, got 0"),
        (["--variant", "foo"], "argument --variant: invalid choice: 'foo'"),  # argparse
        (["--bogus", "1"], "unrecognized argument(s): --bogus (see --help)"),
        (["--config", "missing.yaml"], "--config missing.yaml: no such file"),
    ],
)
def test_every_train_grpo_flag_error_has_the_same_shape(flags, message, capsys) -> None:
    """Issue 51.5: ``--max_staleness -1`` printed ``error: ...`` where argparse's errors read ``train_grpo.py: error:
    ...``. Every check now prints argparse's shape."""
    err = one_line_exit(capsys, train_grpo.cli, [*flags, *CPU])
    assert err.startswith(f"train_grpo.py: error: {message}"), err


def test_a_prefixed_line_keeps_its_prefix_and_a_bare_one_gets_the_scripts() -> None:
    from tau2_rl.run.cli import error_line

    assert error_line("error: --tasks: bad", "train_grpo.py") == "train_grpo.py: error: --tasks: bad"
    assert error_line("--tasks:\n bad", "train_sft.py") == "train_sft.py: error: --tasks: bad"
    assert error_line("evaluate.py: error: x", "train_grpo.py") == "evaluate.py: error: x"
    assert error_line("the user simulator failed") == "error: the user simulator failed"  # a run's failure, exit 1


def test_results_file_with_wrong_types_is_one_line(tmp_path: Path, capsys) -> None:
    argv = ["--model", "oracle", "--tasks", "0,1", "--num_samples", "1", "--output_dir", str(tmp_path),
            "--progress", "false", "--protocol", "tau2_rl"]  # fmt: skip
    assert evaluate.cli(argv) == 0
    path = tmp_path / "oracle" / "results.json"
    data = json.loads(path.read_text())
    data["tasks"]["0"]["samples"][0]["success"] = "yes"
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert evaluate.cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"evaluate.py: error: results file {path}: tasks['0'].samples[0].success must be bool, got 'yes'; "
        "fix or move the file away"
    )
    shutil.rmtree(tmp_path / "oracle")
    assert evaluate.cli(["--compare", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "c")]) == 2


def test_results_file_with_a_repeated_or_out_of_range_sample_index_is_one_line(tmp_path: Path, capsys) -> None:
    """A hand-merged results.json with sample 0 twice: a resume would play sample 1 as missing and pass^1 would
    count 3 episodes for --num_samples 2."""
    argv = ["--model", "oracle", "--tasks", "0", "--num_samples", "2", "--output_dir", str(tmp_path),
            "--progress", "false", "--protocol", "tau2_rl"]  # fmt: skip
    assert evaluate.cli(argv) == 0
    path = tmp_path / "oracle" / "results.json"
    good = json.loads(path.read_text())
    for index, message in [(0, "tasks['0'].samples[1].sample 0 repeats samples[0].sample"),
                           (2, "tasks['0'].samples[1].sample must be in 0..1 (num_samples), got 2")]:  # fmt: skip
        data = json.loads(json.dumps(good))
        data["tasks"]["0"]["samples"][1]["sample"] = index
        path.write_text(json.dumps(data))
        capsys.readouterr()
        assert evaluate.cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"evaluate.py: error: results file {path}: {message}; fix or move the file away", err
        assert json.loads(path.read_text()) == data  # refused, not rewritten


class DeadUser(UserSimulator):
    """An LLM user whose endpoint died mid-run: every reply is a simulator failure."""

    name = "dead"

    def reply(self, episode) -> UserReply:
        return UserReply(error="endpoint down")


def test_evaluate_exits_non_zero_when_no_episode_could_be_scored(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(evaluator_module, "get_user_simulator", lambda *a, **k: DeadUser())
    argv = ["--model", "oracle", "--tasks", "0,1", "--num_samples", "1", "--output_dir", str(tmp_path),
            "--progress", "false", "--protocol", "tau2_rl"]  # fmt: skip
    assert evaluate.cli(argv) == 1
    err = capsys.readouterr().err
    assert "no episode could be scored (2 user_error and 0 agent_error of 2)" in err


def test_evaluate_ctrl_c_is_one_line_and_status_130(tmp_path: Path, capsys, monkeypatch) -> None:
    from tau2_rl.envs.users import get_user_simulator

    class CtrlC(UserSimulator):
        """The scripted user, until a Ctrl-C lands in the middle of the evaluation."""

        name = "ctrl-c"

        def __init__(self) -> None:
            self.scripted, self.calls = get_user_simulator("scripted"), 0

        def reply(self, episode) -> UserReply:
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
            return self.scripted.reply(episode)

    monkeypatch.setattr(evaluator_module, "get_user_simulator", lambda *a, **k: CtrlC())
    argv = ["--model", "oracle", "--tasks", "0,1", "--num_samples", "1", "--output_dir", str(tmp_path),
            "--progress", "false", "--protocol", "tau2_rl"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        evaluate.cli(argv)
    assert info.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == "interrupted (Ctrl-C); rerun the same command to resume from what was saved", err
    monkeypatch.undo()
    assert evaluate.cli(argv) == 0  # the rerun finishes the evaluation


def test_evaluate_exits_non_zero_when_results_are_incomplete(tmp_path: Path, capsys) -> None:
    argv = ["--model", "oracle", "--tasks", "0,1", "--num_samples", "1", "--output_dir", str(tmp_path),
            "--progress", "false", "--protocol", "tau2_rl"]  # fmt: skip
    assert evaluate.cli(argv) == 0
    path = tmp_path / "oracle" / "results.json"
    data = json.loads(path.read_text())
    data["metrics"].update(valid_episodes=1, user_errors=1, complete=False)
    path.write_text(json.dumps(data))
    assert "incomplete (1 of 2 episodes scored, 1 user errors, 0 agent errors)" in evaluate.unfinished(path)


@pytest.mark.slow
def test_under_accelerate_launch_our_line_is_the_last_thing_printed(tmp_path: Path) -> None:
    """accelerate's simple launcher answers the child's exit status 2 with a CalledProcessError traceback; the line
    is repeated after it, so it is what the user reads last."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml",
            "train_grpo.py", "--variant", "foo"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(repo)}
    done = subprocess.run(argv, cwd=repo, capture_output=True, text=True, env=env, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and "returned non-zero exit status 2" in done.stderr
    assert ": error: argument --variant: invalid choice: 'foo'" in lines[-1]
    assert "usage:" not in done.stderr


@pytest.mark.parametrize(
    ("script", "flag"),
    [(train_grpo.cli, "--learning_rat"), (train_sft.cli, "--learning_rat"), (evaluate.cli, "--num_sampl")],
)  # the training scripts: on CPU, else the bf16 check of the config comes first
def test_an_abbreviated_flag_is_refused_not_taken_for_the_full_one(script, flag, tmp_path: Path, capsys) -> None:
    """Issue 23.6: ``--learning_rat 1e-4`` silently became ``--learning_rate``."""
    cpu = [] if script is evaluate.cli else CPU
    err = one_line_exit(capsys, script, [flag, "3", "--output_dir", str(tmp_path / "o"), *cpu])
    assert flag in err and "unrecognized argument(s)" in err, err


@pytest.mark.parametrize("contents", [[], ["config.json"], ["config.json", "model.safetensors"]])
def test_an_incomplete_model_directory_names_the_missing_files(contents, tmp_path: Path, capsys) -> None:
    """Issue 23.6: an empty ``--model_name_or_path`` directory ended in a 45-line traceback blaming sentencepiece,
    and evaluate.py called it "a hub run with no exported revision"."""
    model = tmp_path / "model"
    model.mkdir()
    for name in contents:
        (model / name).write_text("{}")
    argv = ["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "o"), "--hub_dir",
            str(tmp_path / "hub"), *CPU]  # fmt: skip
    for script, prog in ((train_grpo.cli, "train_grpo.py"), (train_sft.cli, "train_sft.py")):
        err = one_line_exit(capsys, script, argv)
        assert err.startswith(f"{prog}: error: --model_name_or_path {model} is not a complete model directory"), err
        lacks = err.split("it lacks ")[1]
        assert "a tokenizer (tokenizer.json or tokenizer_config.json)" in lacks
        assert ("weights (model.safetensors" in lacks) == ("model.safetensors" not in contents)
        assert lacks.startswith("config.json") == (not contents)
        assert ("(it is empty)" in err) == (not contents)
    assert evaluate.cli(["--model", str(model), "--output_dir", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--model {model} is not a complete model directory" in err and "exported revision" not in err, err
    assert "\n" not in err


def test_num_generations_is_checked_against_the_training_batch_first(tmp_path: Path, capsys, monkeypatch) -> None:
    """TRL checks the eval batch first: ``--num_generations 3`` with the quick-start recipe failed on an eval batch it
    never uses. The training batch comes first, saying where its size comes from."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["--config", "recipes/grpo/cpu_smoke.yaml", "--output_dir", str(tmp_path / "o"), *CPU]
    err = one_line_exit(capsys, train_grpo.cli, [*argv, "--num_generations", "3"])
    assert err.startswith(
        "train_grpo.py: error: --num_generations 3 must divide the generation batch of 16 episodes "
        "(--per_device_train_batch_size 16 × 1 process(es) × --gradient_accumulation_steps 1)"
    ), err
    argv += ["--per_device_train_batch_size", "12"]
    err = one_line_exit(capsys, train_grpo.cli, [*argv, "--num_generations", "3"])
    assert "The global eval batch size (8 * 1)" in err and "--per_device_eval_batch_size 8" in err, err


def test_the_lost_peer_line_cuts_a_long_torch_message_at_a_word() -> None:
    """Issue 36.6: the line ended ``…before reporting an error. G)``, cut mid-word at 200 characters."""
    from tau2_rl.run.cli import lost_peer_message

    text = "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234 " + "word " * 60
    line = lost_peer_message(RuntimeError(text))
    inner = line[line.index("(") + 1 : line.index("); its own log")]
    assert inner.startswith("Connection closed by peer") and inner.endswith("word…") and len(inner) <= 200, inner


def test_train_sft_refuses_another_domains_trajectories_in_one_line(tmp_path: Path, capsys) -> None:
    """Issue 62.5: retail trajectories given to an airline run (the default --domain) are refused, by the domains
    their collection recorded or, for a dataset no collection wrote, by the task ids the airline lacks."""
    import collect_trajectories
    from tau2_rl.data.collect import rows_to_dataset

    collected = tmp_path / "retail"
    argv = ["--domain", "retail", "--teacher", "oracle", "--tasks", "50,52", "--output_dir", str(collected),
            "--hub_dir", str(tmp_path / "hub"), "--progress", "false"]  # fmt: skip
    assert collect_trajectories.cli(argv) in (0, None)
    capsys.readouterr()
    common = ["--output_dir", str(tmp_path / "o"), "--hub_dir", str(tmp_path / "hub"), *CPU]
    err = one_line_exit(capsys, train_sft.cli, ["--dataset_path", str(collected), *common])
    assert err == (f"train_sft.py: error: --dataset_path {collected}: its trajectories were collected on the retail "
                   "domain(s); this run's --domain is airline (pass --domain retail)")  # fmt: skip
    rows = datasets.load_from_disk(str(collected / "dataset")).to_list()
    rows_to_dataset(rows).save_to_disk(str(tmp_path / "bare"))  # the same rows, no collect_info.json beside them
    capsys.readouterr()
    err = one_line_exit(capsys, train_sft.cli, ["--dataset_path", str(tmp_path / "bare"), *common])
    assert err.startswith(f"train_sft.py: error: --dataset_path {tmp_path / 'bare'}: {len(rows)} of its {len(rows)} "
                          "rows name task ids the airline domain(s) lack (50, 52)")  # fmt: skip
