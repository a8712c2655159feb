"""Generation ahead of training (``--max_staleness``): the lookahead, the behaviour-weight metrics, the worker's
failure line, the flags, and (slow) a short run whose logged staleness stays within the bound."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tau2_rl.configs import MultiTurnGRPOConfig
from tau2_rl.domains import get_domain  # noqa: E402
from tau2_rl.envs.episode import DomainEnv
from tau2_rl.envs.prompt_style import LEGACY_PROMPT_STYLE_FILE, PROMPT_STYLE_FILE, compact_env
from tau2_rl.envs.users import get_user_simulator
from tau2_rl.trainers.generation_ahead import (
    BatchRequest,
    GenerationAhead,
    Lookahead,
    RolloutWorkerError,
    behaviour_stats,
    worker_model,
)

AIRLINE = get_domain("airline")

ROOT = Path(__file__).resolve().parents[1]


def test_lookahead_yields_every_item_in_order_and_announces_each_once_ahead():
    announced: list[tuple[int, int]] = []
    look = Lookahead(iter(range(7)), depth=2, on_item=lambda i, item: announced.append((i, item)), first_index=10)
    first = next(look)
    assert first == 0
    assert announced == [(10, 0), (11, 1), (12, 2), (13, 3)]  # three items known ahead of the consumer
    assert list(look) == [1, 2, 3, 4, 5, 6]
    assert [item for _, item in announced] == list(range(7))
    assert [i for i, _ in announced] == list(range(10, 17))


def test_behaviour_stats_match_hand_computed_values():
    old = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]])
    behav = torch.tensor([[math.log(0.25), math.log(0.2), 0.0]])
    output = {
        "old_per_token_logps": old,
        "sampling_per_token_logps": behav,
        "completion_mask": torch.tensor([[1, 1, 0]]),
        "tool_mask": torch.tensor([[1, 1, 1]]),
        "importance_sampling_ratio": torch.tensor([[1.5, 1.0, 1.0]]),  # the first one truncated at 1.5
    }
    stats = behaviour_stats(output, cap=1.5)
    assert stats["behaviour_weight"] == pytest.approx(1.25)
    assert stats["behaviour_weight_truncated"] == pytest.approx(0.5)
    log_ratio = math.log(2.0)
    assert stats["kl_behaviour"] == pytest.approx((2.0 - log_ratio - 1) / 2)


def test_kl_behaviour_is_never_negative_at_staleness_0():
    """Issue 51.4: two forward passes over the same weights differ by float noise (log-ratios ~1e-8 on likely
    tokens), and the k3 estimator in float32 logged −5e-9 there (exp(4e-8) rounds to 1, so the term is −x). It is 0
    for equal log-probs and tiny, never negative, for noise."""
    behav = torch.full((4, 64), math.log(0.99)) - torch.rand(4, 64) * 1e-3  # likely tokens: log-probs near 0
    noise = torch.tensor([4e-8, 2e-8, 5e-8, 1e-8]).unsqueeze(1).expand(4, 64)
    mask = torch.ones(4, 64, dtype=torch.long)
    output = {"sampling_per_token_logps": behav, "completion_mask": mask, "tool_mask": mask}
    assert behaviour_stats({**output, "old_per_token_logps": behav.clone()}, cap=5.0)["kl_behaviour"] == 0.0
    kl = behaviour_stats({**output, "old_per_token_logps": behav + noise}, cap=5.0)["kl_behaviour"]
    assert 0.0 <= kl < 1e-12


def test_take_names_a_dead_worker_in_one_line_instead_of_waiting():
    ahead = GenerationAhead.__new__(GenerationAhead)
    ahead.k = 1
    ahead.pending = deque([BatchRequest(4, [("3", 1)], min_version=3)])
    ahead.results = SimpleNamespace(get=lambda timeout: (_ for _ in ()).throw(__import__("queue").Empty()))
    ahead.process = SimpleNamespace(is_alive=lambda: False, exitcode=-9, pid=1234)
    with pytest.raises(RolloutWorkerError, match=r"rollout worker \(pid 1234\) died with exit code -9 .* step 4"):
        ahead.take(4, [{"task_id": "3"}])
    with pytest.raises(RolloutWorkerError, match="rows of step 4 differ"):
        ahead.take(4, [{"task_id": "5"}])


def test_a_stop_says_which_discarded_batches_were_played_in_flight_or_only_queued(caplog):
    """Issue 51.2: "3 batch(es) played or in flight ahead of step 11 discarded" at --max_staleness 1 counted the
    requests that were only queued. The worker counts the batches it started and finished; the trainer, those it
    took: of the requests never taken, the finished ones were played, the started ones in flight, the rest queued."""
    from tau2_rl.trainers.generation_ahead import Discarded, Progress
    from tau2_rl.trainers.multiturn_grpo import _AheadCallback

    class Channel:
        def put(self, item):
            pass

        def cancel_join_thread(self):
            pass

        def close(self):
            pass

    ahead = GenerationAhead.__new__(GenerationAhead)
    ahead.pending = deque(BatchRequest(step, [("3", step)], min_version=step - 1) for step in (11, 12, 13))
    ahead.process = SimpleNamespace(join=lambda timeout: None, is_alive=lambda: False)
    ahead.requests, ahead.results, ahead.server_weights, ahead.stopped = Channel(), Channel(), None, False
    # 10 batches taken; the worker finished the 11th (unread), was playing the 12th, and the 13th waits for weights
    ahead.taken, ahead.progress = 10, Progress(SimpleNamespace(value=12), SimpleNamespace(value=11))
    caplog.set_level("INFO", logger="tau2_rl.trainers.multiturn_grpo")
    _AheadCallback(ahead).on_train_end(None, SimpleNamespace(global_step=10), None)
    assert ahead.discarded == Discarded(played=1, in_flight=1, queued=1)
    assert [r.getMessage() for r in caplog.records if r.name == "tau2_rl.trainers.multiturn_grpo"] == [
        "generation ahead: the 3 batch(es) requested ahead of step 10 are discarded: 1 played, 1 in flight, 1 only "
        "queued (never started); a resumed run plays them with its weights"
    ]
    assert ahead.close() == Discarded()  # once


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"max_staleness": -1}, "--max_staleness must be >= 0"),
        ({"async_behaviour_cap": 1.0}, "--async_behaviour_cap must be > 1"),
        ({"rollout_worker_threads": 0}, "--rollout_worker_threads must be >= 1"),
    ],
)
def test_generation_ahead_flags_are_checked(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        MultiTurnGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=2,
                            per_device_train_batch_size=2, **flags)  # fmt: skip


def test_the_env_and_the_llm_user_pickle_as_their_recipes():
    """The worker process rebuilds them: the env with the prompt it showed, the user from its config."""
    env = compact_env(DomainEnv(AIRLINE))
    copy = pickle.loads(pickle.dumps(env))
    assert (copy.system_prompt, copy.tools, copy.config) == (env.system_prompt, env.tools, env.config)
    assert copy.reset("3", 7).messages == env.reset("3", 7).messages
    user = get_user_simulator("llm", base_url="http://127.0.0.1:9/v1", model="m")
    assert pickle.loads(pickle.dumps(user)).config == user.config


def test_the_worker_model_decodes_with_its_cache_and_like_the_trained_model(tiny_model):
    """Regression: built from the trainer's model config, where training has turned ``use_cache`` off, the worker
    decoded 10× slower. Its model has the cache on, the trained model's generation settings otherwise, and with the
    shared weights copied in its greedy decode equals the trained model's token for token."""
    tiny_model.config.use_cache = False  # as training leaves it (gradient checkpointing)
    tiny_model.generation_config.max_new_tokens = 7
    spec = SimpleNamespace(model_config=tiny_model.config, dtype=torch.float32,
                           model_generation_config=tiny_model.generation_config)  # fmt: skip
    worker = worker_model(spec)
    assert worker.config.use_cache is True and worker.generation_config.use_cache is True and not worker.training
    assert worker.generation_config.max_new_tokens == 7  # the trained model's settings, not from_config's defaults
    assert tiny_model.config.use_cache is False  # the trainer's model is left as it was
    with torch.no_grad():
        for name, tensor in worker.named_parameters():
            tensor.copy_(dict(tiny_model.named_parameters())[name])
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    tiny_model.config.use_cache = True
    assert torch.equal(worker.generate(prompt, **kwargs), tiny_model.eval().generate(prompt, **kwargs))


