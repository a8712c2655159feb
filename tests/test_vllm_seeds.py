"""Per-request seeds for TRL's colocated vLLM engine (``tau2_rl/backends/vllm_seeds.py``), without vLLM: the
engine and its ``SamplingParams`` are stand-ins with vLLM's interface (``clone``, ``seed``, ``generate``). The real
engine's side, the same episodes played in one batch or two giving the same tokens, runs in CI's vLLM stage
(``tests/test_vllm.py``)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from tau2_rl.backends import vllm_seeds


class Params:
    def __init__(self, temperature: float = 1.0, seed: int | None = None) -> None:
        self.temperature, self.seed = temperature, seed

    def clone(self) -> Params:
        return copy.deepcopy(self)


class Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[list, object]] = []
        self.slept = False

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        return ["out"] * len(prompts)

    def sleep(self, level: int) -> None:
        self.slept = True


def trainer(mode: str = "colocate", tp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(vllm_generation=SimpleNamespace(mode=mode, tensor_parallel_size=tp, llm=Engine()))


def test_a_colocated_engine_gets_one_seeded_copy_of_the_parameters_per_prompt() -> None:
    owner = trainer()
    engine = owner.vllm_generation.llm
    seeded = vllm_seeds.seed_requests(owner)
    assert isinstance(seeded, vllm_seeds.SeededLLM) and owner.vllm_generation.llm is seeded
    assert vllm_seeds.seed_requests(owner) is seeded  # wrapped once
    shared = Params(temperature=0.7)
    seeded.seeds = [11, 12, 13]
    assert seeded.generate([[1], [2], [3]], sampling_params=shared, use_tqdm=False) == ["out"] * 3
    prompts, params = engine.calls[-1]
    assert [p.seed for p in params] == [11, 12, 13] and all(p.temperature == 0.7 for p in params)
    assert shared.seed is None  # TRL's object is left as it was
    seeded.generate([[1]], sampling_params=shared)  # the seeds were this call's only: the next one is TRL's own
    assert engine.calls[-1][1] is shared
    seeded.sleep(level=2)  # everything else goes to the engine
    assert engine.slept
    seeded.seeds = [1, 2]
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        seeded.generate([[1]], sampling_params=shared)


@pytest.mark.parametrize(("mode", "tp", "why"), [("server", 1, "vLLM server mode"), ("colocate", 2, "tensor")])
def test_paths_that_stay_batch_seeded_say_why(mode: str, tp: int, why: str) -> None:
    owner = trainer(mode, tp)
    reason = vllm_seeds.seed_requests(owner)
    assert isinstance(reason, str) and why in reason
    assert isinstance(owner.vllm_generation.llm, Engine)  # left alone
