"""``MultiTurnGRPOTrainer``: TRL's GRPOTrainer over whole τ²-airline episodes (policy ↔ tools ↔ user).

How it departs from textbook GRPO (single-turn, one completion per prompt):
1. A rollout is a whole episode played by ``tau2_rl.envs.runner.run_episodes`` (the same loop the evaluator and
   the trajectory collector use). The loop calls the policy with the episodes that are ready, each moving on when its
   own user reply lands (``--schedule events``, the default; ``waves`` advances all active episodes together, and
   with the scripted user, which answers at once, the two are the same lock-step waves): one batched call of TRL's
   own ``_generate_single_turn`` per policy call, so transformers ``generate`` (CPU/GPU) and vLLM (colocate or
   server) both work unchanged; on the transformers path the calls reuse the shared system-prompt prefix instead
   (``rollout_prefix_reuse``, TRL's decoding rule through ``tau2_rl.backends.trl_prefix``).
2. Token-in, token-out: a completion is the sampled ids of every policy turn, interleaved with the tokens of the
   user and tool messages obtained by rendering the chat template with and without the new messages
   (``tau2_rl.render``). Decoded model text is never re-tokenised. Environment tokens get ``tool_mask`` 0.
3. The prompt is the system prompt and the fixed greeting, identical for every episode of a task (vLLM's prefix
   cache and TRL's grouping both rely on that); the user's opening message is already part of the completion.
4. The loss variant is applied as per-token advantages (``tau2_rl.trainers.variants``) on top of TRL's unchanged
   ``_compute_loss`` with ``loss_type="luspo"``; PRM-Lite enters as a second reward function (weight ``prm_coef``).
5. Truncation comes from the episode record (token budget exhausted), not from the last token, and an episode whose
   user simulator failed gets no reward (NaN: TRL excludes it from the group baseline and gives it advantage 0).
6. A run does not depend on its process count: episode seeds follow the row's global index, and on the prefix path
   each turn samples from its own seeded generator; FSDP2 (also on CPU: ``tau2_rl.run.sharding``) and ZeRO-3 gather
   the parameters once per rollout round, so the ranks generate locally, whatever their turn counts.
7. A step in which *every* episode (all ranks) failed in the user simulator takes no optimiser step: its gradients
   are dropped before ``optimizer.step`` (weights and optimiser state unchanged), it is logged as
   ``train/user_error_skip`` and not counted as trained, and ``max_user_error_steps`` such steps in a row stop the
   run with a checkpoint (``UserErrorStop``; train_grpo.py exits 1 naming the endpoint's error).

8. ``--max_staleness k`` ≥ 1: a rollout worker process plays the next batches ahead (``generation_ahead.py``);
   ``_generate`` takes its played batch, whose behaviour log-probs feed TRL's importance-sampling correction
   (``_behaviour_correction``). k = 0 (default) is the synchronous loop above, unchanged.

Overridden hooks (pinned to trl==1.16.0, checked by tests/test_trl_hooks.py): ``_generate`` (whole episodes),
``_generate_and_score_completions`` (truncation mask, variant advantages, metrics), ``training_step`` (timing),
transformers' ``_get_grad_norm`` (the pre-clip gradient norm of every step; a user-error step's gradients dropped),
transformers' ``get_batch_samples`` (the dataloader read ahead, only with ``--max_staleness``),
transformers' ``_load_optimizer_and_scheduler`` (a multi-process CPU run's optimiser state loads to ``cpu``) and
``evaluate`` (held-out pass^k, ``tau2_rl.evaluation.heldout``, instead of the loss on eval prompts); and, through
``run.sharding.ShardedLaunch``, transformers' ``create_accelerator_and_postprocess`` (CPU FSDP2, launch checks).

Launch (see recipes/grpo/*.yaml):
    accelerate launch --config_file accelerate_configs/cpu.yaml train_grpo.py --config recipes/grpo/joint.yaml
    accelerate launch --config_file accelerate_configs/zero2_offload.yaml train_grpo.py \
        --config recipes/grpo/joint.yaml --model_name_or_path /models/Qwen2.5-7B-Instruct --use_vllm true
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import time
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import DistributedType, gather_object
from transformers import TrainerCallback
from trl import GRPOTrainer

from tau2_rl.backends import trl_prefix, vllm_seeds
from tau2_rl.configs import MultiTurnGRPOConfig
from tau2_rl.envs.episode import Episode, EpisodeRecord
from tau2_rl.envs.multi import RunEnv
from tau2_rl.envs.protocol import agent_view
from tau2_rl.envs.runner import RunTimings, Schedule, run_episodes
from tau2_rl.envs.users.base import UserSimulator
from tau2_rl.rewards.outcome import TERM_FIELDS, outcome_reward
from tau2_rl.rewards.prm import PRMResult, episode_rule_stats, score_episode, within_group_signal
from tau2_rl.rollout import TokenPolicyAgent, policy_max_context
from tau2_rl.run.sharding import LaunchError, ShardedLaunch
from tau2_rl.trainers.fused_head import score_labelled_positions_on_cpu
from tau2_rl.trainers.generation_ahead import (
    GenerationAhead,
    PlayedBatch,
    PlayedEpisode,
    RolloutWorkerError,
    behaviour_stats,
)
from tau2_rl.trainers.variants import token_advantages

if TYPE_CHECKING:
    from tau2_rl.evaluation.heldout import HeldoutEvaluation

logger = logging.getLogger(__name__)


def outcome(completions: list, episode: list[dict], **kwargs: Any) -> list[float | None]:
    """τ²'s outcome reward from the episode record (None when the user simulator failed: not the agent's fault)."""
    return [None if ep["reward"]["user_error"] else float(ep["reward"]["reward"]) for ep in episode]


def process(completions: list, episode: list[dict], **kwargs: Any) -> list[float | None]:
    """The PRM-Lite process score (clipped sum of turn scores); weighted by ``prm_coef`` through reward_weights."""
    return [None if ep["reward"]["user_error"] else float(ep["prm"]["process_score"]) for ep in episode]


_LOGGED_REASONS: set[str] = set()  # why rollouts keep TRL's generate call, said once per process


class TrainerBackend:
    """``GenerationBackend`` over the trainer's own ``_generate_single_turn`` (transformers or vLLM).

    In multi-process runs every rank must make the same number of generation calls (vLLM server mode and ZeRO-3 /
    FSDP generation are collectives): each wave first agrees on whether any rank still has work, and an idle rank
    joins with a 1-token dummy generation. ``drain`` keeps an idle rank in step until all ranks are done.

    On the plain transformers path the waves go through ``tau2_rl.backends.trl_prefix`` instead (TRL's decoding
    rule, the shared system prompt prefilled once per rollout round and read once per decoding step) unless
    ``trl_prefix.unavailable`` names a reason to keep TRL's own call; ``drain`` ends the round.
    """

    def __init__(self, trainer: MultiTurnGRPOTrainer) -> None:
        self.trainer = trainer
        reason = trl_prefix.unavailable(trainer)
        self.prefix_generation = trl_prefix.TrlPrefixGeneration(trainer) if reason is None else None
        self.seeded_llm: vllm_seeds.SeededLLM | None = None
        if trainer.use_vllm:  # TRL's vLLM call: per-request seeds where the engine is colocated (vllm_seeds.py)
            seeded = vllm_seeds.seed_requests(trainer)
            if isinstance(seeded, vllm_seeds.SeededLLM):
                self.seeded_llm = seeded
            elif seeded not in _LOGGED_REASONS:
                _LOGGED_REASONS.add(seeded)
                logger.info("rollouts sample from one vLLM generator per batch: %s, so a rollout there depends on how "
                            "the rows are spread over processes and generation calls", seeded)  # fmt: skip
        elif reason is not None and reason not in _LOGGED_REASONS:
            _LOGGED_REASONS.add(reason)
            logger.info(
                "rollouts generate through TRL without prefix reuse: %s (TRL samples from one generator per batch, "
                "so a rollout there depends on how the rows are spread over processes)",
                reason,
            )

    def _any_rank_busy(self, busy: bool) -> bool:
        accelerator = self.trainer.accelerator
        if accelerator.num_processes == 1:
            return busy
        flags = accelerator.gather(torch.tensor([int(busy)], device=accelerator.device))
        return bool(flags.sum().item())

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int] | None = None
    ) -> tuple[list[list[int]], Any]:
        """``seeds`` (per-row sampling) are honoured on the prefix path and by a colocated vLLM engine; TRL's other
        calls sample per batch."""
        if self.prefix_generation is not None:
            self.prefix_generation.begin_round()  # FSDP2: the round's one all-gather, before any other collective
        if not self._any_rank_busy(bool(prompts)):
            return [], None
        if not prompts:  # idle rank: join the others' generation collective (TRL's path) with a dummy prompt
            self._dummy_generation()
            return [], None
        if self.prefix_generation is not None:
            return self.prefix_generation.generate(prompts, max_new_tokens, seeds), None
        if self.seeded_llm is not None:
            self.seeded_llm.seeds = seeds  # this call's requests, one seed each (cleared by the call)
        with self.trainer._max_new_tokens(max_new_tokens):
            return self.trainer._generate_single_turn(prompts, None, {}, 1)

    @property
    def prefix_hint(self) -> list[int] | None:
        return self.prefix_generation.prefix_hint if self.prefix_generation is not None else None

    @prefix_hint.setter
    def prefix_hint(self, ids: list[int] | None) -> None:
        if self.prefix_generation is not None:  # TRL's own calls build no prefix of ours
            self.prefix_generation.prefix_hint = ids

    def release(self, prompts: list[list[int]]) -> None:
        """Finished episodes: their turn caches are freed (prefix path)."""
        if self.prefix_generation is not None:
            self.prefix_generation.release(prompts)

    def _dummy_generation(self) -> None:
        if self.prefix_generation is not None:  # local generation: no collective to join
            return
        pad = self.trainer.processing_class.pad_token_id or 0
        with self.trainer._max_new_tokens(1):
            self.trainer._generate_single_turn([[pad]], None, {}, 1)

    def drain(self) -> None:
        if self.prefix_generation is not None:
            self.prefix_generation.begin_round()  # a rank with no turn this round still joins the all-gather
        while self.trainer.accelerator.num_processes > 1 and self._any_rank_busy(False):
            self._dummy_generation()
        self.close()

    def close(self) -> None:
        """Ends a rollout round (the prefix cache of these weights is dropped before the optimiser step)."""
        if self.prefix_generation is not None:
            self.prefix_generation.close()
            self.trainer._turn_cache_stats = self.prefix_generation.stats  # logged with the rollout's metrics


class MultiTurnGRPOTrainer(ShardedLaunch, GRPOTrainer):
    """GRPO over multi-turn tool-calling episodes; see the module docstring for what differs from GRPOTrainer."""

    def __init__(
        self,
        model: Any,
        args: MultiTurnGRPOConfig,
        env: RunEnv,
        user: UserSimulator,
        train_dataset: Any,
        processing_class: Any = None,
        eval_dataset: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        reward_funcs: list | None = None,
        heldout: HeldoutEvaluation | None = None,
        schedule: Schedule | None = None,
        score: Any = None,
    ) -> None:
        """``schedule``: when the episode loop calls the policy (``--schedule``, ``--min_ready``, ``--batch_window``;
        default event-driven, which is the lock-step waves with the scripted user); ``score``: the outcome reward
        (``tau2_rl.rewards.outcome.scorer``: with the NL-assertion judge when the tasks need one; default without)."""
        if heldout is not None and eval_dataset is None:  # Trainer needs an eval_dataset once eval_strategy is set
            eval_dataset = heldout.dataset()
        score_labelled_positions_on_cpu()
        if reward_funcs is None:  # the variant's rewards: τ²'s outcome, plus prm_coef × PRM-Lite for prm_lite/joint
            reward_funcs = [outcome] + ([process] if args.uses_prm else [])
            args.reward_weights = [1.0] + ([args.prm_coef] if args.uses_prm else [])
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            peft_config=peft_config,
            callbacks=callbacks,
        )
        if args.rollout_prefix_reuse:  # forced on: refuse a launch where it cannot run rather than run without
            reason = trl_prefix.unavailable(self)
            if reason is not None:
                raise LaunchError(f"--rollout_prefix_reuse true cannot be honoured: {reason}; leave it unset (auto)")
        self.env = env
        self.user = user
        self.score = score if score is not None else outcome_reward
        self._rollout_rows: list[dict] = []
        self._rollout_episodes: list[Episode] = []
        self._rollout_seconds = 0.0
        self._env_seconds = 0.0
        self._last_prm: list[PRMResult] = []
        self.heldout = heldout
        self.schedule = schedule or Schedule()
        # user-simulator failures (numbers over all ranks): whether the current generation batch is nothing but
        # user errors, whether this optimiser step trained on anything, and the run's counts (this process's run)
        self._user_error_batch = False
        self._step_trained = False
        self.last_user_error: str | None = None
        self.user_error_episodes = 0
        self.episodes_played = 0
        self.user_error_stop = UserErrorStop(args.max_user_error_steps)
        self.add_callback(self.user_error_stop)
        self._ahead: GenerationAhead | None = None
        if args.max_staleness > 0:
            self._ahead = GenerationAhead(self, args.max_staleness, _worker_threads(args))
            self._check_generation_ahead()
            self.add_callback(_AheadCallback(self._ahead))

    def _check_generation_ahead(self) -> None:
        """Refuses, in one line, the setups where generation cannot run ahead (a rollout worker process) yet."""
        flag = f"--max_staleness {self.args.max_staleness}"
        if self.args.async_correction == "none":
            logger.warning("%s with --async_correction none: training naive off-policy (no behaviour weight)", flag)
        if self.use_vllm and self.args.vllm_mode == "colocate":
            raise LaunchError(
                f"{flag} needs a rollout worker: colocated vLLM generates in the training process, so nothing "
                "overlaps; use --vllm_mode server (a vLLM server on its own GPUs), --max_staleness 0 or "
                "--use_vllm false"
            )
        if self.use_vllm:  # server mode: the workers sample on the server, the trainer pushes its weights there
            return  # any process count and sharding: the ranks push together (ServedWeights)
        if self.accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU):
            raise LaunchError(
                f"{flag} on the transformers path runs on one process or DDP on CPU, not under "
                f"{self.accelerator.distributed_type.value}; on GPUs use --use_vllm true --vllm_mode server"
            )
        reason = trl_prefix.unavailable(self)
        if reason is not None:
            raise LaunchError(f"{flag}: the rollout worker samples through the prefix path, but {reason}")

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        """With generation ahead, the epoch iterator is read ahead so the worker knows the next batches' rows."""
        if self._ahead is not None:  # only the training loop calls it
            epoch_iterator = self._ahead.lookahead(epoch_iterator)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """Held-out pass^k of the current policy (``HeldoutEvaluation.run``) when configured, else TRL's evaluation."""
        if self.heldout is None or eval_dataset is not None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        return self.heldout.run(self, metric_key_prefix)

    # -- generation ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _max_new_tokens(self, n: int) -> Iterator[None]:
        """Caps the next generation call at ``n`` new tokens on whichever backend is in use."""
        if self.use_vllm:
            saved = self.vllm_generation.max_completion_length
            self.vllm_generation.max_completion_length = n
        else:
            saved = self.generation_config.max_new_tokens
            self.generation_config.max_new_tokens = n
        try:
            yield
        finally:
            if self.use_vllm:
                self.vllm_generation.max_completion_length = saved
            else:
                self.generation_config.max_new_tokens = saved

    @contextlib.contextmanager
    def _vllm_awake_for_rollout(self) -> Iterator[None]:
        """Keeps a colocated, sleep-mode vLLM engine awake for a whole rollout instead of for each wave.

        TRL puts the engine to sleep (level 2: weights and KV cache discarded) after every ``generate`` call and
        re-pushes the weights before the next one. A multi-turn rollout calls it once per wave, so that would pay a
        full weight sync per wave and lose the prefix cache between turns. Here: sync and wake once, generate all
        waves with sleep mode off, and put the engine back to sleep for the optimiser step.
        """
        generation = getattr(self, "vllm_generation", None)
        if not (self.use_vllm and generation is not None and generation.mode == "colocate"
                and generation.enable_sleep_mode):  # fmt: skip
            yield
            return
        if generation._llm_weights_sleeping or self.state.global_step != self._last_loaded_step:
            generation.sync_weights()  # wakes the weights and loads the current training weights
            self._last_loaded_step = self.state.global_step
        generation.llm.wake_up(tags=["kv_cache"])
        generation.enable_sleep_mode = False
        try:
            yield
        finally:
            generation.enable_sleep_mode = True
            generation.llm.sleep(level=2)
            generation._llm_weights_sleeping = True

    def policy_agent(self) -> tuple[TrainerBackend, TokenPolicyAgent]:
        """The current policy as an episode agent (training rollouts and held-out evaluation generate alike).

        On the prefix path every turn samples from its own generator (``turn_seed(episode seed, turn)``), so what
        an episode plays depends on its seed only, not on the rows or processes it shares a wave with."""
        backend = TrainerBackend(self)
        agent = TokenPolicyAgent(
            backend,
            self.processing_class,
            self.eos_token_ids,
            self.args.max_completion_length,
            self.args.max_turn_tokens,
            policy_max_context(self),
            per_episode_seeds=backend.prefix_generation is not None or backend.seeded_llm is not None,
        )
        return backend, agent

    def _episode_seed(self, index: int, rows: int, step: int | None = None) -> int:
        """The episode seed of local row ``index`` of ``rows``: a function of the run's ``--seed``, the step and the
        row's *global* index.

        accelerate gives process p the global rows [p·rows, (p+1)·rows) of each generation batch, so N processes ×
        B rows play exactly the episodes of 1 process × N·B rows (house style 10: a run does not depend on its
        process count). ``--seed`` is in it because the episodes are the run's only randomness when it starts from
        a checkpoint (the quick start's default policy): before a40362a it was not, and seeds 42, 1 and 2 of
        the quick start trained the same run."""
        global_index = self.accelerator.process_index * rows + index
        step = self.state.global_step if step is None else step  # generation ahead: the step it trains at
        return zlib.crc32(f"{self.args.seed}/{step}/{global_index}".encode()) & 0x7FFFFFFF

    def _generate(self, prompts: list) -> tuple:
        """Plays one episode per prompt row and returns TRL's 8-tuple with token-in/token-out completions."""
        mode = "train" if self.model.training else "eval"
        rows = self._rollout_rows
        if len(rows) != len(prompts):
            raise RuntimeError("rollout rows and prompts are out of sync")
        if self._ahead is not None and mode == "train":
            return self._take_played(rows)
        start = time.perf_counter()
        specs = [(str(row["task_id"]), self._episode_seed(i, len(rows))) for i, row in enumerate(rows)]
        episodes = [self.env.reset(task_id, seed) for task_id, seed in specs]
        backend, agent = self.policy_agent()
        for episode in episodes:
            agent.start(episode)
        timings = RunTimings()
        with self._vllm_awake_for_rollout():
            records = run_episodes(
                self.env,
                agent,
                self.user,
                specs,
                timings=timings,
                episodes=episodes,
                score=self.score,
                schedule=self.schedule,
            )
            backend.drain()
        prm_start = time.perf_counter()
        clip = self.args.prm_clip if self.args.prm_clip is not None else 0.5
        rules = self.args.prm_rules  # the reference sets read each record's task from the env that played it
        prm_results = [score_episode(record, clip=(-clip, clip), rules=rules, env=self.env) for record in records]
        timings.reward += time.perf_counter() - prm_start

        prompt_ids = [ep.agent_state["prompt_ids"] for ep in episodes]
        completion_ids = [list(ep.agent_state["completion_ids"]) for ep in episodes]
        tool_mask = [list(ep.agent_state["tool_mask"]) for ep in episodes]
        logprobs = [list(ep.agent_state["logprobs"]) for ep in episodes] if self.use_vllm else None
        self._pad_empty_completions(completion_ids, tool_mask, logprobs)
        completions = [
            agent_view(ep.messages)[ep.prefix_length :] for ep in episodes
        ]  # the user's own calls are not the agent's
        extra = [_episode_summary(record, prm) for record, prm in zip(records, prm_results, strict=True)]
        self._rollout_episodes = episodes
        self._env_seconds += timings.env + timings.user + timings.reward
        self._log_rollout_metrics(mode, records, prm_results, extra, timings, time.perf_counter() - start)
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, {"episode": extra}, None, []

    def _pad_empty_completions(
        self, completion_ids: list[list[int]], tool_mask: list[list[int]], logprobs: list[list[float]] | None
    ) -> None:
        """An episode without a policy turn (the user simulator failed first) gets one masked pad token, as TRL
        needs ≥ 1 completion token per row."""
        pad = self.processing_class.pad_token_id or 0
        for row, ids in enumerate(completion_ids):
            if not ids:
                ids.append(pad)
                tool_mask[row].append(0)
                if logprobs is not None:
                    logprobs[row].append(0.0)

    def _take_played(self, rows: list[dict]) -> tuple:
        """The generation batch the rollout worker played ahead for this step, as ``_generate``'s 8-tuple; the
        behaviour log-probs take TRL's vLLM slot (``_behaviour_correction``)."""
        assert self._ahead is not None
        played = self._take_on_every_rank(rows)
        episodes = [PlayedEpisode(record, state, messages) for record, state, messages in zip(
            played.records, played.agent_states, played.completions, strict=True)]  # fmt: skip
        prompt_ids = [state["prompt_ids"] for state in played.agent_states]
        completion_ids = [list(state["completion_ids"]) for state in played.agent_states]
        tool_mask = [list(state["tool_mask"]) for state in played.agent_states]
        logprobs = [list(lps) for lps in played.behaviour_logprobs]
        self._pad_empty_completions(completion_ids, tool_mask, logprobs)
        extra = [_episode_summary(r, p) for r, p in zip(played.records, played.prm_results, strict=True)]
        self._rollout_episodes = episodes  # type: ignore[assignment]
        timings = played.timings
        self._env_seconds += timings.env + timings.user + timings.reward
        self._log_rollout_metrics("train", played.records, played.prm_results, extra, timings, played.seconds)
        staleness = [float(self.state.global_step - played.version)]
        waits = [self._ahead.wait_seconds, played.seconds, played.idle_seconds, self._ahead.trainer_idle_share]
        if self.accelerator.num_processes > 1:
            staleness = gather_object(staleness)
            waits = gather_object([waits])
        else:
            waits = [waits]
        metrics = self._metrics["train"]
        metrics["async/staleness"].append(statistics.fmean(staleness))
        metrics["async/staleness_max"].append(max(staleness))
        metrics["async/trainer_wait_seconds"].append(max(w[0] for w in waits))
        metrics["async/generator_busy_seconds"].append(max(w[1] for w in waits))
        metrics["async/generator_idle_seconds"].append(max(w[2] for w in waits))
        metrics["async/generator_idle_share"].append(statistics.fmean(w[2] / max(w[1] + w[2], 1e-9) for w in waits))
        metrics["async/trainer_idle_share"].append(statistics.fmean(w[3] for w in waits))
        return prompt_ids, completion_ids, tool_mask, played.completions, logprobs, {"episode": extra}, None, []

    def _take_on_every_rank(self, rows: list[dict]) -> PlayedBatch:
        """This rank's played batch; with several processes the ranks first agree whether any rank's worker failed,
        so that all of them stop together (and save the checkpoint together) instead of one waiting in a collective
        the other never joins."""
        assert self._ahead is not None
        try:
            played, failure = self._ahead.take(self.state.global_step, rows), None
        except RolloutWorkerError as err:
            played, failure = None, err
        if self.accelerator.num_processes > 1:
            failures = gather_object([None if failure is None else str(failure)])
            first = next((f"rank {rank}: {text}" for rank, text in enumerate(failures) if text), None)
            if first is not None:
                raise RolloutWorkerError(first)
        elif failure is not None:
            raise failure
        assert played is not None
        return played

    @contextlib.contextmanager
    def _behaviour_correction(self, loss_inputs: dict[str, Any] | None = None) -> Iterator[None]:
        """With generation ahead: TRL's vLLM importance-sampling code, fed with the worker's behaviour log-probs.

        TRL computes it only ``if self.use_vllm and self.vllm_importance_sampling_correction``: the proximal
        log-probs (``old_per_token_logps``, at the step the batch first trains), the per-token weight
        exp(old − behaviour) truncated (``token_truncate``) or masked (``token_mask``) at the cap, and the loss
        multiplied by it. Those are the only places TRL reads ``use_vllm`` once ``_generate`` has returned, so the
        flag is raised around them; generation itself (the worker's) never sees it.

        When a generation batch is trained by exactly one optimiser step (``_proximal_is_current``), the proximal
        policy is the one the loss's own forward runs, so TRL's extra forward pass for ``old_per_token_logps`` at
        scoring time (``loss_inputs`` None) is skipped, and the weight is made from that forward's log-probs in the
        loss (``loss_inputs``: the micro-batch, ``_weigh_by_behaviour``)."""
        if self._ahead is None or not self.model.training:
            yield
            return
        saved = (self.use_vllm, self.vllm_importance_sampling_correction, self.vllm_importance_sampling_mode,
                 self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_clip_min)  # fmt: skip
        correction = self.args.async_correction
        in_loss = self._proximal_is_current()
        self.use_vllm = True
        self.vllm_importance_sampling_correction = correction != "none" and (loss_inputs is not None or not in_loss)
        self.vllm_importance_sampling_mode = "token_mask" if correction == "mask" else "token_truncate"
        self.vllm_importance_sampling_clip_max = self.args.async_behaviour_cap
        self.vllm_importance_sampling_clip_min = None
        forward = self._get_per_token_logps_and_entropies
        if in_loss and loss_inputs is not None:

            def policy_forward(*args: Any, **kwargs: Any) -> Any:
                self._get_per_token_logps_and_entropies = forward  # the policy's forward is the loss's first
                logps, *rest = forward(*args, **kwargs)
                self._weigh_by_behaviour(loss_inputs, logps.detach())
                return (logps, *rest)

            self._get_per_token_logps_and_entropies = policy_forward
        try:
            yield
        finally:
            self.__dict__.pop("_get_per_token_logps_and_entropies", None)
            (self.use_vllm, self.vllm_importance_sampling_correction, self.vllm_importance_sampling_mode,
             self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_clip_min) = saved  # fmt: skip

    def _proximal_is_current(self) -> bool:
        """True when every generation batch is trained by one optimiser step (``num_iterations`` 1, generation
        aligned with gradient accumulation: TRL's own condition for needing no ``old_per_token_logps``): the
        proximal policy, the weights at the start of that step, is then the policy of the loss's forward pass."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every == 0

    def _weigh_by_behaviour(self, inputs: dict[str, Any], proximal: torch.Tensor) -> None:
        """TRL's token-level weight from the loss forward's own log-probs (``proximal``, detached): exp(proximal −
        behaviour) over the policy tokens (1 where the behaviour log-prob is missing), truncated or masked at the
        cap as TRL's ``token_truncate`` / ``token_mask``; into ``inputs`` for TRL's loss, and the metrics."""
        behaviour = inputs["sampling_per_token_logps"]
        mask = inputs["completion_mask"] * inputs["tool_mask"]
        ratio = torch.exp(torch.nan_to_num((proximal - behaviour) * mask, nan=0.0))
        cap = self.args.async_behaviour_cap
        correction = self.args.async_correction
        if correction == "truncate":
            inputs["importance_sampling_ratio"] = torch.clamp(ratio, max=cap)
        elif correction == "mask":
            inputs["importance_sampling_ratio"] = ratio.masked_fill(ratio > cap, 0.0)
        stats = behaviour_stats({**inputs, "old_per_token_logps": proximal}, cap if correction != "none" else None)
        for key, value in stats.items():
            self._metrics["train"][f"async/{key}"].append(value)

    # -- scoring and loss shaping --------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        start = time.perf_counter()
        self._rollout_rows = inputs
        mask_truncated = self.mask_truncated_completions
        self.mask_truncated_completions = False  # judged from the episode record below, not from the last token
        try:
            with self._behaviour_correction():
                output = super()._generate_and_score_completions(inputs)
        finally:
            self.mask_truncated_completions = mask_truncated
        if self._ahead is not None and self.model.training:
            cap = self.args.async_behaviour_cap if self.args.async_correction != "none" else None
            for key, value in behaviour_stats(output, cap).items():
                self._metrics["train"][f"async/{key}"].append(value)
        episodes = self._rollout_episodes
        device = output["completion_ids"].device
        if mask_truncated:
            keep = torch.tensor([not ep.record.truncated for ep in episodes], device=device).unsqueeze(1).int()
            output["completion_mask"] = output["completion_mask"] * keep
            output["tool_mask"] = output["tool_mask"] * keep
            loss_mask = output["completion_mask"] * output["tool_mask"]
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        policy_mask = output["completion_mask"] * output["tool_mask"]
        turn_index = _turn_index(episodes, policy_mask.shape[1], device)
        turn_scores = credit_eligible = None
        if self.args.variant == "joint":
            turn_scores = _pad_turn_scores([ep.record for ep in episodes], self._last_prm, device)
            # no per-turn credit for an episode the user simulator broke or the token budget cut, whatever the mask
            credit_eligible = torch.tensor(
                [ep.record.user_error is None and not ep.record.truncated for ep in episodes], device=device
            )
        output["advantages"] = token_advantages(
            self.args.variant,
            output["advantages"],
            policy_mask,
            turn_index,
            turn_scores=turn_scores,
            alpha=self.args.turn_discount_alpha,
            turn_credit_coef=self.args.turn_credit_coef,
            length_reference=self.args.length_reference,
            prm_clip=self.args.prm_clip,
            credit_eligible=credit_eligible,
        )
        self._rollout_seconds += time.perf_counter() - start
        return output

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        """TRL's loss; on a batch of nothing but user errors it is multiplied by 0 (the backward still runs, so every
        rank joins the same collectives) and the step's gradients are dropped in ``_get_grad_norm``."""
        with self._behaviour_correction(inputs):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self.model.training:
            return loss
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            # DeepSpeed steps its optimiser inside backward, before ``_get_grad_norm`` could drop anything: a
            # user-error step runs at learning rate 0 instead (the weights stay; Adam's moments decay once)
            self._deepspeed_lr_guard()
        if self._user_error_batch:
            return loss * 0.0
        self._step_trained = True
        return loss

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """transformers maps the optimiser state to ``args.device`` when several processes train; on CPU (the twins)
        that is ``cpu:<rank>``, which ``torch.load`` cannot restore to, so no multi-process CPU run could resume.
        There it loads to ``cpu`` (the same memory) instead."""
        device = self.args.device
        if checkpoint is None or device.type != "cpu" or device.index is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        cached = self.args.__dict__.get("_setup_devices")  # TrainingArguments' cached device
        self.args.__dict__["_setup_devices"] = torch.device("cpu")
        try:
            return super()._load_optimizer_and_scheduler(checkpoint)
        finally:
            if cached is None:
                self.args.__dict__.pop("_setup_devices", None)
            else:
                self.args.__dict__["_setup_devices"] = cached

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        start = time.perf_counter()
        self._rollout_seconds = 0.0
        self._env_seconds = 0.0
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.model.training:
            total = time.perf_counter() - start
            metrics = self._metrics["train"]
            metrics["timing/optimisation"].append(total - self._rollout_seconds)
            if self._rollout_seconds > 0:  # this micro-step generated: how much of it went to env + user + reward
                metrics["timing/env_user_reward_share"].append(self._env_seconds / total if total > 0 else 0.0)
        return loss

    def _deepspeed_lr_guard(self) -> None:
        """Under DeepSpeed: learning rate 0 for a user-error generation batch, the scheduled one back otherwise."""
        saved = getattr(self, "_saved_lrs", None)
        if saved is not None and not self._user_error_batch:
            for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
                if group["lr"] == 0.0:  # unless the scheduler has set this step's rate since
                    group["lr"] = lr
            self._saved_lrs = None
        elif saved is None and self._user_error_batch:
            self._saved_lrs = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = 0.0

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """Logs the pre-clip gradient norm of every optimiser step, and whether ``max_grad_norm`` clipped it.

        transformers logs ``grad_norm`` only at logging steps (the last step's value); the variants differ in step
        size (1/L vs 1/√L), so the ablation needs every step's norm and how often clipping was active."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self.model.training:  # called once per optimiser step, right before ``optimizer.step``
            skipped = not self._step_trained
            self._step_trained = False
            if skipped:  # every episode was a user error: no update (torch optimisers skip parameters without grad)
                model.zero_grad(set_to_none=True)
                grad_norm = None
            self._metrics["train"]["train/user_error_skip"].append(float(skipped))
            self.user_error_stop.record(skipped)
        if grad_norm is not None and self.model.training:
            norm = float(grad_norm)
            self._metrics["train"]["grad_norm/pre_clip"].append(norm)
            limit = self.args.max_grad_norm
            self._metrics["train"]["grad_norm/clipped"].append(float(bool(limit and limit > 0 and norm > limit)))
        return grad_norm

    # -- metrics -------------------------------------------------------------------------------------------------

    def _log_rollout_metrics(
        self,
        mode: str,
        records: list[EpisodeRecord],
        prm_results: list[PRMResult],
        summaries: list[dict],
        timings: RunTimings,
        seconds: float,
    ) -> None:
        self._last_prm = prm_results
        local = [
            {
                "reward": s["reward"]["reward"],
                "user_error": s["reward"]["user_error"],
                "process": s["prm"]["process_score"],
                "turns": s["num_turns"],
                "tool_calls": s["num_tool_calls"],
                "user_tool_calls": len(r.user_tool_calls),
                "tool_errors": s["num_tool_errors"],
                "truncated": s["truncated"],
                "user_error_text": r.user_error if s["reward"]["user_error"] else None,
                "turn_tokens": [t.num_policy_tokens or 0 for t in r.turns],
                "rules": s["prm"]["rule_counts"],
                "domain": self.env.task(r.task_id).domain,
                "terms": reward_terms(s["reward"], self.env.task(r.task_id).reward_basis),
            }
            for s, r in zip(summaries, records, strict=True)
        ]
        everything = gather_object(local) if self.accelerator.num_processes > 1 else local
        metrics = self._metrics[mode]
        n = max(len(everything), 1)
        metrics["episode/outcome_reward"].append(sum(e["reward"] for e in everything) / n)
        metrics["episode/process_reward"].append(sum(e["process"] for e in everything) / n)
        metrics["episode/turns"].append(sum(e["turns"] for e in everything) / n)
        metrics["episode/tool_calls"].append(sum(e["tool_calls"] for e in everything) / n)
        if any(member.spec.user_tool_types is not None for member in self.env.members):  # the user's own calls
            metrics["episode/user_tool_calls"].append(sum(e["user_tool_calls"] for e in everything) / n)
        calls = sum(e["tool_calls"] for e in everything)
        metrics["episode/tool_error_rate"].append(sum(e["tool_errors"] for e in everything) / calls if calls else 0.0)
        metrics["episode/truncation_rate"].append(sum(e["truncated"] for e in everything) / n)
        user_errors = sum(bool(e["user_error"]) for e in everything)
        metrics["episode/user_sim_errors"].append(float(user_errors))
        terms = sorted({t for e in everything for t in e["terms"]})  # each term of the tasks' reward bases, when one
        if set(terms) - {"DB", "COMMUNICATE"}:  # goes beyond τ²'s default pair (whose runs log what they always did)
            for term in terms:
                met = [e["terms"][term] for e in everything if term in e["terms"]]
                metrics[f"reward_term/{term}"].append(sum(met) / len(met))
        if len(self.env.members) > 1:  # a run over several domains: each domain's episodes apart (those it played)
            for domain in sorted({e["domain"] for e in everything}):
                mine = [e for e in everything if e["domain"] == domain]
                metrics[f"domain/{domain}/outcome_reward"].append(sum(e["reward"] for e in mine) / len(mine))
                metrics[f"domain/{domain}/tool_calls"].append(sum(e["tool_calls"] for e in mine) / len(mine))
                metrics[f"domain/{domain}/episodes"].append(float(len(mine)))
        if mode == "train":  # every rank sees the same gathered list: the skip decision is the same everywhere
            self._user_error_batch = bool(everything) and user_errors == len(everything)
            self.user_error_episodes += user_errors
            self.episodes_played += len(everything)
            errors = [e["user_error_text"] for e in everything if e["user_error_text"]]
            if errors:
                self.last_user_error = errors[-1]
        turn_tokens = [t for e in everything for t in e["turn_tokens"]]
        metrics["episode/p50_tokens_per_turn"].append(float(statistics.median(turn_tokens)) if turn_tokens else 0.0)
        group = self.num_generations if mode == "train" else self.num_generations_eval
        outcomes = [e["reward"] for e in everything]
        groups = [outcomes[i : i + group] for i in range(0, len(outcomes) - group + 1, group)]
        saturated = sum(1 for g in groups if all(r >= 1.0 for r in g) or all(r <= 0.0 for r in g))
        metrics["episode/group_saturation"].append(saturated / len(groups) if groups else 0.0)
        successes = [e["reward"] >= 1.0 for e in everything]
        fired = [PRMResult(turn_scores=[], fired=[], process_score=0.0, raw_score=0.0, rule_counts=e["rules"])
                 for e in everything]  # fmt: skip
        for key, value in episode_rule_stats(fired, successes).items():
            metrics[key].append(value)
        # is the process score a signal where GRPO looks, inside groups with mixed outcomes (undefined: not logged)
        signal = within_group_signal(
            [e["process"] for e in everything], outcomes, [i // group for i in range(len(everything))],
            [e["rules"] for e in everything],
        )  # fmt: skip
        metrics["prm/mixed_groups"].append(signal.pop("mixed_groups"))
        metrics["prm/saturated_groups"].append(signal.pop("saturated_groups"))
        for key, value in signal.items():
            if not math.isnan(value):
                metrics[f"prm/{key}"].append(value)
        metrics["timing/generation"].append(timings.agent)
        metrics["timing/env_user"].append(timings.env + timings.user)
        metrics["timing/reward_prm"].append(timings.reward)
        metrics["timing/rollout"].append(seconds)
        schedules = [timings.schedule_summary()]  # the policy engine's idle share (mean over ranks), the user
        schedules = gather_object(schedules) if self.accelerator.num_processes > 1 else schedules  # server's load
        metrics["rollout/agent_idle_fraction"].append(statistics.fmean(s["agent_idle_fraction"] for s in schedules))
        metrics["rollout/user_requests_in_flight"].append(sum(s["user_requests_in_flight"] for s in schedules))
        metrics["rollout/user_requests_in_flight_max"].append(
            float(sum(s["user_requests_in_flight_max"] for s in schedules))
        )
        cache_stats = [getattr(self, "_turn_cache_stats", {})]  # this round's (trl_prefix): summed over ranks,
        cache_stats = gather_object(cache_stats) if self.accelerator.num_processes > 1 else cache_stats  # peaks: max
        for key in sorted({k for stats in cache_stats for k in stats}):
            values = [float(stats.get(key, 0)) for stats in cache_stats]
            metrics[f"rollout/turn_cache_{key}"].append(max(values) if key.startswith("peak") else sum(values))
        if hasattr(self.user, "stats"):  # each rank has its own client: counts summed, latencies the worst rank's
            stats = [self.user.stats()]
            stats = gather_object(stats) if self.accelerator.num_processes > 1 else stats
            for key in stats[0]:
                values = [float(s[key]) for s in stats if isinstance(s.get(key), int | float)]
                if values:
                    metrics[f"user_sim/{key}"].append(max(values) if key.startswith("latency") else sum(values))


def _worker_threads(args: MultiTurnGRPOConfig) -> int:
    if args.rollout_worker_threads is not None:
        return args.rollout_worker_threads
    return max(1, (os.cpu_count() or 2) // 2)


class _AheadCallback(TrainerCallback):
    """Pushes the weights to the rollout worker after every optimiser step; stops it when training ends (a stop
    signal included: the batches in flight are discarded, counted, and replayed by a resumed run)."""

    def __init__(self, ahead: GenerationAhead) -> None:
        self.ahead = ahead

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ahead.process is not None:
            self.ahead.push_weights(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        discarded = self.ahead.close()
        if discarded.total:
            logger.info("generation ahead: the %d batch(es) requested ahead of step %d are discarded: %s; a resumed "
                        "run plays them with its weights", discarded.total, state.global_step, discarded)  # fmt: skip


class UserErrorStop(TrainerCallback):
    """Stops training, with a checkpoint, after ``limit`` consecutive optimiser steps that had nothing but user
    errors (or when the run ends without a trained step): a dead user endpoint must not pass for a trained model.

    ``record`` is called once per optimiser step with the decision every rank shares (gathered episodes), so the
    stop is the same on every rank. ``stopped_at`` is set when it stopped the run; train_grpo.py then exits 1."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.streak = 0
        self.skipped = 0
        self.trained = 0
        self.stopped_at: int | None = None

    def record(self, skipped: bool) -> None:
        self.streak = self.streak + 1 if skipped else 0
        self.skipped += int(skipped)
        self.trained += int(not skipped)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.streak:
            return
        if self.streak >= self.limit or (state.global_step >= state.max_steps and not self.trained):
            self.stopped_at = state.global_step
            control.should_save = args.save_strategy != "no"
            control.should_training_stop = True

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None


