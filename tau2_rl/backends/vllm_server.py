"""Token-in, token-out sampling on a vLLM server, for the rollout worker of generation ahead in vLLM server mode.

The worker has no copy of the policy: it sends each episode's token ids to the server TRL's server mode trains
against (``trl vllm-serve``, or ``vllm serve`` with the flags TRL's ``VLLMClient`` documents), through TRL's own
``VLLMClient.generate`` (``/v1/completions`` with ``return_token_ids``). Two choices follow the synchronous paths:
- one request per episode, each with its own ``seed`` (the turn seed of ``TokenPolicyAgent``), so that an episode's
  turns do not depend on which episodes share a wave, as on the transformers path (TRL's own server path sends one
  request per batch: batch-seeded);
- ``logprobs=0``: the log-prob of every sampled token as the server sampled it. Served with
  ``--logprobs-mode processed_logprobs`` (``trl vllm-serve`` and scripts/serve_policy_vllm.py set it) they are
  temperature-scaled, the convention of TRL's ``sampling_per_token_logps``: they are the behaviour log-probs of the
  off-policy correction, as in TRL's own vLLM importance sampling.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

MAX_CONCURRENT_REQUESTS = 64
"""Requests in flight at once per wave: vLLM batches them on the server."""


class VLLMServerBackend:
    """``GenerationBackend`` over TRL's ``VLLMClient`` (generation only: the trainer pushes the weights)."""

    def __init__(
        self,
        base_url: str,
        sampling: dict[str, Any],
        eos_token_ids: list[int],
        connection_timeout: float = 0.0,
        client: Any = None,
    ) -> None:
        """``sampling``: ``VLLMClient.generate`` keywords (temperature, top_p, top_k, min_p, repetition_penalty,
        generation_kwargs). ``client``: an object with ``generate`` (tests); else TRL's client for ``base_url``."""
        if client is None:
            from trl.generation.vllm_client import VLLMClient

            client = VLLMClient(base_url=base_url, connection_timeout=connection_timeout)
        self.client = client
        self.sampling = dict(sampling)
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT_REQUESTS, thread_name_prefix="vllm-request")

    def _one(self, prompt: list[int], max_new_tokens: int, seed: int | None) -> tuple[list[int], list[float]]:
        extra = dict(self.sampling.get("generation_kwargs") or {})
        extra.setdefault("stop_token_ids", self.eos_token_ids)  # the agent's end-of-turn ids end a turn
        if seed is not None:
            extra["seed"] = int(seed)
        keywords = {key: value for key, value in self.sampling.items() if key != "generation_kwargs"}
        out = self.client.generate(
            [prompt], max_tokens=max_new_tokens, logprobs=0, generation_kwargs=extra, **keywords
        )
        ids = list(out["completion_ids"][0])
        logprobs = out.get("logprobs")
        if logprobs is None or len(logprobs[0]) != len(ids):
            raise RuntimeError(
                "the vLLM server returned no log-prob per sampled token; serve with --max-logprobs >= 0 and "
                "--logprobs-mode processed_logprobs (scripts/serve_policy_vllm.py does)"
            )
        return ids, [float(row[0]) for row in logprobs[0]]

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        if not prompts:
            return [], None
        seeds_or_none: list[int | None] = list(seeds) if seeds is not None else [None] * len(prompts)
        futures = [
            self._pool.submit(self._one, list(prompt), max_new_tokens, seed)
            for prompt, seed in zip(prompts, seeds_or_none, strict=True)
        ]
        results = [future.result() for future in futures]
        return [ids for ids, _ in results], [lps for _, lps in results]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