# The staleness bound of a run ahead by one step (0, then 1, never more; the first batch's behaviour weight 1):
# tests/test_quick_start_ahead.py checks it on the quick start at --max_staleness 1, whose learning CI checks anyway.


LAUNCH = {
    "python": [],  # no launcher: its own traceback would follow a failed child's line
    "one": ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml"],
    "two": ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/multi_gpu.yaml",
            "--num_processes", "2", "--mixed_precision", "no"],  # the CPU twins: torchrun, gloo, a worker per rank
}  # fmt: skip


def _ahead_command(out: Path, tmp_path: Path, steps: int, *extra: str, launch: str = "one") -> list[str]:
    rows = "4" if launch == "two" else "8"  # one group of 8 episodes per step, over the ranks
    return [
        sys.executable, *LAUNCH[launch], "train_grpo.py", "--config", "recipes/grpo/cpu_smoke.yaml",
        "--max_steps", str(steps), "--per_device_train_batch_size", rows, "--max_staleness", "1",
        "--output_dir", str(out), "--run_name", "ahead", "--hub_dir", str(tmp_path / "hub"), "--eval_strategy", "no",
        "--report_to", "none", *extra,
    ]  # fmt: skip


def _launch(command: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _named_semaphores() -> set[str]:
    """The POSIX named semaphores that exist now (glibc keeps them in /dev/shm as ``sem.NAME``)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("sem.*")} if shm.is_dir() else set()


def _left_semaphores(before: set[str], logs: str) -> list[str]:
    """Named semaphores a run left behind: files that appeared in /dev/shm and are still there, and the ones the
    resource tracker found registered at the end and had to unlink itself. A tracker line for a name that was
    already gone ("No such file or directory": unlinked by its owner, the tracker's bookkeeping one message short,
    seen once in CI under load) left nothing behind and does not count."""
    left = sorted(_named_semaphores() - before)
    unlinked = re.findall(r"resource_tracker: '([^']+)': \[Errno 2\]", logs)
    leaked = sum(int(n) for n in re.findall(r"There appear to be (\d+) leaked semaphore", logs))
    if leaked > len(unlinked):
        left.append(f"{leaked - len(unlinked)} semaphore(s) the resource tracker had to unlink")
    return left


def test_left_semaphores_counts_what_the_tracker_unlinked_but_not_names_already_gone():
    warned = "resource_tracker: There appear to be {} leaked semaphore objects to clean up at shutdown\n"
    gone = "UserWarning: resource_tracker: '/loky-6684-uh9_fxsg': [Errno 2] No such file or directory\n"
    before = _named_semaphores()
    assert _left_semaphores(before, "") == []
    assert _left_semaphores(before, warned.format(1) + gone) == []  # unlinked by its owner already: nothing left
    assert _left_semaphores(before, warned.format(2) + gone) == ["1 semaphore(s) the resource tracker had to unlink"]


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("launch", [pytest.param("one", marks=pytest.mark.exhaustive), "two"])  # CI: two processes
def test_sigterm_ahead_of_training_discards_the_batches_in_flight_and_the_rerun_resumes(tmp_path, launch):
    """SIGTERM during a --max_staleness 1 run: the step ends, a checkpoint is saved, the worker stops and the batch
    it played ahead is discarded and counted; the same command then resumes from the checkpoint (a fresh worker
    replays that batch with the checkpoint's weights: staleness 0 first) and finishes the run."""
    from test_graceful_stop import sigterm_after_a_step

    out, log = tmp_path / "run", tmp_path / "log.txt"
    steps_in_all = 5  # the stop lands at step 1 or 2, the rerun replays the discarded batch and trains the rest
    command = _ahead_command(out, tmp_path, steps_in_all, "--save_steps", "100", launch=launch)
    semaphores_before = _named_semaphores()
    sigterm_after_a_step(_launch(command, log), log)
    text = log.read_text()
    assert "SIGTERM received: saving a checkpoint at the end of this step" in text, text[-3000:]
    assert "SIGTERM again" not in text, text[-3000:]  # one signal reads as one, whatever relays it
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert checkpoints, text[-3000:]
    stopped = int(checkpoints[-1].name.split("-")[1])
    assert 1 <= stopped < steps_in_all
    # the batches announced to the worker ahead of the stop, counted on the main rank: played, playing or queued
    discarded = re.findall(rf"generation ahead: the (\d+) batch\(es\) requested ahead of step {stopped} are "
                           r"discarded: (\d+) played, (\d+) in flight, (\d+) only queued", text)  # fmt: skip
    assert len(discarded) == 1, text[-3000:]
    total, *parts = (int(n) for n in discarded[0])
    assert total >= 1 and sum(parts) == total, discarded
    log2 = tmp_path / "log2.txt"
    rerun = _launch(command, log2)
    assert rerun.wait(timeout=1200) == 0, log2.read_text()[-3000:]
    assert f"resuming from {checkpoints[-1]}" in log2.read_text(), log2.read_text()[-3000:]
    # the worker stopped mid-batch leaves no named semaphore behind (tqdm's lock was one: resource_tracker warned)
    assert not _left_semaphores(semaphores_before, log.read_text() + log2.read_text())
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = {entry["step"]: entry for entry in history if "async/staleness_max" in entry}
    assert sorted(steps) == list(range(1, steps_in_all + 1)), sorted(steps)
    assert steps[stopped + 1]["async/staleness_max"] == 0.0  # the replayed batch: the resumed weights, nothing ahead
    assert all(entry["async/staleness_max"] <= 1 for entry in steps.values())
    assert all(entry["loss"] != 0.0 for entry in steps.values())


def _rollout_workers(root: int) -> list[int]:
    """The rollout workers under ``root``: the ``spawn``ed processes (multiprocessing's resource tracker aside)."""
    from test_graceful_stop import children

    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        for child in children(pid):
            stack.append(child)
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline:
                found.append(child)
    return sorted(found)


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("launch", [pytest.param("python", marks=pytest.mark.exhaustive), "two"])  # CI: two
def test_a_rollout_worker_killed_mid_run_stops_the_run_in_one_line_with_a_checkpoint(tmp_path, launch):
    """kill -9 of the rollout worker: the trainer notices within its poll, saves the last finished step, exits 1
    with one line naming the worker and the checkpoint; it never hangs. In two processes the last rank's worker is
    killed: both ranks learn it at the next batch, save the checkpoint together and stop."""
    from test_graceful_stop import alive, wait_for_a_step

    out, log = tmp_path / "run", tmp_path / "log.txt"
    launcher = _launch(_ahead_command(out, tmp_path, 40, "--save_steps", "100", launch=launch), log)
    try:
        wait_for_a_step(launcher, log)
        workers = _rollout_workers(launcher.pid)
        assert len(workers) == (2 if launch == "two" else 1), workers  # one per rank
        worker = workers[-1]
        assert alive(worker)
        os.kill(worker, signal.SIGKILL)
        assert launcher.wait(timeout=300) == 1, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = log.read_text()
    lines = sorted({line for line in text.splitlines() if line.startswith("error:") and "rollout worker" in line})
    assert len(lines) == 1, text[-3000:]  # (torchrun repeats nothing of ours, but a rank's line may come twice)
    assert "died with exit code -9" in lines[0] and "rerun the same command to resume" in lines[0], lines[0]
    if launch == "python":
        assert "Traceback" not in text, text[-3000:]
    saved = re.search(r"checkpoint saved in (\S+?);", lines[0])
    assert saved and (Path(saved.group(1)) / "trainer_state.json").is_file(), lines[0]


BEFORE_GENERATION_AHEAD = "c22928a"  # the last commit before --max_staleness existed (issue 38)
OLD_PACKAGE = "airline_rl"  # the package's name in that tree (tau2_rl since 499c40a)
# wall-clock figures, which differ run to run
TIMING = re.compile(r"time|timing|seconds|per_second|latency|idle_share|idle_fraction|in_flight|flos")


def _logged_steps(command: list[str], cwd: Path, out: Path) -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(cwd)}  # fmt: skip
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [{k: v for k, v in entry.items() if not TIMING.search(k)} for entry in history if "loss" in entry]


def with_later_numerics(tree: Path) -> None:
    """The two deliberate changes of a run's figures made after issue 38 (fa6d1b5, a40362a), applied to the extracted
    old tree as text patches, so that what is compared is still the synchronous loop itself: the episode seeds include
    ``--seed`` (``MultiTurnGRPOTrainer._episode_seed``), and on CPU TRL's fused head scores the labelled positions
    only (``tau2_rl.trainers.fused_head``). A patch that no longer applies fails here, loudly."""
    path = tree / OLD_PACKAGE / "trainers" / "multiturn_grpo.py"
    text = path.read_text(encoding="utf-8")
    seed = "        return (self.state.global_step * 1_000_003 + global_index) % (2**31)\n"
    assert text.count(seed) == 1 and text.count("import time\n") == 1
    crc = 'zlib.crc32(f"{self.args.seed}/{self.state.global_step}/{global_index}".encode()) & 0x7FFFFFFF'
    text = text.replace(seed, f"        return {crc}\n").replace("import time\n", "import time\nimport zlib\n")
    text += (
        "\n\nimport trl.trainer.utils as _trl_utils  # noqa: E402\n\n_trl_choice = _trl_utils._use_triton\n"
        '_trl_utils._use_triton = lambda device: device.type == "cpu" or _trl_choice(device)\n'
    )
    path.write_text(text, encoding="utf-8")


@pytest.mark.slow
def test_max_staleness_0_is_the_run_from_before_generation_ahead_bit_for_bit(tmp_path, default_policy_cache):
    """3 quick-start steps at --max_staleness 0 against the same 3 steps of the tree before issue 38 (extracted from
    git, with the later numerics changes patched in: ``with_later_numerics``): every logged figure but the
    wall-clock ones equal, float for float, on this machine."""
    if subprocess.run(["git", "cat-file", "-e", f"{BEFORE_GENERATION_AHEAD}^{{commit}}"], cwd=ROOT).returncode != 0:
        pytest.skip(f"commit {BEFORE_GENERATION_AHEAD} is not in this checkout's history (a shallow clone?)")
    old = tmp_path / "before"
    old.mkdir()
    archive = subprocess.run(["git", "archive", BEFORE_GENERATION_AHEAD], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    with_later_numerics(old)

    def command(out: Path, cache: Path, *extra: str) -> list[str]:
        return [
            sys.executable, "train_grpo.py", "--config", "recipes/grpo/cpu_smoke.yaml", "--max_steps", "3",
            "--per_device_train_batch_size", "8", "--output_dir", str(out), "--hub_dir", f"{out}-hub",
            "--eval_strategy", "no", "--report_to", "none", "--warmup_cache_dir", str(cache), *extra,
        ]  # fmt: skip

    # One default policy for both trees: this tree's build (the same in both), which the old tree finds under its
    # own name for the prompt record (a copy of the build holding both names).
    # the tree before issue 38 trained with PRM-Lite's v2 rules (the default until issue 67): the same rules here
    now_run = command(tmp_path / "now", default_policy_cache, "--max_staleness", "0", "--prm_rules", "v2")
    now = _logged_steps(now_run, ROOT, tmp_path / "now")
    old_cache = tmp_path / "old-cache"
    for build in default_policy_cache.glob("default-policy-t*"):
        shutil.copytree(build, old_cache / build.name)
        record = old_cache / build.name / PROMPT_STYLE_FILE
        if record.is_file():
            shutil.copy(record, record.with_name(LEGACY_PROMPT_STYLE_FILE))
    before = _logged_steps(command(tmp_path / "before-run", old_cache), old, tmp_path / "before-run")
    assert len(now) == 3 and all(entry["loss"] != 0.0 for entry in now)
    for step, (mine, theirs) in enumerate(zip(now, before, strict=True), start=1):
        assert mine.keys() == theirs.keys(), (step, mine.keys() ^ theirs.keys())
        differ = {key: (mine[key], theirs[key]) for key in mine if mine[key] != theirs[key]}
        assert not differ, (step, differ)


# -- vLLM server mode: the worker samples on the server, the trainer pushes its weights there between batches


class _FakeGeneration:
    def __init__(self, log: list) -> None:
        self.log = log

    def sync_weights(self) -> None:  # TRL's push into the server (NCCL on a GPU)
        self.log.append("sync")


def _served_weights():
    import multiprocessing as mp

    from tau2_rl.trainers.generation_ahead import ServedWeights

    log: list = []
    trainer = SimpleNamespace(vllm_generation=_FakeGeneration(log), state=SimpleNamespace(global_step=0),
                              _last_loaded_step=-1)  # fmt: skip
    ctx = mp.get_context("spawn")
    playing, wanted, version = ctx.Lock(), ctx.Value("b", 0, lock=False), ctx.Value("q", 0, lock=False)
    return ServedWeights(trainer, playing, wanted, version), trainer, playing, version, log


def test_served_weights_wait_for_the_workers_batch_boundary():
    """A step's weights go into the server at once when the worker is between batches; while it plays a batch they
    wait (the batch plays on one version), and go in at the next try once it has let go; the newest step wins."""
    served, trainer, playing, version, log = _served_weights()
    served.offer(1)
    assert log == ["sync"] and version.value == 1 and trainer._last_loaded_step == 1 and served.pending is None
    assert playing.acquire(block=False)  # the worker starts a batch
    served.offer(2)
    served.offer(3)
    assert log == ["sync"] and version.value == 1 and served.pending == 3
    assert served.wanted.value == 1  # the worker lets it go first at its next batch boundary
    assert served.try_push() is False
    playing.release()  # the batch ends
    assert served.try_push() is True
    assert log == ["sync", "sync"] and version.value == 3 and served.pending is None and served.wanted.value == 0
    assert served.try_push() is False  # nothing pending
    assert served.pushes == 2


def test_trls_own_pushes_wait_for_the_batch_boundary_and_are_restored():
    """An evaluation's sampling through TRL's vLLM path calls ``sync_weights``: wrapped, it waits until the worker's
    batch ends and sets the server's version; after the run TRL's own method is back."""
    import threading

    served, trainer, playing, version, log = _served_weights()
    original = served._sync
    assert trainer.vllm_generation.sync_weights != original
    trainer.state.global_step = 5
    assert playing.acquire(block=False)
    pushed = threading.Event()
    thread = threading.Thread(target=lambda: (trainer.vllm_generation.sync_weights(), pushed.set()))
    thread.start()
    assert not pushed.wait(0.5) and log == []  # held back while the batch plays
    playing.release()
    assert pushed.wait(10) and log == ["sync"] and version.value == 5
    thread.join()
    served.restore()
    assert trainer.vllm_generation.sync_weights == original


def test_a_worker_between_batches_lets_a_pending_push_go_first_but_not_for_long():
    """The worker's next batch is admitted (k ≥ 2) while a push waits: it holds back up to YIELD_S for the trainer
    (here a thread pushing after 0.1 s), and takes the lock at once when nothing is pending or after YIELD_S."""
    import threading

    from tau2_rl.trainers.generation_ahead import YIELD_S, take_the_server

    served, trainer, playing, version, log = _served_weights()
    assert playing.acquire(block=False)  # the worker plays
    served.offer(4)
    playing.release()  # its batch ends; the trainer pushes 0.1 s later (it was waiting for the batch)
    timer = threading.Timer(0.1, served.try_push)
    timer.start()
    assert take_the_server(playing, served.wanted, os.getppid())
    assert log == ["sync"] and version.value == 4  # the push went in before the next batch
    playing.release()
    timer.join()
    served.wanted.value = 1  # a push nobody makes (the trainer is busy training): the worker goes on after YIELD_S
    assert YIELD_S < 1
    assert take_the_server(playing, served.wanted, os.getppid())  # returns, holding the lock, with nothing pushed
    assert served.wanted.value == 1 and log == ["sync"] and not playing.acquire(block=False)
    playing.release()


def test_a_dead_worker_holding_the_server_ends_the_push_with_one_line():
    served, trainer, playing, version, log = _served_weights()
    served.alive = lambda: False
    assert playing.acquire(block=False)  # held by a worker that then died
    with pytest.raises(RolloutWorkerError, match="rollout worker died holding the vLLM server"):
        served.push_now(1)
    assert log == []


class _FakeClient:
    def __init__(self, logprobs: bool = True) -> None:
        self.calls: list[dict] = []
        self.logprobs = logprobs

    def generate(self, prompts, **kwargs):
        self.calls.append({"prompts": prompts, **kwargs})
        seed = kwargs["generation_kwargs"].get("seed", 0)
        ids = [100 + seed, 7]
        return {"completion_ids": [ids], "logprobs": [[[-0.5], [-0.25]]] if self.logprobs else None}


def test_the_server_backend_sends_one_seeded_request_per_episode_and_keeps_the_servers_logprobs():
    from tau2_rl.backends.vllm_server import VLLMServerBackend

    client = _FakeClient()
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "generation_kwargs": {"presence_penalty": 0.1}}  # fmt: skip
    backend = VLLMServerBackend("http://unused", sampling, eos_token_ids=[7], client=client)
    ids, logprobs = backend.generate([[1, 2], [3]], max_new_tokens=5, seeds=[11, 12])
    assert ids == [[111, 7], [112, 7]] and logprobs == [[-0.5, -0.25], [-0.5, -0.25]]
    assert sorted(call["generation_kwargs"]["seed"] for call in client.calls) == [11, 12]
    call = client.calls[0]
    assert call["max_tokens"] == 5 and call["logprobs"] == 0 and call["temperature"] == 0.7 and call["top_p"] == 0.9
    assert call["generation_kwargs"]["stop_token_ids"] == [7] and call["generation_kwargs"]["presence_penalty"] == 0.1
    assert sorted(tuple(c["prompts"][0]) for c in client.calls) == [(1, 2), (3,)]
    assert backend.generate([], max_new_tokens=5) == ([], None)
    no_logprobs = VLLMServerBackend("http://unused", sampling, eos_token_ids=[7], client=_FakeClient(logprobs=False))
    with pytest.raises(RuntimeError, match="--logprobs-mode processed_logprobs"):
        no_logprobs.generate([[1]], max_new_tokens=2, seeds=[0])
    backend.close()


@pytest.mark.parametrize(
    ("mode", "processes", "kind", "message"),
    [
        ("colocate", 1, "NO", "colocated vLLM generates in the training process.*--vllm_mode server"),
        ("server", 1, "NO", None),
        ("server", 2, "MULTI_GPU", None),  # the ranks push together (ServedWeights in lockstep)
        ("server", 2, "DEEPSPEED", None),
        ("server", 2, "FSDP", None),
        (None, 2, "DEEPSPEED", "on the transformers path runs on one process or DDP on CPU, not under DEEPSPEED"),
    ],
)
def test_generation_ahead_with_vllm_is_refused_or_taken_in_one_line(mode, processes, kind, message):
    from accelerate.utils import DistributedType

    from tau2_rl.run.sharding import LaunchError
    from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

    trainer = SimpleNamespace(
        use_vllm=mode is not None, args=SimpleNamespace(max_staleness=1, vllm_mode=mode, async_correction="truncate"),
        accelerator=SimpleNamespace(num_processes=processes, distributed_type=DistributedType[kind]),
    )  # fmt: skip
    if message is None:
        MultiTurnGRPOTrainer._check_generation_ahead(trainer)  # accepted
    else:
        with pytest.raises(LaunchError, match=message):
            MultiTurnGRPOTrainer._check_generation_ahead(trainer)


def _two_rank_pushes(rank: int, init_file: str, out: str) -> None:
    """One rank of ``test_two_ranks_push_into_the_server_together``: its trainer side (``take`` and
    ``ServedWeights``, gathering over gloo) and a fake worker thread holding the rank's lock while it plays."""
    import queue
    import threading
    import time

    import torch.distributed as dist

    from tau2_rl.trainers.generation_ahead import PlayedBatch, ServedWeights

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    log: list = []

    def sync() -> None:  # TRL's push: a collective (the ZeRO-3 / FSDP gathers), then the main process sends
        dist.barrier()
        log.append(("sync", round(time.perf_counter() - start, 2)))

    def gather(item):
        items = [None, None]
        dist.all_gather_object(items, item)
        return items

    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(sync_weights=sync),
                              state=SimpleNamespace(global_step=1), _last_loaded_step=0)  # fmt: skip
    playing, wanted, version = threading.Lock(), SimpleNamespace(value=0), SimpleNamespace(value=0)
    served = ServedWeights(trainer, playing, wanted, version, gather=gather)
    ahead = GenerationAhead.__new__(GenerationAhead)
    ahead.k, ahead._last_take, ahead.lockstep, ahead.gather = 1, None, True, gather
    ahead.server_weights, ahead.results = served, queue.Queue()
    ahead.process = SimpleNamespace(is_alive=lambda: True, exitcode=None, pid=0)
    ahead.pending = deque([BatchRequest(1, [("3", 1)], min_version=0)])
    batch_seconds = 0.3 + 1.2 * rank  # rank 1's worker ends its batch ~1.2 s after rank 0's

    def worker() -> None:  # plays the batch of step 1 holding the lock, then tries to start the next one at once
        with playing:
            time.sleep(batch_seconds)
        ahead.results.put(PlayedBatch(1, 0, [], [], [], [], [], None, batch_seconds, 0.0))
        time.sleep(0.5)  # rank 0: 0.8 s in, while rank 1's worker still plays, its trainer holds the lock
        got = playing.acquire(timeout=0.3)
        log.append(("next batch", got))
        if got:
            playing.release()

    start = time.perf_counter()
    playing.acquire()  # the worker is mid-batch when the step ends
    thread = threading.Thread(target=worker)
    playing.release()
    thread.start()
    time.sleep(0.1)
    served.offer(1)  # both workers mid-batch: pending on both ranks
    pending_after_offer = served.pending
    batch = ahead.take(1, [{"task_id": "3"}])
    took = round(time.perf_counter() - start, 2)
    thread.join()
    # a worker dead with its lock: every rank's push_now ends in one line naming the rank
    if rank == 1:
        served.alive = lambda: False
        assert playing.acquire(True, 10)
    try:
        served.push_now(2)
        dead = None
    except RolloutWorkerError as err:
        dead = str(err)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "log": log, "pending_after_offer": pending_after_offer, "took": took, "version": version.value,
        "batch_step": batch.train_step, "dead": dead, "pushes": served.pushes,
    }))  # fmt: skip
    dist.destroy_process_group()


