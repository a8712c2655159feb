"""DeepSpeed ZeRO-2 and ZeRO-3 for real on CPU: the trainer under ``accelerate_configs/cpu_zero{2,3}.yaml``.

DeepSpeed 0.19.8 runs here on its CPU accelerator over gloo, through accelerate 1.15, with two launch flags that the
accelerate config cannot carry (the twins' headers say why): ``--use_cpu false`` (accelerate initialises DeepSpeed
only when ``use_cpu`` is off; on a machine without a GPU every tensor stays on the CPU anyway) and
``--ddp_backend gloo`` (without a backend accelerate's state counts one process per rank while DeepSpeed counts two,
and DeepSpeed's batch-size check fails).

Each run is the same 2-process GRPO run (2 steps, the tiny random model rewarded for the length of its text so that
the weights move, ``tests/grpo_probe.py``) under DDP (``multi_gpu.yaml`` on CPU), ZeRO-2 and ZeRO-3. Every rank plays
the same episodes under all three, so the exported weights must agree. Measured (max abs, fp32): here ZeRO-2 equal
to DDP to the bit and ZeRO-3 within 8.2e-7; on the quick-start recipe (``cpu_smoke.yaml``, 2 × 8 rows, 2 steps, the
embedded default policy) the same, 0 and 2.0e-7, with identical step lines. A ZeRO-3 run resuming its partitioned
checkpoint to the uninterrupted run's weights is checked by tests/test_sharded.py (a rank killed mid-save, then the
rerun; it was a stop-and-rerun pair here too). CI runs DDP and ZeRO-3 (the partitioned parameters gathered for
TRL's generation while the idle rank joins with a dummy); ZeRO-2, whose parameters are whole on every rank, is
``exhaustive`` here (CI checks it against one process in tests/test_sharded.py). Marked slow (two launches, ~40 s
each on 2 cores; three under ``exhaustive``) and skipped without DeepSpeed (requirements-gpu.txt; the base install
never needs it: tests/test_optional_deps.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tau2_rl.run import dependencies as optional
from tau2_rl.run.deepspeed_cpu import DeepSpeedLaunchError, deepspeed_cpu_problem

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
# What CPU forces in a twin: two processes (2 cores), no mixed precision (no bf16 kernels worth it on CPU).
CPU_FORCED = {"num_processes": 2, "mixed_precision": "no"}
TWINS = {"cpu_zero2.yaml": "zero2.yaml", "cpu_zero3.yaml": "zero3.yaml"}
# The two flags a DeepSpeed launch on CPU needs (module docstring).
DEEPSPEED_CPU_FLAGS = ["--use_cpu", "false", "--ddp_backend", "gloo"]
TOLERANCE = 1e-5  # max abs, fp32 weights; measured 0 (ZeRO-2) and 8.2e-7 (ZeRO-3) against DDP


@pytest.mark.parametrize("twin", sorted(TWINS))
def test_cpu_twin_keeps_the_gpu_files_sharding_settings(twin: str) -> None:
    cpu = yaml.safe_load((CONFIGS / twin).read_text(encoding="utf-8"))
    gpu = yaml.safe_load((CONFIGS / TWINS[twin]).read_text(encoding="utf-8"))
    assert cpu["deepspeed_config"] == gpu["deepspeed_config"]  # ZeRO stage, offload, init and save settings
    assert {key: cpu[key] for key in CPU_FORCED} == CPU_FORCED
    assert {k: v for k, v in cpu.items() if k not in CPU_FORCED} == {
        k: v for k, v in gpu.items() if k not in CPU_FORCED
    }  # nothing else differs
    header = (CONFIGS / twin).read_text(encoding="utf-8")
    assert all(flag in header for flag in ("--use_cpu false", "--ddp_backend gloo"))  # the launch it needs, said


@pytest.mark.parametrize(
    ("use_cpu", "backend", "refused"),
    [(True, "gloo", "--use_cpu true trains plain DDP"), (False, None, "needs a process-group backend"),
     (True, None, "--use_cpu true"), (False, "gloo", None), (False, "ccl", None)],
)  # fmt: skip
def test_a_deepspeed_launch_on_cpu_without_its_two_flags_is_refused(use_cpu, backend, refused) -> None:
    args = SimpleNamespace(use_cpu=use_cpu, ddp_backend=backend, deepspeed=None)
    problem = deepspeed_cpu_problem(args, cuda_available=False)
    assert (problem is None) == (refused is None)
    if refused is not None:
        assert refused in problem and "pass --use_cpu false --ddp_backend gloo" in problem and "\n" not in problem
    assert deepspeed_cpu_problem(args, cuda_available=True) is None  # a GPU machine: DeepSpeed's own business
    with_json = SimpleNamespace(use_cpu=use_cpu, ddp_backend=backend, deepspeed="ds.json")
    assert deepspeed_cpu_problem(with_json, cuda_available=False) is None  # --deepspeed <json>: not run on CPU here


def test_training_scripts_refuse_it_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """``require_for_training`` (both entry scripts, before any model is loaded) runs the check under a DeepSpeed
    accelerate config (DeepSpeed itself faked as installed: the base install lacks it)."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(optional, "is_installed", lambda module: True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(DeepSpeedLaunchError, match="trains plain DDP, not ZeRO"):
        optional.require_for_training(SimpleNamespace(use_cpu=True, ddp_backend=None, deepspeed=None, use_vllm=False))
    optional.require_for_training(SimpleNamespace(use_cpu=False, ddp_backend="gloo", deepspeed=None, use_vllm=False))