REWARD_TERM_FIELDS = TERM_FIELDS


def reward_terms(reward: dict[str, Any], basis: tuple[str, ...]) -> dict[str, float]:
    """Whether each term of ``basis`` was met (1.0 / 0.0) by an episode's reward breakdown: the step line's and
    TensorBoard's ``reward_term/<TERM>`` (an episode that did not end properly meets none of them)."""
    rewardable = bool(reward.get("rewardable_termination"))
    return {term: float(rewardable and bool(reward.get(field))) for term, field in REWARD_TERM_FIELDS.items()
            if term in basis}  # fmt: skip


def _episode_summary(record: EpisodeRecord, prm: PRMResult) -> dict[str, Any]:
    """The per-episode facts reward functions and logs need (light: no messages)."""
    return {
        "task_id": record.task_id,
        "seed": record.seed,
        "termination": record.termination,
        "truncated": record.truncated,
        "num_turns": len(record.turns),
        "num_tool_calls": record.num_tool_calls,
        "num_tool_errors": record.num_tool_errors,
        "reward": record.reward,
        "prm": {"process_score": prm.process_score, "turn_scores": prm.turn_scores, "rule_counts": prm.rule_counts},
    }


def _turn_index(episodes: list[Episode], width: int, device: torch.device) -> torch.Tensor:
    """[B, C]: the policy turn each completion token belongs to, −1 for environment tokens and padding."""
    index = torch.full((len(episodes), width), -1, dtype=torch.long)
    for row, episode in enumerate(episodes):
        for k, (start, end) in enumerate(episode.agent_state.get("spans", [])):
            index[row, start : min(end, width)] = k
    return index.to(device)


def _pad_turn_scores(records: list[EpisodeRecord], prm: list[PRMResult], device: torch.device) -> torch.Tensor:
    width = max((len(r.turn_scores) for r in prm), default=0) or 1
    scores = torch.zeros((len(prm), width), dtype=torch.float32)
    for row, result in enumerate(prm):
        if result.turn_scores:
            scores[row, : len(result.turn_scores)] = torch.tensor(result.turn_scores, dtype=torch.float32)
    return scores.to(device)
