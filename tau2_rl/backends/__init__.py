"""Generation backends outside the trainer (evaluation, trajectory collection, benchmarks).

Both implement ``tau2_rl.rollout.GenerationBackend``: a batch of token-id prompts in, sampled ids out, one call
per wave. The trainer uses its own backend over TRL's ``_generate_single_turn`` instead (``TrainerBackend``).

- ``TransformersBackend``: ``model.generate`` on left-padded prompts (CPU or GPU), batched across episodes.
- ``VLLMBackend``: vLLM's offline ``LLM`` engine with token-id prompts and prefix caching (optional dependency).
- ``shared_prefix.SharedPrefixTransformersBackend``: the transformers backend whose rows attend to one copy of the
  shared system-prompt prefix (the evaluator's default on the transformers path).
- ``trl_prefix.TrlPrefixGeneration``: that backend with TRL's decoding rule, for the trainer's rollouts.
- ``attention``: the grouped-query decoding both transformers backends switch to while they generate.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import time
from typing import Any

import torch

from tau2_rl.run.dependencies import require

logger = logging.getLogger(__name__)


class _StepClock:
    """A ``generate`` streamer that only timestamps: prompt received, first new token (end of prefill), last token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        self.times.append(time.perf_counter())

    def split(self) -> tuple[float, float]:
        """(prefill seconds, decode seconds); the first new token counts as prefill."""
        if len(self.times) < 3:
            return (self.times[-1] - self.times[0], 0.0) if len(self.times) >= 2 else (0.0, 0.0)
        return self.times[1] - self.times[0], self.times[-1] - self.times[1]