def run_grpo(config: str, extra: list[str], model: Path, out: Path) -> dict[str, Any]:
    """One 2-process GRPO run of the tiny model under ``config``; its probe records per rank and its paths.

    The end-of-turn token is pushed up (as in tests/test_multiprocess.py) so that episodes end turns and last
    different numbers of them: the ranks then finish their waves at different times and the idle one joins the
    other's generation with a dummy, which under ZeRO-3 is a parameter-gathering collective."""
    from transformers import AutoTokenizer

    end_of_turn = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|im_end|>")
    bias = json.dumps({"sequence_bias": [[[end_of_turn], 4.0]]})
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
               "--num_processes", "2", "--mixed_precision", "no", "tests/grpo_probe.py",
               "--config", "recipes/grpo/cpu_smoke.yaml", "--model_name_or_path", str(model), "--compact_prompt",
               "true", "--output_dir", str(out / "run"), "--run_name", "zero", "--hub_dir", str(out / "hub"),
               "--bf16", "false", "--report_to", "none", "--eval_strategy", "no",
               # shrunk: 2 steps of 2 ranks × 4 rows (one group of 8 episodes), up to 4 short turns each
               "--task_repeats", "8", "--per_device_train_batch_size", "4", "--max_turns", "4",
               "--max_turn_tokens", "16", "--max_completion_length", "256", "--max_steps", "2", "--save_steps", "2",
               "--learning_rate", "1e-3", "--generation_kwargs", bias, *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT), "GRPO_PROBE_DIR": str(out / "probe"),
           "GRPO_PROBE_REWARD": "length"}  # fmt: skip
    log = out / "grpo.log"
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as handle:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=1200)
    assert done.returncode == 0, log.read_text(errors="replace")[-5000:]
    records = {}
    for rank in (0, 1):
        lines = (out / "probe" / f"rank{rank}.jsonl").read_text(encoding="utf-8").splitlines()
        records[rank] = [json.loads(line) for line in lines]
    return {"records": records, "run": out / "run", "revision": out / "hub" / "zero" / "step-000002", "log": log}


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (pip install -r requirements-gpu.txt, or deepspeed==0.19.8)")
    work = tmp_path_factory.mktemp("zero")
    model = work / "tiny-qwen2"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "scripts.build_tiny_model", "--output_dir", str(model)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    runs = {"ddp": run_grpo("multi_gpu.yaml", ["--use_cpu", "true"], model, work / "ddp")}
    runs["zero3"] = run_grpo("cpu_zero3.yaml", DEEPSPEED_CPU_FLAGS, model, work / "zero3")
    runs["base"] = {"revision": model, "work": work}
    return runs


