"""``benchmarks/readme_numbers.py`` turns its runs into the README's figures (the runs themselves take minutes and
are not run here: this checks the table from synthetic results, and that bad --seeds is one line)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "readme_numbers.py"


@pytest.fixture(scope="module")
def readme_numbers():
    spec = importlib.util.spec_from_file_location("readme_numbers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_run(seed: int, reward: list[float]) -> dict:
    return {"name": f"quickstart-seed{seed}", "seed": seed, "seconds": 235.0, "reward": reward,
            "quarters": (reward[0], reward[-1], reward[-1] - reward[0]), "nonzero_loss": 4, "steps": 4,
            "other_quarters": {"turns": (1.8, 3.6, 1.8), "tool_calls": (0.6, 1.5, 0.9),
                               "truncation_rate": (0.08, 0.23, 0.15)},
            "heldout": [(2, 0.15), (4, 0.35)]}  # fmt: skip


def test_the_table_names_commit_machine_figures_and_the_seed_range(readme_numbers) -> None:
    runs = [fake_run(42, [0.25, 0.5, 0.5, 0.75]), fake_run(1, [0.25, 0.25, 0.5, 0.5]), fake_run(2, [0.5] * 4)]
    evals = {"default": {"pass1": 0.156, "ci": (0.03, 0.28), "pass2": 0.02, "floor": 0.0},
             "test-trained": {"pass1": 0.325, "ci": (0.2, 0.45), "pass2": None, "floor": 0.4}}  # fmt: skip
    lines = readme_numbers.table(runs, evals, 39.0)
    text = "\n".join(lines)
    assert lines[0].startswith("commit ") and "cores" in lines[0] and "torch" in lines[0]
    assert "| quick start, wall time (seed 42) | 235 s (39 s building the default policy) |" in text
    assert "| per-step outcome reward | 0.25 0.50 0.50 0.75 |" in text
    assert "| reward, first → last quarter | 0.25 → 0.75 (+0.50, ×3.0) |" in text
    assert "| held-out pass^1 (10 test tasks × 2) | 0.15 at step 2, 0.35 at step 4 |" in text
    assert "| evaluate.py pass^1, task 3, warmed default (32 episodes) | 0.156 [0.03, 0.28], pass^2 0.020 |" in text
    assert "| evaluate.py pass^1, task 3, last revision | n/a |" in text  # not evaluated: said, not invented
    assert "10 test tasks × 4, last revision | 0.325 [0.20, 0.45], noop floor 0.400 |" in text
    assert "| learning gain over 3 seeds (last − first quarter) | +0.00 to +0.50 (seed 42 +0.50, seed 1 +0.25," in text
    assert all(line.count("|") in (0, 3) for line in lines[2:]), text


def test_bad_seeds_are_one_line(readme_numbers, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        readme_numbers.main(["--seeds", "a,b"])
    assert info.value.code == 2 and "--seeds: comma-separated integers" in capsys.readouterr().err
