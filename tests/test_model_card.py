"""The model card's load snippet works from where a user stands: the repository root, the hub dir, the run dir."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tau2_rl.data.tiny_model import build_tiny_model
from tau2_rl.trainers.sft import export_model_dir


def snippet(readme: Path) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", readme.read_text(encoding="utf-8"), re.S)
    return code


@pytest.mark.parametrize("where", ["root", "hub", "run", "revision"])
def test_the_model_card_snippet_loads_the_revision(tmp_path: Path, monkeypatch, where: str) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny", vocab_size=512)
    monkeypatch.chdir(tmp_path)  # the repository root: hub_dir is the relative "hub", as in the recipes
    revision = (tmp_path / export_model_dir(model_dir, "hub", "my-run", 7, {"config": {}, "metrics": {}})).resolve()
    places = {"root": tmp_path, "hub": tmp_path / "hub", "run": tmp_path / "hub" / "my-run", "revision": revision}
    monkeypatch.chdir(places[where])
    scope: dict = {}
    exec(snippet(revision / "README.md"), scope)  # noqa: S102 - running the snippet is the test
    assert Path(scope["path"]).resolve() == revision.resolve()
    assert scope["model"].config.vocab_size == 512 and scope["tokenizer"] is not None


def test_the_card_names_the_domain_it_was_trained_on() -> None:
    from tau2_rl.run.hub import model_card
    from tau2_rl.trainers.sft import model_card as sft_card

    airline = model_card("r", 2, {"config": {"variant": "joint"}})
    assert "tags: [trl, grpo, tau2-bench, airline, tool-calling]" in airline
    assert "Policy trained on the τ²-bench airline domain" in airline
    retail = model_card("r", 2, {"config": {"domain": "retail", "tasks_sha256": "ab" * 32}})
    assert "tags: [trl, grpo, tau2-bench, retail, tool-calling]" in retail
    assert "τ²-bench retail domain" in retail and "airline domain" not in retail
    assert f"- `tasks_sha256`: {'ab' * 32}" in retail
    assert "teacher trajectories of the τ²-bench retail domain" in sft_card("s", 1, {"config": {"domain": "retail"}})
