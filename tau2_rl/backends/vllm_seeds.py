"""Per-request seeds for TRL's colocated vLLM engine: each episode turn samples from its own seed.

Why: on the transformers path every rollout row samples from its own seeded generator, so a run does not depend on
how its rows are spread over processes and generation calls. TRL's vLLM path (colocate and server, the path every GPU
user takes) builds one ``SamplingParams`` per call, and vLLM then draws every request of the batch from the engine's
one generator: the same episode gives other tokens when it is played in a batch of 16 than in one of 8.

vLLM takes a seed per request (``SamplingParams.seed``: that request draws from its own generator). TRL's colocated
``VLLMGeneration.generate`` hands ``self.llm.generate`` one ``SamplingParams`` for the whole batch, so ``SeededLLM``
wraps the engine: when the episode loop has set this call's seeds (one per prompt, ``turn_seed(episode seed, turn)``),
the single ``SamplingParams`` becomes one copy per prompt with its seed; everything else (weight sync, sleep, wake-up)
goes to the engine unchanged. What stays batch-seeded, and says so once in the log: server mode (``trl vllm-serve``
takes one set of sampling parameters per request batch) and tensor parallelism (TRL gathers the prompts of the
tensor-parallel group into one call, whose seeds this process does not know).
"""

from __future__ import annotations

from typing import Any


class SeededLLM:
    """The colocated ``vllm.LLM`` with per-request seeds for the next ``generate`` call (``seeds``, then cleared)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.seeds: list[int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(self, prompts: Any, sampling_params: Any = None, *args: Any, **kwargs: Any) -> Any:
        seeds, self.seeds = self.seeds, None
        if seeds is not None and sampling_params is not None and not isinstance(sampling_params, list | tuple):
            if len(seeds) != len(prompts):
                raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
            sampling_params = [with_seed(sampling_params, seed) for seed in seeds]
        return self._llm.generate(prompts, sampling_params, *args, **kwargs)


def with_seed(params: Any, seed: int) -> Any:
    """A copy of ``params`` that draws from its own generator seeded with ``seed`` (vLLM seeds are 64-bit ints)."""
    copy = params.clone()
    copy.seed = int(seed) % (2**63)
    return copy


def seed_requests(trainer: Any) -> SeededLLM | str:
    """Wraps the trainer's colocated engine (once) and returns it, or why its rollouts stay batch-seeded."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None:
        return "no vLLM engine"
    if generation.mode != "colocate":
        return "vLLM server mode (trl vllm-serve takes one set of sampling parameters per request batch)"
    if getattr(generation, "tensor_parallel_size", 1) > 1:
        return "vLLM tensor parallelism (TRL gathers the group's prompts into one call)"
    if not isinstance(generation.llm, SeededLLM):
        generation.llm = SeededLLM(generation.llm)
    return generation.llm
