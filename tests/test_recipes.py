"""Every training recipe parses with the pinned transformers/TRL (a renamed field fails here, not on a GPU box).

The GPU recipes ask for bf16, which TrainingArguments refuses on a machine without a GPU; the test overrides only
that, so every other key is checked exactly as a user's launch would check it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import train_grpo
import train_sft
from tau2_rl.envs.multi import run_env, run_split

REPO_ROOT = Path(__file__).resolve().parents[1]
GRPO_RECIPES = sorted(
    [*(REPO_ROOT / "recipes" / "grpo").glob("*.yaml"), *(REPO_ROOT / "recipes" / "ablation").glob("grpo_*.yaml")]
)
SFT_RECIPES = sorted(
    [*(REPO_ROOT / "recipes" / "sft").glob("*.yaml"), *(REPO_ROOT / "recipes" / "ablation").glob("sft_*.yaml")]
)
CPU_OVERRIDES = ["--bf16", "false", "--use_cpu", "true"]  # GPU recipes on this CPU-only machine


@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_grpo_recipe_parses(recipe: Path) -> None:
    script_args, training_args, _ = train_grpo.make_parser().parse_args_and_config(
        args=["--config", str(recipe), *CPU_OVERRIDES]
    )
    assert training_args.variant in {"vanilla", "turn_discount", "prm_lite", "lata", "joint"}
    assert training_args.max_steps > 0
    # its domains and split resolve (a split no domain of it has, or a domain nobody registered, fails here)
    split = run_split(run_env(script_args.domain_specs()), script_args.split, script_args.split_file)
    assert split.train and split.test
    # One advantage normalisation for every variant (a fair ablation), and not the group std, which blows PRM-Lite's
    # small differences in all-fail groups up to unit-size advantages (issue 12).
    assert training_args.scale_rewards == "none"


def test_group_std_scaling_with_a_process_reward_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    recipe = str(REPO_ROOT / "recipes" / "grpo" / "prm_lite.yaml")
    with caplog.at_level("WARNING", logger="tau2_rl.configs"):
        train_grpo.make_parser().parse_args_and_config(args=["--config", recipe, *CPU_OVERRIDES])
    assert "--scale_rewards" not in caplog.text
    with caplog.at_level("WARNING", logger="tau2_rl.configs"):
        train_grpo.make_parser().parse_args_and_config(
            args=["--config", recipe, *CPU_OVERRIDES, "--scale_rewards", "group"]
        )
    assert "--scale_rewards group with variant 'prm_lite'" in caplog.text and "farm" in caplog.text


@pytest.mark.parametrize("recipe", SFT_RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_sft_recipe_parses(recipe: Path) -> None:
    parsed = train_sft.make_parser().parse_args_and_config(args=["--config", str(recipe), *CPU_OVERRIDES])
    training_args = parsed[1]
    assert training_args.learning_rate > 0
