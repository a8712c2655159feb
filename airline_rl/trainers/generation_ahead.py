"""Generation that runs ahead of training (``--max_staleness k`` ≥ 1): a rollout worker process plays the episodes
of the next generation batches while the trainer trains on the current one.

How it works (CPU; one process, or one worker per rank under DDP):
1. The trainer looks ahead in its own dataloader (``Lookahead``, through transformers' ``get_batch_samples``): the
   rows of the generation batches still to come are known up to k batches before TRL consumes them, so the worker
   plays exactly the rows (and the episode seeds, a function of the step the batch trains at) that the synchronous
   run plays. Lookahead stops at an epoch's end: the pipeline refills at the next epoch's first batch.
2. Admission control: the request for the batch trained at step g carries ``min_version = g − k``; the worker starts
   it only once it holds weights of version ≥ g − k (the version is the number of optimiser steps behind them).
   Nothing is dropped for being slow: the trainer waits for a late batch, and its staleness is logged.
3. Weights: the trainer copies its parameters into a shared-memory buffer after every optimiser step (seqlock-free:
   a lock and a version counter); the worker copies them into its own model before a batch when a newer version is
   there. A batch plays on one version from its first turn to its last.
4. The worker plays with the same episode loop (``run_episodes``), agent (``TokenPolicyAgent``), backend
   (``SharedPrefixTransformersBackend`` with TRL's ``generation_config``, per-row seeds) and rewards as the
   trainer's own rollouts; at staleness 0 a batch is the synchronous run's batch token for token. It then computes
   the behaviour log-probs of every sampled token with the weights that sampled it (teacher-forced, temperature-
   scaled: the convention of TRL's ``old_per_token_logps``), so the behaviour weight is exactly 1 at staleness 0.
5. The correction is TRL's own importance-sampling code (``vllm_importance_sampling_*``), fed with the behaviour
   log-probs: see ``MultiTurnGRPOTrainer._behaviour_correction`` and docs/variants.md.

The worker is a ``spawn``ed process (fork would copy the trainer's threads and process group); a dead worker is
noticed within ``POLL_S`` and ends the run with one line (``RolloutWorkerError``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import multiprocessing as mp
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from airline_rl.run.omp_wait import VARIABLE, wait_policy_note

logger = logging.getLogger(__name__)

POLL_S = 0.2
"""How often a waiting side checks that the other is still alive."""


class RolloutWorkerError(RuntimeError):
    """The rollout worker died or failed; the message is the one line the run ends with."""


@dataclass
class WorkerSpec:
    """Everything the worker process needs, picklable (the env and the user pickle as their recipes)."""

    model_config: Any
    tokenizer: Any
    env: Any
    user: Any
    generation_config: Any
    eos_token_ids: list[int]
    max_completion_length: int
    max_turn_tokens: int | None
    max_context: int
    temperature: float
    turn_cache_tokens: int
    schedule: Any
    prm_clip: float
    prm_rules: Any
    threads: int
    dtype: Any = None
    model_generation_config: Any = None


@dataclass
class BatchRequest:
    """One generation batch to play: its rows' (task id, episode seed), the step it trains at, the oldest weights."""

    train_step: int
    specs: list[tuple[str, int]]
    min_version: int


@dataclass
class PlayedBatch:
    """What the worker sends back for one ``BatchRequest``."""

    train_step: int
    version: int
    records: list[Any]
    prm_results: list[Any]
    agent_states: list[dict]
    completions: list[list[dict]]
    behaviour_logprobs: list[list[float]]
    timings: Any
    seconds: float
    idle_seconds: float
    error: str | None = None


@dataclass
class PlayedEpisode:
    """The trainer-side view of an episode the worker played: what the loss shaping and the metrics read."""

    record: Any
    agent_state: dict
    messages: list[dict] = field(default_factory=list)


# -- the worker process ---------------------------------------------------------------------------------------------


def _behaviour_logprobs(model: Any, agent_states: list[dict], temperature: float) -> list[list[float]]:
    """log π_behaviour of every completion token (environment tokens too; the loss masks them), one episode at a
    time (no padding: exactly the trainer's forward for an unpadded row)."""
    out = []
    with torch.no_grad():
        for state in agent_states:
            prompt, completion = list(state["prompt_ids"]), list(state["completion_ids"])
            if not completion:
                out.append([])
                continue
            ids = torch.tensor([prompt + completion], dtype=torch.long)
            logits = model(input_ids=ids, logits_to_keep=len(completion) + 1).logits[0, :-1].float()
            logps = torch.log_softmax(logits / temperature, dim=-1)
            out.append(logps.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist())
    return out


