"""A resumed evaluation is the evaluation: each episode samples from its own seed (task, sample index, configuration),
never from what shared its batch or ran before, so interrupted + resumed results equal uninterrupted ones, episode by
episode, with sampling on (temperature 1) and chunks of different composition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_evaluate import env, one_torch_thread, tiny_args, tiny_model  # noqa: F401 (fixtures)
from transformers import AutoModelForCausalLM, AutoTokenizer

from tau2_rl.backends import TransformersBackend
from tau2_rl.evaluation import evaluator as evaluator_module
from tau2_rl.evaluation import run_evaluation
from tau2_rl.sampling import PerRowSampler


def episodes(path: Path) -> dict[tuple[str, int], dict]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return {(task, s["sample"]): s for task, entry in data["tasks"].items() for s in entry["samples"]}


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path: Path, tiny_model: Path, monkeypatch) -> None:  # noqa: F811
    settings = {"tasks": "0,1,18", "num_samples": 3, "temperature": 1.0, "batch_size": 4, "save_messages": True,
                "max_turn_tokens": 6, "max_new_tokens": 256}  # fmt: skip
    (whole,) = run_evaluation(tiny_args(tmp_path / "whole", tiny_model, **settings))

    calls = {"n": 0}
    real = evaluator_module.run_episodes

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluator_module, "run_episodes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_evaluation(tiny_args(tmp_path / "resumed", tiny_model, **settings))
    monkeypatch.setattr(evaluator_module, "run_episodes", real)
    # resumed in other chunks: the 5 pending episodes run as 3 + 2 instead of the uninterrupted run's 4 + 1
    (resumed,) = run_evaluation(tiny_args(tmp_path / "resumed", tiny_model, **{**settings, "batch_size": 3}))
    runs = json.loads(resumed.read_text())["runs"]
    assert [r["episodes"] for r in runs] == [4, 5]
    expected, got = episodes(whole), episodes(resumed)
    assert expected.keys() == got.keys() and len(expected) == 9
    texts = {json.dumps(e["messages"]) for e in expected.values()}
    assert len(texts) == 9  # sampling really is on: no two episodes alike
    for key in expected:
        assert got[key] == expected[key], key


def test_per_row_sampling_does_not_depend_on_the_batch(tiny_model: Path) -> None:  # noqa: F811
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [tokenizer(text)["input_ids"] for text in ("Hello there", "My reservation", "cancel it please now")]

    def backend() -> TransformersBackend:
        return TransformersBackend(model, tokenizer, temperature=1.0, seed=0, prefix_cache=False)

    alone = [backend().generate([p], 12, seeds=[7 + i])[0][0] for i, p in enumerate(prompts)]
    together = backend().generate(prompts, 12, seeds=[7, 8, 9])[0]
    reordered = backend().generate(prompts[::-1], 12, seeds=[9, 8, 7])[0][::-1]
    assert alone == together == reordered
    assert len({tuple(ids) for ids in together}) == 3


def test_per_row_sampler_draws_from_the_tempered_top_p_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = torch.zeros(4)
    sampler = PerRowSampler([0], temperature=1.0, top_p=0.7)
    for _ in range(2000):
        counts[int(sampler(None, logits.clone()).argmax())] += 1
    assert counts[2] == counts[3] == 0  # outside the top-0.7 nucleus {0.5, 0.3}
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.04
    with pytest.raises(ValueError, match="seeds"):
        sampler(None, torch.zeros(2, 4))