def zero2_run(zero_runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """ZeRO-2 on this path (exhaustive: its parameters are whole on every rank, so its generation is DDP's; CI checks
    ZeRO-2 against one process on the prefix path, tests/test_sharded.py)."""
    base = zero_runs["base"]
    if "zero2" not in zero_runs:
        zero_runs["zero2"] = run_grpo("cpu_zero2.yaml", DEEPSPEED_CPU_FLAGS, base["revision"], base["work"] / "zero2")
    return zero_runs["zero2"]


def weights(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    state.pop("lm_head.weight", None)  # tied to embed_tokens; ZeRO-2's export writes the tied copy, ZeRO-3's not
    return state


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def zero_checkpoint_files(run: dict[str, Any], per_rank: list[str]) -> None:
    saved = run["run"] / "checkpoint-2" / "global_step2"
    names = sorted(p.name for p in saved.iterdir())
    for kind in per_rank:
        assert {f"zero_pp_rank_{r}_mp_rank_00_{kind}.pt" for r in (0, 1)} <= set(names), names


def rollouts(run: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    return {rank: [r for r in records if r["kind"] == "rollout"] for rank, records in run["records"].items()}


def check_plays_and_trains_what_ddp_does(run: dict[str, Any], ddp: dict[str, Any], name: str) -> None:
    """The same episodes (tasks, turns) rank by rank, and the exported weights within ``TOLERANCE``."""
    assert rollouts(run) == rollouts(ddp), name
    diff = max_abs_diff(weights(run["revision"]), weights(ddp["revision"]))
    print(f"{name} vs DDP: max abs weight difference {diff:.3g}")
    assert diff <= TOLERANCE, name


def check_loads_in_a_plain_process(run: dict[str, Any], name: str) -> None:
    from transformers import AutoModelForCausalLM

    revision = run["revision"]
    model = AutoModelForCausalLM.from_pretrained(revision, local_files_only=True)
    loaded = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert max_abs_diff(loaded, weights(revision)) == 0.0, name
    assert max_abs_diff(weights(run["run"]), weights(revision)) == 0.0, name  # = the final model


@pytest.mark.slow
def test_zero3_checkpoints_hold_deepspeeds_sharded_state(zero_runs: dict[str, dict[str, Any]]) -> None:
    """DeepSpeed really ran: each rank saved its own optimiser and parameter partitions."""
    zero_checkpoint_files(zero_runs["zero3"], ["optim_states", "model_states"])
    assert not (zero_runs["ddp"]["run"] / "checkpoint-2" / "global_step2").exists()
    # this run's sequence_bias reads the prompt ids, so every config here generates through TRL's call (ZeRO-3's
    # gathered-per-round prefix path: tests/test_sharded.py)
    log = zero_runs["zero3"]["log"].read_text(errors="replace")
    assert "rollouts generate through TRL without prefix reuse" in log


@pytest.mark.slow
def test_zero3_plays_and_trains_what_ddp_does(zero_runs: dict[str, dict[str, Any]]) -> None:
    reference = rollouts(zero_runs["ddp"])
    assert all([r["step"] for r in reference[rank]] == [0, 1] for rank in (0, 1))
    turns = [t for rank in (0, 1) for record in reference[rank] for t in record["turns"]]
    assert len(set(turns)) > 1, turns  # episodes of different lengths: the waves' idle-rank path ran
    base = weights(zero_runs["base"]["revision"])
    ddp = weights(zero_runs["ddp"]["revision"])
    assert max_abs_diff(ddp, base) > 100 * TOLERANCE  # the two steps moved the weights well past the tolerance
    check_plays_and_trains_what_ddp_does(zero_runs["zero3"], zero_runs["ddp"], "zero3")


@pytest.mark.slow
def test_zero3_hub_revision_loads_in_a_plain_process(zero_runs: dict[str, dict[str, Any]]) -> None:
    """The hub revision is one consolidated HF model: ``from_pretrained`` here (no DeepSpeed, one process)."""
    check_loads_in_a_plain_process(zero_runs["zero3"], "zero3")


@pytest.mark.slow
@pytest.mark.exhaustive
def test_zero2_on_this_path_does_all_that_zero3_does(zero_runs: dict[str, dict[str, Any]]) -> None:
    """ZeRO-2 (its own launch): its optimiser partitions, DDP's episodes and weights, a plain-loading revision."""
    run = zero2_run(zero_runs)
    zero_checkpoint_files(run, ["optim_states"])
    check_plays_and_trains_what_ddp_does(run, zero_runs["ddp"], "zero2")
    check_loads_in_a_plain_process(run, "zero2")