def _common_prefix_length(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit`` (binary search on slices)."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class TransformersBackend:
    """Batched ``generate`` with a transformers causal LM; greedy when ``temperature == 0``.

    Prefix reuse (``prefix_cache=True``): every episode starts with the same system prompt, thousands of tokens that
    plain ``generate`` would prefill again for every sequence of every wave. The backend keeps the KV cache of the
    longest prefix shared by all prompts of a call (at least ``min_prefix_tokens``; rebuilt only when a later call's
    prompts no longer all extend it) and starts each batch from a copy of it: the prompts are laid out as
    ``[prefix | left padding | rest]`` with position ids from the attention mask, so each sequence sees exactly the
    positions it would see unpadded and only the per-episode rest is prefilled. ``prefix_stats`` counts builds and
    reuses; ``timings`` splits the time spent in ``generate`` into prefix building, prefill and decoding. The cache is
    rebuilt when the model's weights change (an optimiser step between calls). ``prefix_hint`` (set by
    ``TokenPolicyAgent`` when calls carry only the ready episodes) is the prefix to build instead, when every prompt
    extends it: the system prompt and greeting every episode shares.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_token_ids: list[int] | None = None,
        max_batch_size: int = 64,
        seed: int | None = None,
        prefix_cache: bool = True,
        min_prefix_tokens: int = 256,
        generation_kwargs: dict[str, Any] | None = None,
        generation_config: Any = None,
    ) -> None:
        """``generation_config``: a ``GenerationConfig`` that decides the decoding rule instead of ``temperature`` and
        ``top_p`` (the trainer passes TRL's, so rollouts sample exactly as ``GRPOTrainer`` would)."""
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        eos = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.eos_token_ids = [i for i in eos if i is not None]
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.max_batch_size = max_batch_size
        self.generator_seed = seed
        self._chunk_seeds: list[int] | None = None  # per-row sampling seeds of the batch being generated
        self.prefix_cache = prefix_cache
        self.min_prefix_tokens = max(1, min_prefix_tokens)
        self.generation_kwargs = dict(generation_kwargs or {})
        self.generation_config = generation_config
        self._prefix: list[int] = []
        self.prefix_hint: list[int] | None = None
        self._prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._prefix_weights: tuple[int, int] | None = None
        self.prefix_stats = {"built": 0, "reused": 0, "prefix_tokens": 0}
        self.timings = {"prefix": 0.0, "prefill": 0.0, "decode": 0.0, "calls": 0}

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], None]:
        """``seeds`` (one per prompt): sample each row from its own generator, independent of the batch."""
        if not prompts:
            return [], None
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if self.generator_seed is not None and seeds is None:
            torch.manual_seed(self.generator_seed)
            self.generator_seed += 1
        prefix_length = self._shared_prefix(prompts)
        results: list[list[int]] = []
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = prompts[start : start + self.max_batch_size]
            self._chunk_seeds = seeds[start : start + self.max_batch_size] if seeds is not None else None
            results.extend(self._generate_batch(chunk, max_new_tokens, prefix_length))
        self._chunk_seeds = None
        return results, None

    def _generate_kwargs(self, max_new_tokens: int) -> dict[str, Any]:
        """``generate`` kwargs: length, decoding rule, stop and pad ids, ``generation_kwargs`` (one config object
        when a ``generation_config`` was given: transformers deprecates passing both)."""
        kwargs = {
            "max_new_tokens": max_new_tokens,
            # every row's parameters are local here (FSDP2's are gathered for the round: run/sharding.py), so
            # no rank waits for another's decoding steps, which ranks with other turn counts would never match
            "synced_gpus": False,
            **self._sampling_kwargs(),
            "eos_token_id": self.eos_token_ids,
            "pad_token_id": self.pad_token_id,
            **self.generation_kwargs,
        }
        config = kwargs.pop("generation_config", None)
        if config is None:
            return kwargs
        config = copy.deepcopy(config)
        unused = config.update(**kwargs)
        return {"generation_config": config, **unused}

    def _sampling_kwargs(self) -> dict[str, Any]:
        """``generate`` kwargs of the decoding rule; with per-row seeds, ``PerRowSampler`` draws the tokens."""
        seeds = self._chunk_seeds
        config = self.generation_config
        if config is not None:
            if seeds is None or not config.do_sample:
                return {"generation_config": config}
            # the config's decoding rule, drawn per row (the trainer's rollouts: independent of the process count)
            config = copy.deepcopy(config)
            sampler = self._per_row_sampler(seeds, config.temperature or 1.0, config.top_p, config.top_k, config.min_p)
            config.update(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
            return {"generation_config": config, "logits_processor": sampler}
        sampling = self.temperature > 0
        if sampling and seeds is not None:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None,
                    "logits_processor": self._per_row_sampler(seeds, self.temperature, self.top_p)}  # fmt: skip
        return {
            "do_sample": sampling,
            "temperature": self.temperature if sampling else None,
            "top_p": self.top_p if sampling else None,
            "top_k": 0 if sampling else None,
        }

    @staticmethod
    def _per_row_sampler(
        seeds: list[int], temperature: float, top_p: float | None, top_k: int | None = None, min_p: float | None = None
    ) -> Any:
        from transformers import LogitsProcessorList

        from tau2_rl.sampling import PerRowSampler

        sampler = PerRowSampler(seeds, temperature, 1.0 if top_p is None else top_p, top_k or 0, min_p)
        return LogitsProcessorList([sampler])

    # -- prefix reuse ---------------------------------------------------------------------------------------------

    def _shared_prefix(self, prompts: list[list[int]]) -> int:
        """Length of the cached prefix to start this call from (0: none); builds the cache when worthwhile."""
        if not self.prefix_cache:
            return 0
        shortest = min(len(p) for p in prompts)
        cached = len(self._prefix)
        # Every prompt must extend the prefix by at least one token (its last position gives the next-token logits).
        if self._prefix_kv is not None and self._prefix_weights != self._weights_signature():
            self.reset_prefix_cache()  # the weights changed in place (a training step, load_state_dict): stale
            cached = 0
        if self._prefix_kv is not None and cached < shortest and all(p[:cached] == self._prefix for p in prompts):
            self.prefix_stats["reused"] += 1
            return cached
        hint = self.prefix_hint
        if (
            hint
            and len(hint) < shortest
            and len(hint) >= self.min_prefix_tokens
            and all(p[: len(hint)] == hint for p in prompts)
        ):
            self._build_prefix(hint)
            return len(hint)
        length = shortest - 1
        for prompt in prompts[1:]:
            length = _common_prefix_length(prompts[0], prompt, length)
        if length < self.min_prefix_tokens:
            return 0
        self._build_prefix(prompts[0][:length])
        return length

    def _build_prefix(self, prefix: list[int]) -> None:
        from transformers import DynamicCache

        start = time.perf_counter()
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prefix], dtype=torch.long, device=self.model.device)
        self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._prefix_kv = [(layer.keys, layer.values) for layer in cache.layers]
        self._prefix = list(prefix)
        self._prefix_weights = self._weights_signature()
        self.prefix_stats["built"] += 1
        self.prefix_stats["prefix_tokens"] = len(prefix)
        self.timings["prefix"] += time.perf_counter() - start

    def _prefix_cache_for(self, batch_size: int) -> Any:
        """A fresh cache holding the prefix for ``batch_size`` sequences (``generate`` extends it in place)."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        assert self._prefix_kv is not None
        for index, (keys, values) in enumerate(self._prefix_kv):
            cache.update(keys.expand(batch_size, -1, -1, -1), values.expand(batch_size, -1, -1, -1), index)
        return cache

    def _weights_signature(self) -> tuple[int, int]:
        """Changes whenever a parameter is modified in place (torch's per-tensor version counters) or replaced."""
        params = list(self.model.parameters())
        return sum(p._version for p in params), hash(tuple(p.data_ptr() for p in params))

    def reset_prefix_cache(self) -> None:
        """Drops the cached prefix (done automatically when the model's weights change)."""
        self._prefix, self._prefix_kv, self._prefix_weights = [], None, None

    # -- generation -----------------------------------------------------------------------------------------------

    def _inputs(self, prompts: list[list[int]], prefix_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[prefix | left padding | rest]`` ids and attention mask (plain left padding when no prefix is used)."""
        width = max(len(p) for p in prompts) - prefix_length
        input_ids = torch.full((len(prompts), prefix_length + width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), prefix_length + width), dtype=torch.long)
        if prefix_length:
            input_ids[:, :prefix_length] = torch.tensor(self._prefix[:prefix_length], dtype=torch.long)
            attention[:, :prefix_length] = 1
        for row, prompt in enumerate(prompts):
            rest = prompt[prefix_length:]
            input_ids[row, prefix_length + width - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            attention[row, prefix_length + width - len(rest) :] = 1
        return input_ids, attention

    def _generate_batch(
        self, prompts: list[list[int]], max_new_tokens: int, prefix_length: int = 0
    ) -> list[list[int]]:
        device = self.model.device
        input_ids, attention = self._inputs(prompts, prefix_length)
        extra: dict[str, Any] = {}
        if prefix_length:
            extra["past_key_values"] = self._prefix_cache_for(len(prompts))
        clock = _StepClock()
        kwargs = self._generate_kwargs(max_new_tokens)
        with self._decode_attention():
            output = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device), streamer=clock, **kwargs, **extra
            )
        return self._completions(output, input_ids.shape[1], clock)

    def _decode_attention(self) -> contextlib.AbstractContextManager:
        """Grouped-query decoding without per-step key/value copies (``tau2_rl.backends.attention``) for an sdpa
        model with fewer key-value heads than query heads; the model's own attention otherwise."""
        config = self.model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
        if config._attn_implementation != "sdpa" or not heads or not kv_heads or heads == kv_heads:
            return contextlib.nullcontext()
        from tau2_rl.backends.attention import GROUPED_DECODE_NAME, register_grouped_decode, use_attention

        register_grouped_decode()
        return use_attention(self.model, GROUPED_DECODE_NAME)

    def _completions(self, output: torch.Tensor, prompt_width: int, clock: _StepClock) -> list[list[int]]:
        """Each row's sampled ids up to its first stop token (padding after it dropped); books the call's timings."""
        prefill, decode = clock.split()
        self.timings["prefill"] += prefill
        self.timings["decode"] += decode
        self.timings["calls"] += 1
        completions = []
        for row in output[:, prompt_width:].tolist():
            ids = []
            for token in row:
                ids.append(token)
                if token in self.eos_token_ids:
                    break
            while ids and ids[-1] == self.pad_token_id and self.pad_token_id not in self.eos_token_ids:
                ids.pop()
            completions.append(ids)
        return completions

    @torch.no_grad()
    def next_token_logits(self, prompts: list[list[int]]) -> torch.Tensor:
        """[B, V] next-token logits of each prompt, through the same layout and prefix cache as ``generate``."""
        prefix_length = self._shared_prefix(prompts)
        input_ids, attention = self._inputs(prompts, prefix_length)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        kwargs: dict[str, Any] = {}
        if prefix_length:
            kwargs["past_key_values"] = self._prefix_cache_for(len(prompts))
        device = self.model.device
        output = self.model(
            input_ids=input_ids[:, prefix_length:].to(device),
            attention_mask=attention.to(device),
            position_ids=position_ids[:, prefix_length:].to(device),
            use_cache=bool(prefix_length),
            logits_to_keep=1,
            **kwargs,
        )
        return output.logits[:, -1].float()


def require_vllm(flag: str = "--backend vllm") -> None:
    """Fails at once, naming the flag, when vLLM is not installed."""
    require("vllm", flag)


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
        max_num_batched_tokens: int | None = None,
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
            **({"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}),
        )
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """``seeds`` (one per prompt): a per-request sampling seed, so a row's draws do not depend on its batch."""
        if not prompts:
            return [], []
        from vllm import SamplingParams  # noqa: PLC0415

        def sampling(seed: int | None) -> Any:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, max_tokens=max_new_tokens, logprobs=0, seed=seed
            )

        params = sampling(None) if seeds is None else [sampling(seed) for seed in seeds]
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

    def close(self) -> None:
        """Shuts the engine down so its memory (GPU memory, or host RAM on CPU) is back before the next one starts.

        vLLM's engine core runs in its own process and keeps its memory until shut down; dropping the ``LLM`` object
        is not enough while anything (a traceback, a cycle) still refers to it, so ``evaluate.py --steps 1,2`` would
        start the second checkpoint's engine next to the first one.
        """
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del llm
        gc.collect()