@pytest.mark.serial
def test_two_ranks_push_into_the_server_together(tmp_path):
    """vLLM server mode with two training processes: TRL's push is a collective, so the ranks push only when both
    workers are between batches, leave their wait for the batch together, and a rank that got its worker's lock
    keeps it until the push (its worker's next batch waits, so the push is not starved by the workers taking turns).
    A dead worker ends every rank's push in one line."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=_two_rank_pushes, args=(r, str(tmp_path / "init"), str(tmp_path))) for r in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [process.exitcode for process in ranks] == [0, 0]
    result = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in result:
        assert rank["pending_after_offer"] == 1  # held back on both ranks: rank 1's worker was mid-batch
        assert rank["batch_step"] == 1 and rank["version"] == 1 and rank["pushes"] == 1
        syncs = [t for kind, t in rank["log"] if kind == "sync"]
        assert len(syncs) == 1 and syncs[0] >= 1.3  # after rank 1's batch ended (0.1 + 1.5 s in), on both ranks
        assert rank["took"] >= 1.3  # the ranks left the wait together
        assert "rank 1" in rank["dead"] and "died holding the vLLM server" in rank["dead"]
    # rank 0's worker, done first, could not start its next batch while its trainer held the lock for the push
    assert ("next batch", False) in [tuple(entry) for entry in result[0]["log"]]


@pytest.mark.parametrize("correction", ["truncate", "mask", "none"])
def test_the_behaviour_weight_comes_from_the_losss_own_forward_when_one_step_trains_a_batch(correction):
    """One optimiser step per generation batch: the proximal policy is the loss forward's, so TRL's extra
    ``old_per_token_logps`` forward at scoring is skipped and the weight exp(proximal − behaviour), truncated or
    masked at the cap as TRL's token modes, is made from the loss's first forward (the policy's, not a reference
    model's after it). With two iterations per batch TRL's own scoring-time forward stays."""
    from collections import defaultdict

    from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer

    proximal = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])

    class Probe(MultiTurnGRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            self.forwards += 1
            return proximal.clone().requires_grad_(), None, None

    trainer = Probe.__new__(Probe)
    trainer.__dict__.update(
        _ahead=object(), model=SimpleNamespace(training=True), num_iterations=1, forwards=0, use_vllm=False,
        vllm_importance_sampling_correction=False, vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_max=3.0, vllm_importance_sampling_clip_min=0.5, _metrics=defaultdict(
            lambda: defaultdict(list)),
        args=SimpleNamespace(async_correction=correction, async_behaviour_cap=5.0, steps_per_generation=1,
                             gradient_accumulation_steps=1),
    )  # fmt: skip
    with trainer._behaviour_correction():  # scoring: no old_per_token_logps forward asked of TRL
        assert trainer.use_vllm and not trainer.vllm_importance_sampling_correction
    # behaviour log-probs: equal, 1 nat below (weight e), 2 nats below (e² > 5: truncated or masked), an env token
    inputs = {"sampling_per_token_logps": torch.tensor([[-1.0, -2.0, -3.0, -9.0]]),
              "completion_mask": torch.ones(1, 4), "tool_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]])}  # fmt: skip
    with trainer._behaviour_correction(inputs):
        assert trainer.vllm_importance_sampling_correction == (correction != "none")
        assert trainer.vllm_importance_sampling_mode == ("token_mask" if correction == "mask" else "token_truncate")
        trainer._get_per_token_logps_and_entropies()
        trainer._get_per_token_logps_and_entropies()  # a second forward (a reference model's) is not weighed
    assert trainer.forwards == 2 and "_get_per_token_logps_and_entropies" not in trainer.__dict__
    assert (trainer.use_vllm, trainer.vllm_importance_sampling_correction) == (False, False)  # restored
    assert (
        trainer.vllm_importance_sampling_mode == "sequence_mask" and trainer.vllm_importance_sampling_clip_min == 0.5
    )
    expected = {"truncate": [1.0, math.e, 5.0, 1.0], "mask": [1.0, math.e, 0.0, 1.0]}
    if correction == "none":
        assert "importance_sampling_ratio" not in inputs
    else:
        assert inputs["importance_sampling_ratio"][0].tolist() == pytest.approx(expected[correction])
        assert not inputs["importance_sampling_ratio"].requires_grad
    metrics = trainer._metrics["train"]
    assert len(metrics["async/behaviour_weight"]) == 1
    assert metrics["async/behaviour_weight_truncated"] == [pytest.approx(1 / 3 if correction != "none" else 0.0)]
    assert metrics["async/kl_behaviour"][0] > 0
    trainer.num_iterations = 2  # the batch trains twice: TRL's scoring-time forward is the proximal policy
    with trainer._behaviour_correction():
        assert trainer.vllm_importance_sampling_correction == (correction != "none")
    with trainer._behaviour_correction(inputs):
        assert "_get_per_token_logps_and_entropies" not in trainer.__dict__
