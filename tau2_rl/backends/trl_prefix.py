"""Prefix reuse for the trainer's transformers rollouts: TRL's decoding rule through the shared-prefix backend.

``GRPOTrainer._generate_single_turn`` (the regular, non-vLLM path) left-pads the whole prompt of every row and calls
``model.generate`` on it, once per wave of a multi-turn rollout: every sequence prefills the ~4.4k-token system prompt
again at every turn, and with left padding the long prefill needs an explicit mask (measured in
benchmarks/rollout_bench.py: wave-batched like that is *slower* than one episode at a time on CPU).

``TrlPrefixGeneration`` gives the trainer's waves the evaluator's engine instead: a
``SharedPrefixTransformersBackend`` over the unwrapped policy (TRL's own ``unwrap_model_for_generation``, so
gradient checkpointing is off during generation exactly as in TRL) that samples with TRL's ``generation_config``
(temperature, top-p/k, min-p, eos and pad ids, the recipe's ``generation_kwargs``). It lives for one rollout round
(``close``, called by ``TrainerBackend.drain``, drops the cached prefix); the policy runs on its own attention
implementation outside the generate calls, so the loss forward is TRL's unchanged. Within the round each episode
keeps its KV cache between waves (turn caching, ``rollout_turn_cache_tokens``): a wave prefills only the tokens
added since the episode's last turn.

``unavailable`` says when the trainer keeps TRL's path: vLLM or transformers continuous batching (they have their own
prefix handling), parameters that stay sharded while generating (FSDP1, ZeRO-3 without
``ds3_gather_for_generation``: under FSDP2 and ZeRO-3 the round gathers them once, on every rank at the same point), a
PEFT wrapper, a decoding rule that reads the prompt ids (repetition penalties: the shared-prefix path gives
``generate`` only the per-episode rest) or a custom cache.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from tau2_rl.backends.shared_prefix import SharedPrefixTransformersBackend, supports_shared_prefix
from tau2_rl.backends.turn_cache import DEFAULT_MAX_TOKENS
from tau2_rl.run.sharding import parameters_sharded_for_generation, unsharded_for_generation

logger = logging.getLogger(__name__)

PROMPT_READING_KWARGS = ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "sequence_bias")
"""``generate`` options whose result depends on the prompt ids themselves (not only on the logits)."""


def unavailable(trainer: Any) -> str | None:
    """None when the trainer's rollouts can use prefix reuse, else why they keep TRL's generation path."""
    if getattr(trainer.args, "rollout_prefix_reuse", None) is False:
        return "--rollout_prefix_reuse is false"
    if trainer.use_vllm:
        return "vLLM generates (it has its own prefix cache)"
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return "transformers continuous batching generates"
    if parameters_sharded_for_generation(trainer.accelerator, trainer.args.ds3_gather_for_generation):
        return (
            "the parameters stay sharded while generating (FSDP1, or ZeRO-3 with --ds3_gather_for_generation false; "
            "FSDP2 and ZeRO-3 gather them once per rollout round)"
        )
    config = trainer.generation_config
    if config.repetition_penalty not in (None, 1.0) or getattr(config, "encoder_repetition_penalty", None) not in (
        None,
        1.0,
    ):
        return "a repetition penalty reads the prompt ids"
    if any(getattr(config, key, None) for key in PROMPT_READING_KWARGS):
        return f"one of {', '.join(PROMPT_READING_KWARGS)} reads the prompt ids"
    if getattr(config, "cache_implementation", None):
        return f"--cache_implementation {config.cache_implementation}"
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    if not hasattr(model, "set_attn_implementation") or type(model).__name__.startswith("Peft"):
        return "the policy is wrapped (PEFT)"
    return supports_shared_prefix(model)


class TrlPrefixGeneration:
    """One rollout round's generation through ``SharedPrefixTransformersBackend`` with TRL's decoding rule.

    A round starts with ``begin_round`` (every rank, at the same point: under FSDP2 or ZeRO-3 it gathers the
    parameters, which then stay local until ``close``) and ends with ``close``. ``seeds`` (one per prompt) draw each
    row from its own generator with TRL's decoding rule, so a rollout does not depend on how rows are spread over
    processes.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.backend: SharedPrefixTransformersBackend | None = None
        self._round: contextlib.ExitStack | None = None
        self._model: Any = None
        self.stats: dict[str, int] = {}
        self.prefix_hint: list[int] | None = None  # TokenPolicyAgent's, through TrainerBackend

    def begin_round(self) -> None:
        """Makes the round's generation model, once per round on every rank at the same point: FSDP2 all-gathers
        its parameters, ZeRO-3 gathers them (``ds3_gather_for_generation``, TRL's own context, hooks removed), both
        kept until ``close``; gradient checkpointing is off meanwhile, as in TRL. A no-op when the round has begun."""
        if self._round is not None:
            return
        from trl.models.utils import unwrap_model_for_generation  # noqa: PLC0415 - trl is heavy to import

        trainer = self.trainer
        stack = contextlib.ExitStack()
        stack.enter_context(unsharded_for_generation(trainer.model_wrapped))
        self._model = stack.enter_context(
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                generation_kwargs=trainer.generation_kwargs,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            )
        )
        self._round = stack

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int] | None = None
    ) -> list[list[int]]:
        """Sampled ids per prompt, each ending at its first eos id (TRL's trimming)."""
        self.begin_round()
        trainer = self.trainer
        if self.backend is None:
            tokenizer = trainer.processing_class
            tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's tokenizer
            self.backend = SharedPrefixTransformersBackend(
                self._model,
                tokenizer,
                eos_token_ids=list(trainer.eos_token_ids),
                max_batch_size=10**6,  # TRL generates a wave in one call; so does this
                generation_config=trainer.generation_config,  # copied per call
                turn_cache_tokens=getattr(trainer.args, "rollout_turn_cache_tokens", DEFAULT_MAX_TOKENS),
            )
        self.backend.prefix_hint = self.prefix_hint
        ids, _ = self.backend.generate(prompts, max_new_tokens, seeds=seeds)
        return ids

    def release(self, prompts: list[list[int]]) -> None:
        """Finished episodes: their turn caches are freed."""
        if self.backend is not None:
            self.backend.release(prompts)

    def _drop_backend(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            self.stats = backend.turn_cache_stats
            backend.close()

    def close(self) -> None:
        """Ends the round: the cached prefix (stale after the optimiser step) is dropped, sharded parameters go back
        to their shards."""
        self._drop_backend()
        stack, self._round, self._model = self._round, None, None
        if stack is not None:
            stack.close()
