"""Generation ahead of training (``--max_staleness``): the lookahead, the behaviour-weight metrics, the worker's
failure line, the flags, and (slow) a short run whose logged staleness stays within the bound."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from airline_rl.configs import MultiTurnGRPOConfig
from airline_rl.envs.episode import AirlineEnv
from airline_rl.envs.prompt_style import compact_env
from airline_rl.envs.users import get_user_simulator
from airline_rl.trainers.generation_ahead import (
    BatchRequest,
    GenerationAhead,
    Lookahead,
    RolloutWorkerError,
    behaviour_stats,
)

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
    env = compact_env(AirlineEnv())
    copy = pickle.loads(pickle.dumps(env))
    assert (copy.system_prompt, copy.tools, copy.config) == (env.system_prompt, env.tools, env.config)
    assert copy.reset("3", 7).messages == env.reset("3", 7).messages
    user = get_user_simulator("llm", base_url="http://127.0.0.1:9/v1", model="m")
    assert pickle.loads(pickle.dumps(user)).config == user.config


@pytest.mark.slow
def test_a_run_ahead_by_one_step_keeps_its_staleness_within_the_bound(tmp_path):
    """3 steps of the quick start at --max_staleness 1: staleness 0 then 1 (never above the bound), the behaviour
    weight exactly 1 on the first batch (the weights that sampled it are the proximal ones), a non-zero loss."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml",
        "train_grpo.py", "--config", "recipes/grpo/cpu_smoke.yaml", "--max_steps", "3",
        "--per_device_train_batch_size", "8",  # one group per step (shrunk from two)
        "--max_staleness", "1", "--output_dir", str(out), "--run_name", "ahead", "--hub_dir", str(tmp_path / "hub"),
        "--eval_strategy", "no", "--save_steps", "100",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    steps = [entry for entry in history if "async/staleness" in entry]
    assert [entry["async/staleness_max"] for entry in steps] == [0.0, 1.0, 1.0]
    assert steps[0]["async/behaviour_weight"] == pytest.approx(1.0, abs=1e-4)
    assert all(entry["loss"] != 0.0 for entry in steps)
    assert "generation runs ahead of training by at most 1 step(s)" in done.stdout + done.stderr
