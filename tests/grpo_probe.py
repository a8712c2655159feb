"""``train_grpo.py`` with probes, for the tests that launch real GRPO runs (vLLM colocate, two processes).

    accelerate launch ... tests/grpo_probe.py <train_grpo.py arguments>      # GRPO_PROBE_DIR=<dir>

It runs ``train_grpo.main`` unchanged, with a ``MultiTurnGRPOTrainer`` subclass that records, per rank, into
``$GRPO_PROBE_DIR/rank<k>.jsonl``:

- ``rollout``: this rank's episodes of the step (task ids, turns, seeds, completion token ids), before the metrics
  are gathered;
- ``probe`` (colocated vLLM only): right after the step's generation — so after TRL pushed the trainer's weights into
  the engine — the log-probabilities vLLM and the trainer's model give the tokens of a fixed prompt;
- ``log``: the metrics dict every rank computes at each logging step (TRL gathers them across ranks);
- ``final``: at the end of training, the trainer's log-probabilities of the fixed prompt (with LoRA: base + adapter),
  which the exported hub revision must reproduce when loaded in a plain process.

``GRPO_PROBE_REWARD=length`` trains on the length of the policy's text instead of the task's rewards: a random tiny
model earns τ²'s reward 0 in every episode, so its advantages — and its updates — would all be zero, and a weight
sync test needs weights that move.

``GRPO_PROBE_CRASH=<when>:<rank>:<step>`` SIGKILLs that rank, for the crash-recovery tests: ``mid_save`` once the
model of step ``<step>``'s checkpoint is written and before its optimizer state is (a half-written checkpoint);
``after_save`` at the start of the step after it (that checkpoint whole and sealed, the next step lost).
``GRPO_PROBE_SLOW_SAVE=<seconds>`` sleeps that long before each checkpoint is written (keeps a stopped trainer alive);
``GRPO_PROBE_SAVE_GATE=<path>`` then ends the sleep as soon as that file exists (the test lets the save go once it
has checked what it must check while the trainer is alive, instead of waiting out a fixed time).

``GRPO_PROBE_VLLM_UNCHUNKED=1`` (vLLM's CPU build, ``tests/vllm_cpu.py``): TRL's colocated engine gets
``max_num_batched_tokens`` = its max model length, as a seeded request must not be chunked on CPU.

``GRPO_PROBE_NO_WEIGHT_TRANSFER=1`` (vLLM server mode on CPU): TRL's ``VLLMClient`` opens no NCCL communicator (CUDA
only) and its weight pushes are recorded (``push``: the trainer's step, the tensor count) instead of sent; the
server keeps its initial weights.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import train_grpo  # noqa: E402
from tau2_rl.backends.vllm_seeds import SeededLLM  # noqa: E402
from tau2_rl.trainers.multiturn_grpo import MultiTurnGRPOTrainer  # noqa: E402

PROBE_TEXT = "Hello, I would like to change my flight reservation to an earlier date, please."


def length_reward(completions: list, **kwargs: Any) -> list[float]:
    """Characters the policy wrote in the episode, in hundreds (varies between samples of a random model)."""
    return [sum(len(m.get("content") or "") for m in c if m.get("role") == "assistant") / 100 for c in completions]


def unchunked_vllm_on_cpu() -> None:
    """TRL builds its colocated ``vllm.LLM`` with ``max_num_batched_tokens=4096``; on vLLM's CPU build a seeded
    request whose prompt is longer is chunked and crashes the sampler ("CPU Generator does not use offset")."""
    from trl.generation import vllm_generation

    engine = vllm_generation.LLM

    def unchunked(*args: Any, **kwargs: Any) -> Any:
        kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens") or 0, kwargs["max_model_len"])
        return engine(*args, **kwargs)

    vllm_generation.LLM = unchunked


def recorded_weight_transfer(trainer: ProbedTrainer) -> None:
    """TRL's server-mode weight transfer without NCCL: the communicator is not opened, pushes are recorded."""
    from trl.generation.vllm_client import VLLMClient

    def update_named_params(client: Any, metadata: list, params: Any) -> None:
        sent = [(name, tensor) for name, tensor in params]  # the gathers (ZeRO-3, FSDP) run as the push runs them
        # what NCCL would send: whole plain tensors, each with the shape announced to the server (not a shard)
        full = len(sent) == len(metadata) and all(
            type(tensor) is torch.Tensor and [name, list(tensor.shape)] == [meta[0], meta[2]]
            for (name, tensor), meta in zip(sent, metadata, strict=True)
        )
        trainer._probe_write({"kind": "push", "tensors": len(sent), "full": full})

    VLLMClient.init_communicator = lambda client, device=0: None
    VLLMClient.update_named_params = update_named_params
    VLLMClient.reset_prefix_cache = lambda client: None