def worker_model(spec: WorkerSpec) -> Any:
    """The worker's copy of the policy: the trained model's architecture, dtype and generation config, in eval mode
    (its weights come from the shared buffer), with the KV cache on. Training turns ``use_cache`` off in the model's
    config (gradient checkpointing), and a worker built from that config decoded 10× slower."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(spec.model_config)
    config.use_cache = True  # the worker only generates
    model = AutoModelForCausalLM.from_config(config, dtype=spec.dtype)
    if spec.model_generation_config is not None:
        model.generation_config = copy.deepcopy(spec.model_generation_config)
    model.generation_config.use_cache = True
    return model.eval()


def worker_main(spec: WorkerSpec, weights: dict, version: Any, lock: Any, requests: Any, results: Any) -> None:
    """The rollout worker: plays requested batches in order, each on weights of version ≥ its ``min_version``."""
    from airline_rl.backends.shared_prefix import SharedPrefixTransformersBackend
    from airline_rl.envs.runner import RunTimings, run_episodes
    from airline_rl.rewards.outcome import outcome_reward
    from airline_rl.rewards.prm import score_episode
    from airline_rl.rollout import TokenPolicyAgent

    torch.set_num_threads(max(1, spec.threads))
    # tqdm's first bar (run_episodes makes one, disabled) creates a multiprocessing lock, a named semaphore that only
    # an orderly exit unlinks; a worker stopped mid-batch (terminate at a SIGTERM) left it behind, and the resource
    # tracker warned of a leaked semaphore. The worker shows no bars: a thread lock does.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    model = worker_model(spec)
    params = dict(model.named_parameters())
    loaded = -1
    parent = os.getppid()
    idle_since = time.perf_counter()

    def load_newest() -> None:
        nonlocal loaded
        with lock:
            current = int(version.value)
            if current != loaded:
                with torch.no_grad():
                    for name, tensor in weights.items():
                        params[name].copy_(tensor)
                loaded = current

    while True:
        request = requests.get()
        if request is None:
            return
        while int(version.value) < request.min_version:  # admission control: wait for fresh enough weights
            if os.getppid() != parent:
                return
            time.sleep(POLL_S / 4)
        load_newest()
        idle = time.perf_counter() - idle_since
        start = time.perf_counter()
        try:
            backend = SharedPrefixTransformersBackend(
                model,
                spec.tokenizer,
                eos_token_ids=list(spec.eos_token_ids),
                max_batch_size=10**6,
                generation_config=spec.generation_config,
                turn_cache_tokens=spec.turn_cache_tokens,
            )
            agent = TokenPolicyAgent(
                backend, spec.tokenizer, spec.env.tools, spec.eos_token_ids, spec.max_completion_length,
                spec.max_turn_tokens, spec.max_context, per_episode_seeds=True,
            )  # fmt: skip
            episodes = [spec.env.reset(task_id, seed) for task_id, seed in request.specs]
            for episode in episodes:
                agent.start(episode)
            timings = RunTimings()
            records = run_episodes(
                spec.env, agent, spec.user, request.specs, timings=timings, episodes=episodes,
                score=outcome_reward, schedule=spec.schedule,
            )  # fmt: skip
            backend.close()
            prm_start = time.perf_counter()
            clip = spec.prm_clip
            prm = [score_episode(r, clip=(-clip, clip), rules=spec.prm_rules, env=spec.env) for r in records]
            timings.reward += time.perf_counter() - prm_start
            states = [
                {k: list(v) if isinstance(v, list) else v for k, v in ep.agent_state.items() if k != "seen"}
                for ep in episodes
            ]
            behaviour = _behaviour_logprobs(model, states, spec.temperature)
            played = PlayedBatch(
                request.train_step, loaded, records, prm, states, [ep.messages[2:] for ep in episodes], behaviour,
                timings, time.perf_counter() - start, idle,
            )  # fmt: skip
        except Exception as err:  # reported to the trainer, which ends the run with it
            played = PlayedBatch(request.train_step, loaded, [], [], [], [], [], None, 0.0, idle,
                                 error=f"{type(err).__name__}: {err}")  # fmt: skip
        results.put(played)
        idle_since = time.perf_counter()
        if played.error:
            return


# -- the trainer side -----------------------------------------------------------------------------------------------


class Lookahead:
    """An epoch iterator that pulls up to ``depth`` items ahead and announces each to ``on_item(index, item)``."""

    def __init__(self, source: Iterator, depth: int, on_item: Any, first_index: int) -> None:
        self.source = source
        self.depth = depth
        self.on_item = on_item
        self.next_index = first_index
        self.buffer: deque = deque()
        self.exhausted = False

    def _pull(self) -> None:
        while not self.exhausted and len(self.buffer) <= self.depth:
            try:
                item = next(self.source)
            except StopIteration:
                self.exhausted = True
                return
            self.on_item(self.next_index, item)
            self.next_index += 1
            self.buffer.append(item)

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        self._pull()
        if not self.buffer:
            raise StopIteration
        item = self.buffer.popleft()
        self._pull()
        return item


class GenerationAhead:
    """The trainer's side of generation ahead: the worker process, the weight buffer, the queue of batches."""

    def __init__(self, trainer: Any, max_staleness: int, threads: int) -> None:
        self.trainer = trainer
        self.k = max_staleness
        self.threads = threads
        self.generate_every = trainer.args.steps_per_generation * trainer.num_iterations
        self.accumulation = trainer.args.gradient_accumulation_steps
        self.process: Any = None
        self.pending: deque[BatchRequest] = deque()
        self._lookahead: Lookahead | None = None
        self.items_seen = 0
        self.first_step: int | None = None
        self.wait_seconds = 0.0
        self.trainer_idle_share = 0.0
        self._last_take: float | None = None
        self.discarded = 0
        self.stopped = False

    # -- lifecycle

    def start(self) -> None:
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        ctx = mp.get_context("spawn")
        self.weights = {n: p.detach().to("cpu").clone().share_memory_() for n, p in model.named_parameters()}
        self.version = ctx.Value("q", int(trainer.state.global_step), lock=False)
        self.lock = ctx.Lock()
        self.requests = ctx.Queue()
        self.results = ctx.Queue()
        from airline_rl.backends.turn_cache import DEFAULT_MAX_TOKENS
        from airline_rl.trainers.multiturn_grpo import _max_context

        args = trainer.args
        spec = WorkerSpec(
            model_config=model.config,
            tokenizer=getattr(trainer.processing_class, "tokenizer", trainer.processing_class),
            env=trainer.env,
            user=trainer.user,
            generation_config=trainer.generation_config,
            eos_token_ids=list(trainer.eos_token_ids),
            max_completion_length=args.max_completion_length,
            max_turn_tokens=args.max_turn_tokens,
            max_context=_max_context(trainer),
            temperature=trainer.temperature,
            turn_cache_tokens=getattr(args, "rollout_turn_cache_tokens", DEFAULT_MAX_TOKENS),
            schedule=trainer.schedule,
            prm_clip=args.prm_clip if args.prm_clip is not None else 0.5,
            prm_rules=args.prm_rules,
            threads=self.threads,
            dtype=next(model.parameters()).dtype,
            model_generation_config=getattr(model, "generation_config", None),
        )
        self.process = ctx.Process(
            target=worker_main,
            args=(spec, self.weights, self.version, self.lock, self.requests, self.results),
            name="airline-rollout-worker",
            daemon=True,
        )
        self.process.start()
        # The trainer keeps its own threads and the OS shares the cores: while the worker waits (on the user, or for
        # fresh weights) the trainer has them all. Giving it only the cores the worker leaves made its optimisation
        # 5.39 s against 3.39 s per step (recipe, scripted user, 2 cores), and was no faster with the LLM stub user.
        # That sharing works only if the trainer's idle OpenMP threads sleep instead of spinning (run/omp_wait.py).
        logger.info("generation runs ahead of training by at most %d step(s) in rollout worker pid %d (%d thread(s)); "
                    "OpenMP wait policy %s", self.k, self.process.pid, self.threads,
                    os.environ.get(VARIABLE, "unset"))  # fmt: skip
        note = wait_policy_note()
        if note is not None:
            logger.warning(note)

    def close(self) -> int:
        """Stops the worker; returns how many requested batches were discarded unplayed or unread."""
        if self.process is None or self.stopped:
            return 0
        self.stopped = True
        self.discarded = len(self.pending)
        with contextlib.suppress(Exception):  # the worker may be gone already
            self.requests.put(None)
        self.process.join(timeout=2.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5.0)
        # The queues and the lock are released with the worker: nothing is sent or read after a stop.
        for channel in (self.requests, self.results):
            with contextlib.suppress(Exception):
                channel.cancel_join_thread()  # requests the dead worker never read must not block the exit
                channel.close()
        self.requests = self.results = self.lock = None
        return self.discarded

    # -- data

    def lookahead(self, epoch_iterator: Iterator) -> Lookahead:
        if self.process is None:
            self.start()
        if self.first_step is None:
            self.first_step = int(self.trainer.state.global_step)
        if self._lookahead is None or self._lookahead.source is not epoch_iterator:  # a new epoch
            depth = self.k * self.generate_every + self.accumulation
            self._lookahead = Lookahead(epoch_iterator, depth, self._announce, self.items_seen)
        return self._lookahead

    def _announce(self, index: int, item: Any) -> None:
        """A dataloader item pulled ahead: a generation batch when TRL will generate on it (``_prepare_inputs``)."""
        self.items_seen = index + 1
        if index % self.generate_every or self.stopped:
            return
        assert self.first_step is not None
        step = self.first_step + index // self.accumulation
        if step >= self.trainer.state.max_steps > 0:
            return
        trainer = self.trainer
        rows = list(item)
        specs = [(str(row["task_id"]), trainer._episode_seed(i, len(rows), step)) for i, row in enumerate(rows)]
        request = BatchRequest(step, specs, min_version=step - self.k)
        self.pending.append(request)
        self.requests.put(request)

    # -- weights

    def push_weights(self, step: int) -> None:
        if self.stopped:
            return
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        with self.lock, torch.no_grad():
            for name, param in model.named_parameters():
                self.weights[name].copy_(param.detach())
            self.version.value = int(step)

    # -- results

    def take(self, step: int, rows: list[dict]) -> PlayedBatch:
        """The played batch that trains at ``step`` (waits for it; the wait is the trainer's idle time)."""
        if not self.pending or self.pending[0].train_step != step:
            raise RolloutWorkerError(
                f"generation ahead lost track of the data order (step {step}, expected "
                f"{self.pending[0].train_step if self.pending else 'nothing'}); rerun with --max_staleness 0"
            )
        request = self.pending[0]
        expected = [task for task, _ in request.specs]
        if [str(r["task_id"]) for r in rows] != expected:
            raise RolloutWorkerError(f"the rows of step {step} differ from those the rollout worker played")
        start = time.perf_counter()
        while True:
            try:
                played = self.results.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    code = self.process.exitcode
                    raise RolloutWorkerError(
                        f"the rollout worker (pid {self.process.pid}) died with exit code {code} while playing the "
                        f"batch of step {step}"
                    ) from None
        now = time.perf_counter()
        self.wait_seconds = now - start
        if self._last_take is not None:  # the share of the time since the last batch the trainer spent waiting
            self.trainer_idle_share = self.wait_seconds / max(now - self._last_take, 1e-9)
        else:
            self.trainer_idle_share = 1.0  # the first batch: nothing to train on while it plays
        self._last_take = now
        self.pending.popleft()
        if played.error:
            raise RolloutWorkerError(f"the rollout worker failed at the batch of step {step}: {played.error}")
        if played.train_step != step:
            raise RolloutWorkerError(f"the rollout worker sent step {played.train_step} for step {step}")
        if step - played.version > self.k:
            raise RolloutWorkerError(f"staleness {step - played.version} exceeds --max_staleness {self.k} (a bug)")
        return played


def behaviour_stats(output: dict[str, torch.Tensor], cap: float | None) -> dict[str, float]:
    """Behaviour-weight metrics over the policy tokens: mean truncated weight, the share truncated (or masked),
    and KL(behaviour ‖ proximal) by the k3 estimator (non-negative, unbiased under the behaviour policy)."""
    old, behav = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
    if old is None or behav is None:
        return {}
    mask = (output["completion_mask"] * output["tool_mask"]).bool()
    log_ratio = torch.nan_to_num((old - behav)[mask], nan=0.0)
    if log_ratio.numel() == 0:
        return {}
    ratio = log_ratio.exp()
    weight = output.get("importance_sampling_ratio")
    mean_weight = float(weight[mask].mean()) if weight is not None and weight.dim() == 2 else float(ratio.mean())
    over = float((ratio > cap).float().mean()) if cap is not None and math.isfinite(cap) else 0.0
    kl = float((ratio - log_ratio - 1).mean())
    return {"behaviour_weight": mean_weight, "behaviour_weight_truncated": over, "kl_behaviour": kl}
