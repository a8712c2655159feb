"""The ablation driver (tau2_rl/experiment/, run_ablation.py): dry runs, completeness checks, skip and resume.

The fast tests fake each stage's outputs or run tiny ``python -c`` stages; the slow test runs the whole driver end to
end on CPU with the embedded default (tiny model, scripted user, oracle teacher) and then reruns it (all skipped).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tau2_rl import experiment
from tau2_rl.experiment import (
    AblationArguments,
    ExperimentError,
    Stage,
    Status,
    build_stages,
    collect_status,
    compare_status,
    grpo_status,
    resolve,
    results_status,
    run,
    run_stages,
    sft_status,
)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------------------ fake outputs


def write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload), encoding="utf-8")


def fake_collect(out: Path, finished: int = 4, attempts: int = 1) -> None:
    info = {"tasks": ["0", "3", "11", "14"], "attempts_per_task": attempts, "attempts_finished": finished,
            "counts": {"kept": finished}}  # fmt: skip
    write_json(out / "trajectories" / "collect_info.json", info)
    write_json(out / "trajectories" / "dataset" / "state.json", {})
    write_json(out / "hub" / "datasets" / "trajectories" / "collect_info.json", info)


def fake_model(path: Path) -> None:
    write_json(path / "config.json", {})
    (path / "model.safetensors").write_bytes(b"0")


def fake_sft(out: Path) -> None:
    fake_model(out / "sft")
    write_json(out / "sft" / "train_results.json", {"train_runtime": 1.0})
    fake_model(out / "hub" / "sft" / "step-000002")
    write_json(out / "hub" / "sft" / "refs.json", {"main": "step-000002", "revisions": {"step-000002": 2}})


def fake_grpo(out: Path, variant: str, steps: tuple[int, ...] = (2, 4)) -> None:
    run_dir = out / "hub" / f"grpo-{variant}"
    for step in steps:
        fake_model(run_dir / f"step-{step:06d}")
    revisions = {f"step-{s:06d}": s for s in steps}
    write_json(run_dir / "refs.json", {"main": max(revisions, key=revisions.get), "revisions": revisions})


def fake_results(path: Path, tasks=("3", "7", "8"), n: int = 2, drop: int = 0, user_error: bool = False) -> None:
    entries = {}
    for index, task_id in enumerate(tasks):
        samples = [
            {"sample": i, "success": False, "user_error": user_error and index == 0 and i == 0} for i in range(n)
        ]
        entries[task_id] = {"samples": samples[: n - drop] if index == 0 else samples}
    write_json(path, {"format": 1, "config": {"tasks": list(tasks), "num_samples": n}, "tasks": entries})


def fake_evals(out: Path, variants=("vanilla", "joint"), steps=(2, 4)) -> None:
    fake_results(out / "eval" / "sft" / "results.json")
    for variant in variants:
        for step in steps:
            fake_results(out / "eval" / variant / f"step-{step:06d}" / "results.json")


def fake_compare(out: Path, labels=("sft", "vanilla", "joint")) -> None:
    comparison = out / "comparison"
    comparison.mkdir(parents=True, exist_ok=True)
    time.sleep(0.01)
    (comparison / "ablation.md").write_text("| metric | " + " | ".join(labels) + " |\n", encoding="utf-8")
    (comparison / "ablation_bars.png").write_bytes(b"png")
    (comparison / "pass1_by_step.png").write_bytes(b"png")


def complete_run(out: Path) -> None:
    fake_collect(out)
    fake_sft(out)
    for variant in ("vanilla", "joint"):
        fake_grpo(out, variant)
    fake_evals(out)
    fake_compare(out)


# ------------------------------------------------------------------------------------------------ dry runs


def test_cpu_tiny_dry_run_prints_every_command_in_order_and_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "ablation"
    lines: list[str] = []
    assert run(AblationArguments(output_dir=str(out), dry_run=True), print_fn=lines.append) == 0
    assert not out.exists()
    headers = [line.split("]")[0].lstrip("# [") for line in lines if line.startswith("# [")]
    assert headers == ["collect", "sft", "grpo:vanilla", "grpo:joint", "eval:sft", "eval:vanilla", "eval:joint",
                       "compare"]  # fmt: skip
    commands = [line for line in lines if not line.startswith("#")]
    assert len(commands) == len(headers)
    py = sys.executable
    env = (
        "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1"
    )
    launch = (  # the training stages: torchrun's stop grace raised to the driver's (--stop_grace_s)
        f"{env} TORCH_ELASTIC_SHUTDOWN_TIMEOUT=900 {py} -m accelerate.commands.launch --config_file "
        "accelerate_configs/cpu.yaml"
    )
    assert commands[0] == (
        f"{env} {py} collect_trajectories.py --teacher oracle --user_simulator scripted --split seed "
        f"--tasks 0,3,11,14 --attempts 1 --progress false --output_dir {out}/trajectories --hub_dir {out}/hub"
    )
    assert commands[1] == (
        f"{launch} train_sft.py --config recipes/ablation/sft_cpu_tiny.yaml --dataset_path {out}/trajectories "
        f"--output_dir {out}/sft --run_name sft --hub_dir {out}/hub"
    )
    assert commands[2] == (
        f"{launch} train_grpo.py --config recipes/ablation/grpo_cpu_tiny.yaml --variant vanilla --model_name_or_path "
        f"{out}/sft --output_dir {out}/grpo-vanilla --run_name grpo-vanilla --hub_dir {out}/hub --max_steps 4 "
        "--save_steps 2"
    )
    assert commands[5] == (
        f"{env} {py} evaluate.py --config recipes/ablation/eval_cpu_tiny.yaml --hub_dir {out}/hub --output_dir "
        f"{out}/eval --model grpo-vanilla --steps 2,4 --eval_name vanilla"
    )
    assert commands[7] == (
        f"{env} {py} evaluate.py --compare sft={out}/eval/sft vanilla={out}/eval/vanilla joint={out}/eval/joint "
        f"--output_dir {out}/comparison --baseline vanilla"
    )


def test_gpu_reference_dry_run_uses_the_reference_recipes_and_gpus(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there: the user server stage would run
    lines: list[str] = []
    args = AblationArguments(
        profile="gpu-reference", output_dir=str(tmp_path / "ref"), dry_run=True, user_base_url=url
    )
    assert run(args, print_fn=lines.append) == 0
    text = "\n".join(lines)
    port = url.split(":")[2].split("/")[0]
    assert (
        f"-m scripts.serve_user_llm --model /models/Qwen2.5-72B-Instruct-AWQ --port {port} --gpu-ids 1 "
        "--served-model-name Qwen2.5-72B-Instruct-AWQ --max-model-len 32768 --tool-call-parser hermes"
    ) in text
    for variant in experiment.ALL_VARIANTS:
        assert f"--config recipes/grpo/{variant}_2gpu.yaml --variant {variant}" in text
        assert f"--model grpo-{variant} --steps 200,250,300 --eval_name {variant}" in text
    assert text.count("--max_steps 300 --save_steps 50") == 5
    assert "CUDA_VISIBLE_DEVICES=0" in text
    assert "accelerate_configs/zero2_offload.yaml --gpu_ids 0 train_grpo.py" in text  # fp32 master weights
    assert "--model_name_or_path /models/Qwen2.5-7B-Instruct" in text
    assert f"--teacher_base_url {url} --teacher_model Qwen2.5-72B-Instruct-AWQ" in text
    assert text.count(f"--user_base_url {url} --user_model Qwen2.5-72B-Instruct-AWQ") == 1 + 5 + 6  # collect/grpo/eval


def test_domain_reaches_every_stage_with_its_own_tasks(tmp_path: Path) -> None:
    """--domain retail: every stage gets --domain (the airline's commands stay as they were: the test above) and the
    cpu-tiny profile's retail tasks replace its airline task ids; a user's --grpo_args still win."""
    lines: list[str] = []
    args = AblationArguments(output_dir=str(tmp_path / "r"), dry_run=True, domain="retail", grpo_args="--tasks 88")
    assert run(args, print_fn=lines.append) == 0
    commands = [line for line in lines if not line.startswith("#")]
    collect, sft, *grpo = [c for c in commands if "collect_trajectories.py" in c or "train_" in c]
    evals = [c for c in commands if "evaluate.py --config" in c]
    assert collect.endswith("--domain retail --split tau2 --tasks 88,73")
    assert sft.endswith("--domain retail --split tau2")
    assert len(grpo) == 2 and all(c.endswith("--domain retail --split tau2 --tasks 88,73 --tasks 88") for c in grpo)
    assert len(evals) == 3 and all("--domain retail --split tau2 --tasks 73,88,5" in c for c in evals)
    reference = AblationArguments(output_dir=str(tmp_path), domain="retail", profile="gpu-reference",
                                  user_base_url="http://127.0.0.1:1/v1", user_model="u", dry_run=True)  # fmt: skip
    settings = resolve(reference)
    assert settings.extra["grpo"] == ["--domain", "retail", "--split", "tau2"]  # its recipes name no task
    with pytest.raises(ExperimentError, match="--domain 'tele': unknown domain"):
        resolve(AblationArguments(output_dir=str(tmp_path), domain="tele"))


def test_the_entry_script_dry_run_with_dashes_and_overrides(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "run_ablation.py", "--dry-run", "--variants", "lata", "--steps", "3,6", "--output_dir",
         str(tmp_path / "x"), "--grpo_args", "--learning_rate 5e-5"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--variant lata" in done.stdout and "--max_steps 6 --save_steps 3 --learning_rate 5e-5" in done.stdout
    assert "--steps 3,6 --eval_name lata" in done.stdout and "joint" not in done.stdout
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"variants": "vanilla,bogus"}, "--variants: unknown variant"),
        ({"variants": "lata,lata"}, "twice"),
        ({"steps": "2,x"}, "--steps"),
        ({"steps": "0"}, "--steps"),
        ({"stages": "grpo,train"}, "--stages: unknown stage"),
        ({"profile": "gpu-reference", "user_model_path": "none", "user_model": None}, "--user_model"),
        ({"prm_rules": "gold"}, "--prm_rules: unknown rule set 'gold'"),
        ({"prm_rules": "lata=reference"}, "--prm_rules 'lata=reference': expected"),
        ({"prm_rules": "joint=v2,joint=v1"}, "at most once"),
        ({"prm_rules": "joint=v2,reference"}, "variant=rules pairs"),
    ],
)
def test_bad_arguments_name_their_flag(kwargs: dict, needle: str, tmp_path: Path) -> None:
    with pytest.raises(ExperimentError, match=needle):
        resolve(AblationArguments(output_dir=str(tmp_path), **kwargs))


def test_prm_rules_per_variant_reach_the_grpo_commands(tmp_path: Path) -> None:
    """--prm_rules: one rule set for every variant, or per variant; the others keep their recipe's."""
    every = resolve(AblationArguments(output_dir=str(tmp_path), prm_rules="reference"))
    assert every.prm_rules == {"vanilla": "reference", "joint": "reference"}
    lines: list[str] = []
    args = AblationArguments(output_dir=str(tmp_path / "a"), dry_run=True, prm_rules="joint=reference+v2")
    assert run(args, print_fn=lines.append) == 0
    grpo = [line for line in lines if "train_grpo.py" in line]
    assert len(grpo) == 2 and "--prm_rules" not in grpo[0]  # vanilla: its recipe's
    assert "--variant joint" in grpo[1] and "--save_steps 2 --prm_rules reference+v2" in grpo[1]


def test_save_steps_is_the_gcd_of_the_evaluated_steps(tmp_path: Path) -> None:
    settings = resolve(AblationArguments(output_dir=str(tmp_path), steps="250,200,300", variants="all"))
    assert (settings.steps, settings.max_steps, settings.save_steps) == ([200, 250, 300], 300, 50)
    assert settings.variants == list(experiment.ALL_VARIANTS)


def test_main_reports_argument_errors_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert experiment.main(["--variants", "bogus", "--dry_run"]) == 2
    assert "run_ablation.py: error: --variants: unknown variant" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ completeness


def test_collect_completeness(tmp_path: Path) -> None:
    trajectories, hub = tmp_path / "trajectories", tmp_path / "hub"
    assert not collect_status(trajectories, hub)
    fake_collect(tmp_path, finished=3)
    assert "3 of 4 attempts" in collect_status(trajectories, hub).reason
    fake_collect(tmp_path, finished=4)
    assert collect_status(trajectories, hub, attempts=1)
    assert "8 asked" in collect_status(trajectories, hub, attempts=8).reason
    assert collect_status(trajectories, hub, tasks=["14", "11", "3", "0"])
    assert "asked ['0', '1']" in collect_status(trajectories, hub, tasks=["0", "1"]).reason
    (hub / "datasets" / "trajectories" / "collect_info.json").unlink()
    assert "not exported" in collect_status(trajectories, hub).reason


def test_sft_completeness(tmp_path: Path) -> None:
    assert not sft_status(tmp_path / "sft", tmp_path / "hub", "sft")
    fake_model(tmp_path / "sft")
    assert "train_results.json" in sft_status(tmp_path / "sft", tmp_path / "hub", "sft").reason
    fake_sft(tmp_path)
    assert sft_status(tmp_path / "sft", tmp_path / "hub", "sft")


def test_grpo_completeness_needs_every_requested_step(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    assert not grpo_status(hub, "grpo-lata", [2, 4])
    fake_grpo(tmp_path, "lata", steps=(2,))
    status = grpo_status(hub, "grpo-lata", [2, 4])
    assert not status and "[4]" in status.reason
    fake_grpo(tmp_path, "lata", steps=(2, 4))
    assert grpo_status(hub, "grpo-lata", [2, 4])
    (hub / "grpo-lata" / "step-000004" / "config.json").unlink()  # listed but not really there
    assert not grpo_status(hub, "grpo-lata", [2, 4])


def test_results_completeness_counts_every_sample(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    assert not results_status(path)
    fake_results(path, drop=1)
    assert "1 of 6 samples missing" in results_status(path).reason
    fake_results(path, user_error=True)  # a user-simulator failure must be played again
    assert "1 of 6 samples missing" in results_status(path).reason
    fake_results(path)
    assert results_status(path) and results_status(path, ["8", "7", "3"], 2)
    assert "4 asked" in results_status(path, None, 4).reason
    assert "other tasks" in results_status(path, ["3"], 2).reason
    path.write_text("{torn", encoding="utf-8")
    assert not results_status(path)


def test_compare_completeness_detects_stale_and_missing_outputs(tmp_path: Path) -> None:
    results = tmp_path / "eval" / "vanilla" / "results.json"
    fake_results(results)
    assert not compare_status(tmp_path / "comparison", [results], ["vanilla"])
    fake_compare(tmp_path, labels=("vanilla",))
    assert compare_status(tmp_path / "comparison", [results], ["vanilla"])
    assert "does not show ['joint']" in compare_status(tmp_path / "comparison", [results], ["vanilla", "joint"]).reason
    later = time.time() + 5
    os.utime(results, (later, later))  # an evaluation finished after the table was made
    assert "older than" in compare_status(tmp_path / "comparison", [results], ["vanilla"]).reason


# ------------------------------------------------------------------------------------------------ skip and resume


def test_complete_stages_are_skipped_and_only_the_rest_runs(tmp_path: Path) -> None:
    out = tmp_path / "ablation"
    fake_collect(out)
    fake_sft(out)
    fake_grpo(out, "vanilla")
    fake_results(out / "eval" / "sft" / "results.json")
    fake_results(out / "eval" / "vanilla" / "step-000002" / "results.json")  # step 4 still missing
    stages = build_stages(resolve(AblationArguments(output_dir=str(out))))
    ran: list[str] = []

    def execute(stage: Stage, cwd: Path) -> int:
        ran.append(stage.name)
        if stage.name == "grpo:joint":
            fake_grpo(out, "joint")
        elif stage.name == "eval:vanilla":
            fake_evals(out, variants=("vanilla",))
        elif stage.name == "eval:joint":
            fake_evals(out, variants=("joint",))
        elif stage.name == "compare":
            fake_compare(out)
        return 0

    lines: list[str] = []
    outcomes = run_stages(stages, execute=execute, print_fn=lines.append)
    assert ran == ["grpo:joint", "eval:vanilla", "eval:joint", "compare"]
    status = {o.name: o.status for o in outcomes}
    assert status == {
        **{"collect": "skipped", "sft": "skipped", "grpo:vanilla": "skipped", "grpo:joint": "done"},
        **{"eval:sft": "skipped", "eval:vanilla": "done", "eval:joint": "done", "compare": "done"},
    }
    # everything is complete now: a rerun runs nothing
    ran.clear()
    assert {o.status for o in run_stages(stages, execute=execute, print_fn=lines.append)} == {"skipped"}
    assert ran == []


def test_a_complete_run_through_run_writes_the_state_and_succeeds(tmp_path: Path) -> None:
    out = tmp_path / "ablation"
    complete_run(out)
    lines: list[str] = []
    assert run(AblationArguments(output_dir=str(out)), print_fn=lines.append) == 0
    state = json.loads((out / experiment.STATE_FILE).read_text())
    assert [s["status"] for s in state["stages"]] == ["skipped"] * 8
    assert any(line.startswith("| compare | skipped") for line in "\n".join(lines).splitlines())
    # the dry run of a complete run says so
    lines.clear()
    run(AblationArguments(output_dir=str(out), dry_run=True), print_fn=lines.append)
    assert sum(line.startswith("# [") and "complete, skipped" in line for line in lines) == 8


def test_a_complete_stage_after_one_that_runs_is_flagged_as_maybe_stale(tmp_path: Path) -> None:
    out = tmp_path / "ablation"
    fake_collect(out, finished=3)  # collection incomplete: it runs again ...
    fake_sft(out)  # ... while the SFT model made from the old data looks complete
    lines: list[str] = []
    run(AblationArguments(output_dir=str(out), dry_run=True), print_fn=lines.append)
    assert any(line.startswith("# [warn] sft is complete but collect would run") for line in lines)


def _py_stage(tmp_path: Path, name: str, code: str, deps: list[str] | None = None) -> Stage:
    marker = tmp_path / f"{name}.done"
    return Stage(
        name, "grpo", [sys.executable, "-c", code.format(marker=str(marker), dir=str(tmp_path))],
        lambda: Status(marker.exists(), "done" if marker.exists() else "not yet"), tmp_path / "logs" / f"{name}.log",
        deps=deps or [],
    )  # fmt: skip


def test_resume_after_a_stage_failure(tmp_path: Path) -> None:
    ok = "import pathlib; pathlib.Path({marker!r}).write_text('x')"
    flaky = (
        "import pathlib, sys; flag = pathlib.Path({dir!r}) / 'second-try'\n"
        "if not flag.exists():\n    flag.write_text('x'); print('CUDA out of memory'); sys.exit(3)\n"
        "pathlib.Path({marker!r}).write_text('x')"
    )
    stages = [
        _py_stage(tmp_path, "a", ok),
        _py_stage(tmp_path, "b", flaky, ["a"]),
        _py_stage(tmp_path, "c", ok, ["b"]),
    ]
    lines: list[str] = []
    first = run_stages(stages, print_fn=lines.append)
    assert [(o.name, o.status) for o in first] == [("a", "done"), ("b", "failed")]  # stopped at b
    assert "exit code 3" in first[1].reason and "CUDA out of memory" in "\n".join(lines)
    assert "rerun the same command to resume" in lines[-1]
    second = run_stages(stages, print_fn=lines.append)
    assert [(o.name, o.status) for o in second] == [("a", "skipped"), ("b", "done"), ("c", "done")]
    log = (tmp_path / "logs" / "b.log").read_text()
    assert log.count("=====") == 2  # both attempts are in the stage's log


def test_keep_going_runs_independent_stages_and_blocks_dependent_ones(tmp_path: Path) -> None:
    fail = "import sys; sys.exit(1)"
    ok = "import pathlib; pathlib.Path({marker!r}).write_text('x')"
    silent = "pass"  # exits 0 but writes nothing: incomplete outputs are a failure too
    stages = [
        _py_stage(tmp_path, "a", fail),
        _py_stage(tmp_path, "b", ok, ["a"]),
        _py_stage(tmp_path, "c", ok),
        _py_stage(tmp_path, "d", silent),
    ]
    outcomes = run_stages(stages, keep_going=True, print_fn=lambda line: None)
    assert [o.status for o in outcomes] == ["failed", "blocked", "done", "failed"]
    assert "outputs are incomplete" in outcomes[3].reason


def test_run_returns_1_and_records_a_failed_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ablation"
    fake_collect(out)
    monkeypatch.setattr(experiment.driver, "_execute", lambda stage, cwd: 1)
    lines: list[str] = []
    assert run(AblationArguments(output_dir=str(out)), print_fn=lines.append) == 1
    state = json.loads((out / experiment.STATE_FILE).read_text())
    assert [(s["name"], s["status"]) for s in state["stages"]] == [("collect", "skipped"), ("sft", "failed")]


def test_selected_stages_only_and_dependencies_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ablation"
    ran: list[str] = []
    monkeypatch.setattr(experiment.driver, "_execute", lambda stage, cwd: ran.append(stage.name) or 0)
    lines: list[str] = []
    assert run(AblationArguments(output_dir=str(out), stages="grpo"), print_fn=lines.append) == 1
    assert ran == []  # sft is incomplete and not selected: GRPO cannot start
    assert "[blocked] grpo:vanilla: needs sft" in "\n".join(lines)


SAVING_STAGE = """
import pathlib, signal, sys, time
def save(*_):
    time.sleep(1.0)  # finishing the step and writing the checkpoint
    pathlib.Path(sys.argv[1]).write_text("saved")
    sys.exit(143)
signal.signal(signal.SIGTERM, save)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize(("grace", "saved"), [(20.0, True), (0.2, False)])
def test_an_interrupted_stage_gets_its_grace_to_save_then_is_killed(tmp_path: Path, grace: float, saved: bool) -> None:
    """Ctrl-C in the driver: the stage's processes get SIGTERM and ``stop_grace_s`` to save; then SIGKILL."""
    import signal
    import threading

    marker = tmp_path / "checkpoint"
    stage = Stage("grpo:x", "grpo", [sys.executable, "-c", SAVING_STAGE, str(marker)], lambda: Status(False, "x"),
                  tmp_path / "stage.log", stop_grace_s=grace)  # fmt: skip

    def interrupt_when_ready() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "ready" not in (  # a line of its own: the header quotes the script
            stage.log.read_text().splitlines() if stage.log.is_file() else []
        ):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C handler, whatever this process inherited: a job started in the background by a
    # non-interactive shell (`cmd &`, as CI runners do) starts with SIGINT ignored, and Python then keeps it ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            experiment.driver._execute(stage, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert marker.is_file() == saved
    assert time.monotonic() - start < 60  # never the stage's own 120 s


def test_training_stages_raise_torchruns_stop_grace(tmp_path: Path) -> None:
    settings = resolve(AblationArguments(output_dir=str(tmp_path), stop_grace_s=1200))
    for stage in build_stages(settings):
        training = stage.kind in ("sft", "grpo")
        assert (stage.env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") == "1200") == training, stage.name
        assert stage.stop_grace_s == (1200 if training else 30)
    with pytest.raises(ExperimentError, match="--stop_grace_s"):
        resolve(AblationArguments(output_dir=str(tmp_path), stop_grace_s=0))


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_the_whole_driver_runs_end_to_end_on_cpu_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "ablation"
    command = [sys.executable, "run_ablation.py", "--output_dir", str(out)]
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    first = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for name in ("ablation.md", "ablation_bars.png", "pass1_by_step.png"):
        assert (out / "comparison" / name).is_file()
    table = (out / "comparison" / "ablation.md").read_text()
    assert "vanilla" in table and "joint" in table and "sft" in table
    for variant in ("vanilla", "joint"):
        refs = json.loads((out / "hub" / f"grpo-{variant}" / "refs.json").read_text())
        assert set(refs["revisions"].values()) >= {2, 4}
        for step in (2, 4):
            assert results_status(out / "eval" / variant / f"step-{step:06d}" / "results.json")
    state = json.loads((out / experiment.STATE_FILE).read_text())
    assert {s["status"] for s in state["stages"]} == {"done"}
    print(f"first run: {first:.0f} s")

    # a second run finds everything complete and runs nothing
    start = time.monotonic()
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.count("[skip]") == 8 and "[run]" not in again.stdout
    assert time.monotonic() - start < 120


def test_a_deepspeed_config_without_deepspeed_is_refused_in_one_line_naming_the_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """accelerate's launcher would raise its own ImportError (11 lines, an unpinned ``pip3 install deepspeed``) in
    every training stage; the driver refuses before the first stage. A dry run still prints the plan."""
    from tau2_rl.run import dependencies

    monkeypatch.setattr(dependencies, "is_installed", lambda module: False)
    argv = ["--output_dir", str(tmp_path), "--accelerate_config", "accelerate_configs/zero3.yaml"]
    assert experiment.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--accelerate_config accelerate_configs/zero3.yaml needs DeepSpeed" in lines[0]
    assert "deepspeed==0.19.8" in lines[0]
    assert experiment.main([*argv, "--dry_run"]) == 0