class ProbedTrainer(MultiTurnGRPOTrainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if os.environ.get("GRPO_PROBE_VLLM_UNCHUNKED") == "1" and kwargs["args"].use_vllm:
            unchunked_vllm_on_cpu()
        if os.environ.get("GRPO_PROBE_NO_WEIGHT_TRANSFER") == "1":
            recorded_weight_transfer(self)
        if os.environ.get("GRPO_PROBE_REWARD") == "length":
            kwargs["reward_funcs"] = [length_reward]
            kwargs["args"].reward_weights = [1.0]
        super().__init__(*args, **kwargs)
        self.add_callback(_RankLog(self))
        self.add_callback(_Crash(self))
        # --generation_kwargs is JSON, whose object keys are strings; vLLM's SamplingParams(...) takes logit_bias
        # token ids as ints (only SamplingParams.from_optional converts), and TRL passes the dict on as is.
        generation = getattr(self, "vllm_generation", None)
        bias = (getattr(generation, "generation_kwargs", None) or {}).get("logit_bias")
        if bias:
            generation.generation_kwargs["logit_bias"] = {int(token): value for token, value in bias.items()}

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        deadline = time.monotonic() + float(os.environ.get("GRPO_PROBE_SLOW_SAVE", "0"))
        gate = os.environ.get("GRPO_PROBE_SAVE_GATE")
        while time.monotonic() < deadline and not (gate and os.path.exists(gate)):
            time.sleep(0.2)
        super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        crash_here(self, "mid_save")
        super()._save_optimizer_and_scheduler(output_dir)

    def _probe_write(self, record: dict[str, Any]) -> None:
        directory = Path(os.environ["GRPO_PROBE_DIR"])
        directory.mkdir(parents=True, exist_ok=True)
        record = {"rank": self.accelerator.process_index, "step": self.state.global_step, **record}
        with open(directory / f"rank{self.accelerator.process_index}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _log_rollout_metrics(self, mode, records, prm_results, summaries, timings, seconds) -> None:  # noqa: ANN001
        turns = [len(r.turns) for r in records]
        episodes = self._rollout_episodes  # this rank's rows, in order: what each played, token for token
        engine = getattr(getattr(self, "vllm_generation", None), "llm", None)
        self._probe_write({"kind": "rollout", "tasks": [s["task_id"] for s in summaries], "turns": turns,
                           "seeds": [ep.seed for ep in episodes], "seeded_vllm": isinstance(engine, SeededLLM),
                           "completions": [list(ep.agent_state["completion_ids"]) for ep in episodes]})  # fmt: skip
        super()._log_rollout_metrics(mode, records, prm_results, summaries, timings, seconds)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        if self.use_vllm and self.vllm_generation.mode == "colocate":
            self._probe_write({"kind": "probe", **self._probe_logprobs()})
        return output

    def _probe_logprobs(self) -> dict[str, list[float]]:
        from vllm import SamplingParams

        ids = self.processing_class(PROBE_TEXT)["input_ids"]
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        (result,) = self.vllm_generation.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        engine = [entry[token].logprob for token, entry in zip(ids[1:], result.prompt_logprobs[1:], strict=True)]
        return {"vllm": engine, "trainer": self.trainer_logprobs()}

    def trainer_logprobs(self) -> list[float]:
        """The trainer's model's log-probabilities of the fixed prompt's tokens (LoRA: with the adapter), in eval mode:
        LoRA's dropout (``--lora_dropout``, 0.05 by default) would otherwise make them a random draw."""
        ids = self.processing_class(PROBE_TEXT)["input_ids"]
        model = self.accelerator.unwrap_model(self.model)
        training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ids], device=self.accelerator.device)).logits[0, :-1].float()
        finally:
            model.train(training)
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


def crash_here(trainer: ProbedTrainer, when: str) -> None:
    """SIGKILLs this process when ``GRPO_PROBE_CRASH`` names this point, rank and step (no cleanup of any kind)."""
    spec = os.environ.get("GRPO_PROBE_CRASH", "")
    if not spec:
        return
    point, rank, step = spec.split(":")
    if point == when and int(rank) == trainer.accelerator.process_index and int(step) == trainer.state.global_step:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class _Crash(TrainerCallback):
    def __init__(self, trainer: ProbedTrainer) -> None:
        self.trainer = trainer

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        crash_here(self.trainer, "after_save")


class _RankLog(TrainerCallback):
    """Trainer.log calls on_log on every rank with the final metrics dict (TRL's are gathered across ranks)."""

    def __init__(self, trainer: ProbedTrainer) -> None:
        self.trainer = trainer

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        self.trainer._probe_write({"kind": "log", "logs": dict(logs or {})})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The final weights' log-probabilities, for comparing with the exported hub revision."""
        self.trainer._probe_write({"kind": "final", "trainer": self.trainer.trainer_logprobs()})


if __name__ == "__main__":
    from tau2_rl.run.start import leave_distributed_run

    train_grpo.MultiTurnGRPOTrainer = ProbedTrainer
    train_grpo.main(*train_grpo.parse_args())
    leave_distributed_run()  # as train_grpo.py's own ending does (run_main): a finished rank skips finalization
