"""Generation backends outside the trainer (evaluation, trajectory collection, benchmarks).

Both implement ``airline_rl.rollout.GenerationBackend``: a batch of token-id prompts in, sampled ids out, one call
per wave. The trainer uses its own backend over TRL's ``_generate_single_turn`` instead (``TrainerBackend``).

- ``TransformersBackend``: ``model.generate`` on left-padded prompts (CPU or GPU), batched across episodes.
- ``VLLMBackend``: vLLM's offline ``LLM`` engine with token-id prompts and prefix caching (optional dependency).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class TransformersBackend:
    """Batched ``generate`` with a transformers causal LM; greedy when ``temperature == 0``."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_token_ids: list[int] | None = None,
        max_batch_size: int = 64,
        seed: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        eos = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.eos_token_ids = [i for i in eos if i is not None]
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.max_batch_size = max_batch_size
        self.generator_seed = seed

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], None]:
        if not prompts:
            return [], None
        if self.generator_seed is not None:
            torch.manual_seed(self.generator_seed)
            self.generator_seed += 1
        results: list[list[int]] = []
        for start in range(0, len(prompts), self.max_batch_size):
            results.extend(self._generate_batch(prompts[start : start + self.max_batch_size], max_new_tokens))
        return results, None

    def _generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        device = self.model.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[row, width - len(prompt) :] = 1
        sampling = self.temperature > 0
        output = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=sampling,
            temperature=self.temperature if sampling else None,
            top_p=self.top_p if sampling else None,
            top_k=0 if sampling else None,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
        )
        completions = []
        for row in output[:, width:].tolist():
            ids = []
            for token in row:
                ids.append(token)
                if token in self.eos_token_ids:
                    break
            while ids and ids[-1] == self.pad_token_id and self.pad_token_id not in self.eos_token_ids:
                ids.pop()
            completions.append(ids)
        return completions


def require_vllm(flag: str = "--backend vllm") -> None:
    """Fails at once, naming the flag, when vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"{flag} needs vLLM, which is not installed: pip install -r requirements-gpu.txt")


class VLLMBackend:
    """vLLM's offline engine over token-id prompts (prefix caching on: every episode shares the system prompt)."""

    def __init__(
        self,
        model_path: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        gpu_memory_utilization: float = 0.8,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        require_vllm()
        from vllm import LLM  # noqa: PLC0415 - optional dependency

        self.llm = LLM(
            model=model_path,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=True,
        )
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        if not prompts:
            return [], []
        from vllm import SamplingParams  # noqa: PLC0415

        params = SamplingParams(
            temperature=self.temperature, top_p=self.top_p, max_tokens=max_new_tokens, logprobs=0, seed=None
        )
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ids, logprobs = [], []
        for output in outputs:
            completion = output.outputs[0]
            ids.append(list(completion.token_ids))
            logprobs.append(
                [next(iter(lp.values())).logprob if lp else 0.0 for lp in (completion.logprobs or [])]
                or [0.0] * len(completion.token_ids)
            )
        return ids, logprobs
