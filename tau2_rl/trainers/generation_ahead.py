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

vLLM server mode (``--use_vllm true --vllm_mode server``): the worker has no model and samples on the server
(``served_worker_main``, ``tau2_rl.backends.vllm_server``), its behaviour log-probs the server's own; the trainer
pushes its weights into the server with TRL's ``sync_weights`` between two of the worker's batches (``ServedWeights``),
so that a batch still plays on one version and ``version`` is the server's. With several training processes (DDP,
ZeRO, FSDP) every rank has its own worker on the one server, and the ranks wait for their batches and push in
lockstep, when every worker is between batches (TRL's push gathers the shards on every rank).

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
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tau2_rl.envs.protocol import agent_view
from tau2_rl.rollout import policy_max_context
from tau2_rl.run.omp_wait import VARIABLE, wait_policy_note

logger = logging.getLogger(__name__)

POLL_S = 0.2
"""How often a waiting side checks that the other is still alive."""
YIELD_S = 2 * POLL_S
"""vLLM server mode: how long a worker between batches lets a pending weight push go first (the trainer, waiting for
the batch, retries every ``POLL_S``); a trainer busy training pushes at its step's end instead."""


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
    server: ServerSpec | None = None
    """vLLM server mode: the worker samples on the server instead of its own copy of the policy."""
    score: Any = None
    """The trainer's outcome reward (picklable: with a judge, its settings; the worker builds its own client)."""


@dataclass
class ServerSpec:
    """Where and how the worker samples in vLLM server mode (``VLLMServerBackend``)."""

    base_url: str
    sampling: dict[str, Any]
    connection_timeout: float = 240.0


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
class Discarded:
    """The requested batches a stop throws away (a resumed run plays them again with its own weights)."""

    played: int = 0
    """Played, the result not yet read by the trainer."""
    in_flight: int = 0
    queued: int = 0
    """Requested but never started (behind the batch in flight, or waiting for fresher weights)."""

    @property
    def total(self) -> int:
        return self.played + self.in_flight + self.queued

    def __str__(self) -> str:
        return f"{self.played} played, {self.in_flight} in flight, {self.queued} only queued (never started)"


@dataclass
class PlayedEpisode:
    """The trainer-side view of an episode the worker played: what the loss shaping and the metrics read."""

    record: Any
    agent_state: dict
    messages: list[dict] = field(default_factory=list)

    @property
    def seed(self) -> int:
        return self.record.seed


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


@dataclass
class Progress:
    """How many requested batches the worker has started playing and finished (shared counters, written by the worker
    only), so that a stop can say which of the batches it discards were played, in flight or only queued."""

    started: Any
    finished: Any

    def begin(self) -> None:
        self.started.value += 1

    def end(self) -> None:
        self.finished.value += 1


def worker_main(
    spec: WorkerSpec, weights: dict, version: Any, lock: Any, requests: Any, results: Any, progress: Progress,
    served: Any = None,
) -> None:  # fmt: skip
    """The rollout worker: plays requested batches in order, each on weights of version ≥ its ``min_version``.
    ``served``: vLLM server mode's (``playing`` lock, ``wanted`` flag), see ``served_worker_main``.

    Stop signals are the trainer's to act on: torchrun's agent signals each rank's whole process group and Ctrl-C
    the terminal's, both of which hold the worker. Killed there mid-batch, the worker's rank read "the rollout
    worker died" before its own stop handler had finished the step (after fa6d1b5 a faster step moved the signal into
    that window). So the worker ignores SIGTERM and SIGINT; the trainer finishes its step, saves, and stops the
    worker itself (``GenerationAhead.close``: a stop request, else SIGKILL)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.server is not None:
        served_worker_main(spec, version, *served, requests, results, progress)
        return
    from tau2_rl.backends.shared_prefix import SharedPrefixTransformersBackend

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
        if not admitted(version, request, parent):
            return
        load_newest()
        progress.begin()
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
            records, prm, states, messages, timings = _play(spec, backend, request)
            backend.close()
            behaviour = _behaviour_logprobs(model, states, spec.temperature)
            played = PlayedBatch(
                request.train_step, loaded, records, prm, states, messages, behaviour, timings,
                time.perf_counter() - start, idle,
            )  # fmt: skip
        except Exception as err:  # reported to the trainer, which ends the run with it
            played = PlayedBatch(request.train_step, loaded, [], [], [], [], [], None, 0.0, idle,
                                 error=f"{type(err).__name__}: {err}")  # fmt: skip
        progress.end()
        results.put(played)
        idle_since = time.perf_counter()
        if played.error:
            return


def admitted(version: Any, request: BatchRequest, parent: int) -> bool:
    """Admission control: waits until the weights (``version``) are fresh enough for ``request``; False when the
    trainer died meanwhile."""
    while int(version.value) < request.min_version:
        if os.getppid() != parent:
            return False
        time.sleep(POLL_S / 4)
    return True


def _play(spec: WorkerSpec, backend: Any, request: BatchRequest) -> tuple[list, list, list, list, Any]:
    """One batch through the trainers' own episode loop and rewards: records, PRM results, token states, messages."""
    from tau2_rl.envs.runner import RunTimings, run_episodes
    from tau2_rl.rewards.outcome import outcome_reward
    from tau2_rl.rewards.prm import score_episode
    from tau2_rl.rollout import TokenPolicyAgent

    agent = TokenPolicyAgent(
        backend, spec.tokenizer, spec.eos_token_ids, spec.max_completion_length,
        spec.max_turn_tokens, spec.max_context, per_episode_seeds=True,
    )  # fmt: skip
    episodes = [spec.env.reset(task_id, seed) for task_id, seed in request.specs]
    for episode in episodes:
        agent.start(episode)
    timings = RunTimings()
    records = run_episodes(
        spec.env, agent, spec.user, request.specs, timings=timings, episodes=episodes,
        score=spec.score or outcome_reward, schedule=spec.schedule,
    )  # fmt: skip
    prm_start = time.perf_counter()
    clip = spec.prm_clip
    prm = [score_episode(r, clip=(-clip, clip), rules=spec.prm_rules, env=spec.env) for r in records]
    timings.reward += time.perf_counter() - prm_start
    states = [
        {k: list(v) if isinstance(v, list) else v for k, v in ep.agent_state.items() if k != "seen"} for ep in episodes
    ]
    return records, prm, states, [agent_view(ep.messages)[ep.prefix_length :] for ep in episodes], timings


def take_the_server(playing: Any, wanted: Any, parent: int) -> bool:
    """Acquires ``playing`` for the next batch, after letting a pending weight push (``wanted``) go first for up to
    ``YIELD_S``: without it a worker whose next batch is already admitted (k ≥ 2) takes the lock back before the
    trainer sees it free, and the server's weights would age to the bound at every batch. False: the trainer died."""
    deadline = time.perf_counter() + YIELD_S
    while wanted.value and time.perf_counter() < deadline:
        time.sleep(POLL_S / 8)
    while not playing.acquire(timeout=POLL_S):  # the trainer is pushing weights into the server
        if os.getppid() != parent:
            return False
    return True


def served_worker_main(
    spec: WorkerSpec, version: Any, playing: Any, wanted: Any, requests: Any, results: Any, progress: Progress
) -> None:
    """The rollout worker in vLLM server mode. The trainer pushes its weights into the server (TRL's
    ``sync_weights``, NCCL) only while it holds ``playing``; the worker holds it from a batch's first turn to its
    last, so a batch plays on one version, and ``version`` (the server's) cannot change under it. Admission is
    awaited without the lock, so that the push it waits for can happen. The behaviour log-probs are the server's
    own (``VLLMServerBackend``): no forward pass here."""
    from tqdm import tqdm

    from tau2_rl.backends.vllm_server import VLLMServerBackend

    tqdm.set_lock(threading.RLock())  # as worker_main: no named semaphore left behind by a stop mid-batch
    assert spec.server is not None and playing is not None
    backend = VLLMServerBackend(
        spec.server.base_url, spec.server.sampling, spec.eos_token_ids, spec.server.connection_timeout
    )
    parent = os.getppid()
    idle_since = time.perf_counter()
    while True:
        request = requests.get()
        if request is None:
            backend.close()
            return
        if not admitted(version, request, parent) or not take_the_server(playing, wanted, parent):
            return
        try:
            loaded = int(version.value)
            progress.begin()
            idle = time.perf_counter() - idle_since
            start = time.perf_counter()
            try:
                records, prm, states, messages, timings = _play(spec, backend, request)
                behaviour = [list(state["logprobs"]) for state in states]
                played = PlayedBatch(request.train_step, loaded, records, prm, states, messages, behaviour, timings,
                                     time.perf_counter() - start, idle)  # fmt: skip
            except Exception as err:  # reported to the trainer, which ends the run with it
                played = PlayedBatch(request.train_step, loaded, [], [], [], [], [], None, 0.0, idle,
                                     error=f"{type(err).__name__}: {err}")  # fmt: skip
        finally:
            playing.release()  # before the result: a trainer holding the result finds the lock free or re-taken
        progress.end()
        results.put(played)
        idle_since = time.perf_counter()
        if played.error:
            backend.close()
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

    server_weights: ServedWeights | None = None
    """vLLM server mode: the weight pushes into the server; None on the CPU path (shared memory)."""
    lockstep = False
    """Several ranks pushing into one server: they wait for their batches, and push, at the same points."""
    taken = 0
    """Batches ``take`` handed to the trainer (the worker's ``progress`` counts from the same start)."""

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
        self.discarded = Discarded()
        self.progress: Progress | None = None
        self.stopped = False
        self.served = bool(getattr(trainer, "use_vllm", False)) and trainer.args.vllm_mode == "server"
        """vLLM server mode: the worker samples on the server; the weights go there (``ServedWeights``)."""
        self.lockstep = self.served and trainer.accelerator.num_processes > 1

    def gather(self, item: Any) -> list[Any]:
        """``item`` from every rank, in rank order (a collective when the ranks work in lockstep)."""
        if not self.lockstep:
            return [item]
        from accelerate.utils import gather_object

        return gather_object([item])

    # -- lifecycle

    def start(self) -> None:
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        ctx = mp.get_context("spawn")
        self.version = ctx.Value("q", int(trainer.state.global_step), lock=False)
        self.lock = ctx.Lock()
        served = None
        if self.served:  # no copy of the weights here: they go to the server, the first time before any batch
            self.weights = {}
            served = (ctx.Lock(), ctx.Value("b", 0, lock=False))
            self.server_weights = ServedWeights(trainer, *served, self.version, alive=self._worker_alive,
                                                gather=self.gather)  # fmt: skip
            self.server_weights.push_now(int(trainer.state.global_step))
        else:
            self.weights = {n: p.detach().to("cpu").clone().share_memory_() for n, p in model.named_parameters()}
        self.requests = ctx.Queue()
        self.results = ctx.Queue()
        self.progress = Progress(ctx.Value("q", 0, lock=False), ctx.Value("q", 0, lock=False))
        from tau2_rl.backends.turn_cache import DEFAULT_MAX_TOKENS

        args = trainer.args
        spec = WorkerSpec(
            model_config=model.config,
            tokenizer=getattr(trainer.processing_class, "tokenizer", trainer.processing_class),
            env=trainer.env,
            user=trainer.user,
            generation_config=getattr(trainer, "generation_config", None),  # None with vLLM (the server samples)
            eos_token_ids=list(trainer.eos_token_ids),
            max_completion_length=args.max_completion_length,
            max_turn_tokens=args.max_turn_tokens,
            max_context=policy_max_context(trainer),
            temperature=trainer.temperature,
            turn_cache_tokens=getattr(args, "rollout_turn_cache_tokens", DEFAULT_MAX_TOKENS),
            schedule=trainer.schedule,
            prm_clip=args.prm_clip if args.prm_clip is not None else 0.5,
            prm_rules=args.prm_rules,
            threads=self.threads,
            dtype=next(model.parameters()).dtype,
            model_generation_config=getattr(model, "generation_config", None),
            server=served_spec(trainer) if self.served else None,
            score=trainer.score,
        )
        self.process = ctx.Process(
            target=worker_main,
            args=(spec, self.weights, self.version, self.lock, self.requests, self.results, self.progress, served),
            name="tau2-rollout-worker",
            daemon=True,
        )
        self.process.start()
        # The trainer keeps its own threads and the OS shares the cores: while the worker waits (on the user, or for
        # fresh weights) the trainer has them all. Giving it only the cores the worker leaves made its optimisation
        # 5.39 s against 3.39 s per step (recipe, scripted user, 2 cores), and was no faster with the LLM stub user.
        # That sharing works only if the trainer's idle OpenMP threads sleep instead of spinning (run/omp_wait.py).
        where = (f"sampling on the vLLM server {spec.server.base_url}" if spec.server is not None
                 else f"{self.threads} thread(s)")  # fmt: skip
        logger.info("generation runs ahead of training by at most %d step(s) in rollout worker pid %d (%s); "
                    "OpenMP wait policy %s", self.k, self.process.pid, where,
                    os.environ.get(VARIABLE, "unset"))  # fmt: skip
        note = wait_policy_note()
        if note is not None:
            logger.warning(note)

    def close(self) -> Discarded:
        """Stops the worker; returns the requested batches it discards: played but unread, in flight, only queued."""
        if self.process is None or self.stopped:
            return Discarded()
        self.stopped = True
        with contextlib.suppress(Exception):  # the worker may be gone already
            self.requests.put(None)
        self.process.join(timeout=2.0)
        if self.process.is_alive():  # mid-batch: it ignores SIGTERM (``worker_main``)
            self.process.kill()
            self.process.join(timeout=5.0)
        self.discarded = self._discarded()
        # The queues and the lock are released with the worker: nothing is sent or read after a stop.
        for channel in (self.requests, self.results):
            with contextlib.suppress(Exception):
                channel.cancel_join_thread()  # requests the dead worker never read must not block the exit
                channel.close()
        self.requests = self.results = self.lock = None
        if self.server_weights is not None:
            self.server_weights.restore()  # later evaluations push into the server as TRL does
        return self.discarded

    def _discarded(self) -> Discarded:
        """What became of the requests never taken, read once the worker is stopped (a batch it was playing when
        terminated is in flight; the ones behind it, or waiting for fresher weights, were only queued)."""
        assert self.progress is not None
        started, finished = int(self.progress.started.value), int(self.progress.finished.value)
        played = max(0, min(finished - self.taken, len(self.pending)))
        in_flight = max(0, min(started - finished, len(self.pending) - played))
        return Discarded(played, in_flight, len(self.pending) - played - in_flight)

    def _worker_alive(self) -> bool:
        return self.process is None or self.process.is_alive()

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
        if self.server_weights is not None:  # into the server at the worker's next batch boundary
            self.server_weights.offer(step)
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
        played = None
        while True:
            if self.server_weights is not None:  # a push the worker's batch held back goes in between batches
                self.server_weights.try_push(keep=True)
            if played is None:
                with contextlib.suppress(queue.Empty):
                    played = self.results.get(timeout=POLL_S)
            else:
                time.sleep(POLL_S)  # several ranks in server mode: waiting for the others' batches
            dead = played is None and not self.process.is_alive()
            if not self.lockstep:
                if played is not None or dead:
                    break
            elif all(self.gather(played is not None or dead)):  # the ranks leave the loop (and push) together
                break
        if played is None:
            raise RolloutWorkerError(
                f"the rollout worker (pid {self.process.pid}) died with exit code {self.process.exitcode} while "
                f"playing the batch of step {step}"
            )
        now = time.perf_counter()
        self.wait_seconds = now - start
        if self._last_take is not None:  # the share of the time since the last batch the trainer spent waiting
            self.trainer_idle_share = self.wait_seconds / max(now - self._last_take, 1e-9)
        else:
            self.trainer_idle_share = 1.0  # the first batch: nothing to train on while it plays
        self._last_take = now
        self.pending.popleft()
        self.taken += 1
        if self.server_weights is not None:  # the worker released the lock before sending: free unless re-taken
            self.server_weights.try_push()
        if played.error:
            raise RolloutWorkerError(f"the rollout worker failed at the batch of step {step}: {played.error}")
        if played.train_step != step:
            raise RolloutWorkerError(f"the rollout worker sent step {played.train_step} for step {step}")
        if step - played.version > self.k:
            raise RolloutWorkerError(f"staleness {step - played.version} exceeds --max_staleness {self.k} (a bug)")
        return played


def served_spec(trainer: Any) -> ServerSpec:
    """The server and the sampling settings of TRL's own server path (``VLLMGeneration.generate``)."""
    generation = trainer.vllm_generation
    base_url = generation.vllm_client.base_url if getattr(generation, "vllm_client", None) is not None else (
        generation.server_base_url or f"http://{generation.server_host}:{generation.server_port}")  # fmt: skip
    sampling = {
        "temperature": float(trainer.temperature),
        "top_p": float(trainer.top_p),
        "top_k": int(trainer.top_k or 0),
        "min_p": 0.0 if trainer.min_p is None else float(trainer.min_p),
        "repetition_penalty": float(trainer.repetition_penalty),
        "generation_kwargs": dict(getattr(generation, "generation_kwargs", None) or {}),
    }
    return ServerSpec(base_url, sampling, float(getattr(generation, "server_timeout", 240.0)))


class ServedWeights:
    """The trainer's weight pushes into the vLLM server, at the worker's batch boundaries.

    TRL's ``sync_weights`` (NCCL into the server) may run only while the trainer holds ``playing``, which the
    worker holds for a whole batch. ``offer(step)`` after an optimiser step pushes at once when the worker is
    between batches and otherwise leaves the step pending and raises ``wanted``, which the worker honours at its
    next batch boundary (``take_the_server``); ``try_push`` (called while the trainer waits for a batch, and once it
    has it) pushes the newest pending step when the lock is free. ``version`` is then the server's.
    Evaluations in between (held-out pass^k samples through TRL's vLLM path) go through ``push_now``, wrapped around
    TRL's ``sync_weights``: they wait for the batch boundary, since their samples must come from the current
    weights.

    Several training processes (DDP, ZeRO, FSDP): every rank has its own worker and lock, and TRL's push is a
    collective (the ZeRO-3 and FSDP gathers; only the main process sends). So every method here is called by all
    ranks at the same point (``gather`` is then accelerate's ``gather_object``: one item per rank), and a push goes
    in only when every rank holds its own worker's lock. A rank that got its lock keeps it until that push (its
    worker waits, as it would for a push at a batch boundary), so the pushes cannot starve while the workers take
    turns between batches. ``pending`` is set and cleared at those same points, so it is the same on every rank."""

    def __init__(
        self, trainer: Any, playing: Any, wanted: Any, version: Any, alive: Any = lambda: True,
        gather: Any = lambda item: [item],
    ) -> None:  # fmt: skip
        self.trainer = trainer
        self.playing = playing
        self.wanted = wanted
        self.version = version
        self.alive = alive
        self.gather = gather
        self.held = False
        self.pending: int | None = None
        self.pushes = 0
        self.push_seconds = 0.0
        self._sync = trainer.vllm_generation.sync_weights
        trainer.vllm_generation.sync_weights = self._sync_for_trl

    def _push(self, step: int) -> None:
        """TRL's push, with this rank's lock held (released after it, also when the push fails)."""
        start = time.perf_counter()
        try:
            self._sync()
            self.version.value = int(step)  # before the worker can take the lock again and read it
            self.trainer._last_loaded_step = int(step)  # TRL's own paths then see the server as current
            self.pending = None
            self.wanted.value = 0
        finally:
            self._release()
        self.pushes += 1
        self.push_seconds += time.perf_counter() - start

    def _hold(self, timeout: float | None) -> bool:
        """Acquires this rank's ``playing`` (at once, or within ``timeout``) unless it holds it already."""
        if not self.held:
            self.held = self.playing.acquire(False) if timeout is None else self.playing.acquire(True, timeout)
        return self.held

    def _release(self) -> None:
        if self.held:
            self.held = False
            self.playing.release()

    def offer(self, step: int) -> None:
        self.pending = int(step)
        if not self.try_push():
            self.wanted.value = 1  # the worker lets it go first at its batch boundary

    def try_push(self, keep: bool = False) -> bool:
        """Pushes the pending step if every rank's worker is between batches. ``keep``: a rank that got its lock
        keeps it for the next try (the trainer's wait for its batch), else lets it go (training comes next)."""
        if self.pending is None:
            return False
        if not all(self.gather(self._hold(None))):
            if not keep:
                self._release()
            return False
        self._push(self.pending)
        return True

    def push_now(self, step: int) -> None:
        """Pushes ``step``'s weights, waiting for the workers' batch boundaries (never for a dead worker)."""
        self.wanted.value = 1
        while True:
            held = self._hold(POLL_S)
            flags = self.gather((held, held or self.alive()))
            if not all(alive for _, alive in flags):
                self._release()
                ranks = [rank for rank, (_, alive) in enumerate(flags) if not alive]
                where = f" (rank {', '.join(map(str, ranks))})" if len(flags) > 1 else ""
                raise RolloutWorkerError(f"the rollout worker{where} died holding the vLLM server between weight "
                                         "pushes")  # fmt: skip
            if all(held for held, _ in flags):
                break
        self._push(step)

    def _sync_for_trl(self) -> None:
        self.push_now(int(self.trainer.state.global_step))

    def restore(self) -> None:
        self._release()
        self.trainer.vllm_generation.sync_weights = self._sync


def behaviour_stats(output: dict[str, torch.Tensor], cap: float | None) -> dict[str, float]:
    """Behaviour-weight metrics over the policy tokens: mean truncated weight, the share truncated (or masked),
    and KL(behaviour ‖ proximal) by the k3 estimator (non-negative, unbiased under the behaviour policy). k3 is
    computed in float64 as expm1(x) − x, x the log-ratio: in float32, exp(x) − x − 1 rounds to about −x for the
    ~1e-8 log-ratios of two forward passes over the same weights, and logged −5e-9 at staleness 0."""
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
    log_ratio64 = log_ratio.double()
    kl = float((torch.expm1(log_ratio64) - log_ratio64).clamp_min(0.0).mean())
    return {"behaviour_weight": mean_weight, "behaviour_weight_truncated": over, "kl_behaviour": kl}
