"""The embedded default policy model: a tiny random-weight Qwen2 with a tokenizer trained on τ² domain text.

Why this exists: tests and CPU smoke runs must work offline and hermetically, without downloading weights or a
tokenizer from the Hub. Instead of a hand-written toy, we build a model that is *shaped* like the real target,
Qwen2.5-7B-Instruct, so that every code path of a real run is exercised:

* a byte-level BPE tokenizer with Qwen2's pre-tokenizer, trained in well under a second on domain text (the policy,
  the tasks' user scenarios, a sample of database records and the caller's tool schemas), wrapped as transformers'
  ``Qwen2Tokenizer``;
* the same added tokens Qwen2.5 uses for chat and tool calling: ``<|endoftext|>`` (pad), ``<|im_start|>``,
  ``<|im_end|>`` (eos), all special, and ``<tool_call>`` / ``</tool_call>``, which are *not* special (as in Qwen2.5)
  so they survive ``decode(..., skip_special_tokens=True)``;
* the chat template of TRL's bundled ``qwen2_5.jinja``, byte for byte. TRL recognises templates by exact string
  equality (``trl.chat_template_utils.add_response_schema`` and ``get_training_chat_template``), so the tiny model gets
  exactly the tool-call parsing and training template a real Qwen2.5 run gets;
* a random-weight ``Qwen2ForCausalLM`` (64 hidden units, 2 layers by default), seeded, so builds are deterministic.

A real run swaps ``--model_name_or_path`` for ``Qwen/Qwen2.5-7B-Instruct`` and nothing else changes.

``build_tiny_model`` caches: a directory holding a complete build with the same parameters is reused as is. Builds go
to a temporary sibling directory that is renamed into place, so an interrupted build never leaves a directory that
looks complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from tau2_rl.data.build_cache import BUILD_INFO_FILE, cached_build

logger = logging.getLogger(__name__)

__all__ = [
    "BUILD_INFO_FILE",
    "EOS_TOKEN",
    "IM_START_TOKEN",
    "PAD_TOKEN",
    "TOOL_CALL_END_TOKEN",
    "TOOL_CALL_START_TOKEN",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "default_tiny_model_dir",
    "domain_corpus",
    "qwen2_5_chat_template",
]

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
TOOL_CALL_START_TOKEN = "<tool_call>"
TOOL_CALL_END_TOKEN = "</tool_call>"
# (content, special) in Qwen2.5's id order. Qwen2.5 marks the tool-call tags special=False.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (PAD_TOKEN, True),
    (IM_START_TOKEN, True),
    (EOS_TOKEN, True),
    (TOOL_CALL_START_TOKEN, False),
    (TOOL_CALL_END_TOKEN, False),
)

# Bump when the build recipe changes in a way that should invalidate cached builds.
BUILDER_VERSION = 1
DEFAULT_DIR_NAME = "tiny-qwen2"

# How many database records of each table of the corpus domain go into the tokenizer corpus (flights are large: one
# entry per date).
_DB_SAMPLE_SIZES = {"reservations": 1000, "users": 500, "flights": 60}
_CORPUS_SEED = 0
# Literal text of the Qwen2.5 chat template, so its fixed prompt compresses well.
_TEMPLATE_SNIPPETS = (
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>",
    "\n<tool_response>\n",
    "\n</tool_response>",
)


def qwen2_5_chat_template() -> str:
    """Return TRL's bundled ``qwen2_5.jinja`` exactly as TRL reads it (so TRL's equality checks match)."""
    return resources.files("trl").joinpath("chat_templates", "qwen2_5.jinja").read_text(encoding="utf-8")


def default_tiny_model_dir(outputs_dir: str | os.PathLike[str] = "outputs") -> Path:
    """Where the embedded default model lives by default: ``<outputs_dir>/tiny-qwen2``."""
    return Path(outputs_dir) / DEFAULT_DIR_NAME


def _string_leaves(value: Any) -> Iterator[str]:
    """Yield every non-empty string nested in a JSON value."""
    if isinstance(value, str):
        if value:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _string_leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _string_leaves(item)


def domain_corpus(extra_texts: Sequence[str] | None = None) -> list[str]:
    """Texts the tokenizer is trained on: policy, user scenarios, a fixed sample of DB records, template text, extras.

    The policy, scenarios and records are those of the domain the embedded default was first built on
    (``tau2_rl.domains.legacy_domain``), whatever the run's domain, so that one tokenizer serves every run; a run adds
    its own prompts and tool schemas as ``extra_texts``. The sample is deterministic (fixed seed over sorted keys), so
    the same inputs always give the same corpus.
    """
    from tau2_rl.domains import legacy_domain

    spec = legacy_domain()
    data = resources.files(spec.package).joinpath(spec.package_path)
    policy = data.joinpath("policy.md").read_text(encoding="utf-8")
    tasks = json.loads(data.joinpath("tasks.json").read_text(encoding="utf-8"))
    db = json.loads(data.joinpath("db.json").read_text(encoding="utf-8"))

    corpus = [policy, *_TEMPLATE_SNIPPETS]
    for task in tasks:
        corpus.extend(_string_leaves(task.get("user_scenario")))
    rng = random.Random(_CORPUS_SEED)
    for table, size in _DB_SAMPLE_SIZES.items():
        records = db[table]
        keys = sorted(records)
        for key in rng.sample(keys, min(size, len(keys))):
            corpus.append(json.dumps(records[key]))
    corpus.extend(extra_texts or ())
    return corpus


def build_tiny_tokenizer(
    vocab_size: int = 4096, extra_texts: Sequence[str] | None = None, model_max_length: int = 16384
) -> Qwen2Tokenizer:
    """Train a Qwen2-style byte-level BPE tokenizer on the domain corpus; ``len(tokenizer) <= vocab_size``.

    The vocabulary falls short of ``vocab_size`` only when the corpus runs out of merges (about 5,400 tokens). The
    added tokens come last, in Qwen2.5's order, and the chat template is TRL's ``qwen2_5.jinja``.
    """
    num_base = vocab_size - len(ADDED_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if num_base < len(alphabet):
        raise ValueError(f"vocab_size must be at least {len(alphabet) + len(ADDED_TOKENS)}, got {vocab_size}")

    # Same pipeline as transformers' Qwen2Tokenizer, which rebuilds it from vocab and merges when loading.
    backend = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = BpeTrainer(
        vocab_size=num_base,
        min_frequency=1,  # the corpus is small: let rare words fill the vocab rather than fall short of vocab_size
        initial_alphabet=alphabet,
        special_tokens=[],
        show_progress=False,
    )
    backend.train_from_iterator(domain_corpus(extra_texts), trainer=trainer)

    vocab = backend.get_vocab(with_added_tokens=False)
    merges = [
        tuple(m) if isinstance(m, list) else tuple(m.split(" "))
        for m in json.loads(backend.to_str())["model"]["merges"]
    ]
    added_tokens_decoder = {
        len(vocab) + i: AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False)
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, EOS_TOKEN],
        added_tokens_decoder=added_tokens_decoder,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        errors="replace",
    )
    tokenizer.chat_template = qwen2_5_chat_template()
    for content, _ in ADDED_TOKENS:
        ids = tokenizer.encode(content, add_special_tokens=False)
        if len(ids) != 1:  # pragma: no cover - guards against tokenizer-library behaviour changes
            raise RuntimeError(f"{content!r} should encode to one token, got {ids}")
    return tokenizer


def _build_model(
    tokenizer: Qwen2Tokenizer,
    *,
    hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int,
) -> Qwen2ForCausalLM:
    """A random-weight Qwen2 sized to the tokenizer; the global torch RNG state is left untouched."""
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_layers,
        use_sliding_window=False,
        tie_word_embeddings=True,
        # As in Qwen2.5: bos is <|endoftext|> in the config although the tokenizer adds no bos token.
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    return model.eval()


def _build_params(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int,
    extra_texts: Sequence[str] | None,
) -> dict[str, Any]:
    """Everything a build depends on; two builds with equal params are interchangeable."""
    extra = hashlib.sha256(json.dumps(list(extra_texts or ())).encode("utf-8")).hexdigest()
    template = hashlib.sha256(qwen2_5_chat_template().encode("utf-8")).hexdigest()
    return {
        "builder_version": BUILDER_VERSION,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "extra_texts_sha256": extra,
        "chat_template_sha256": template,
    }


def build_tiny_model(
    output_dir: str | os.PathLike[str],
    *,
    vocab_size: int = 4096,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 16384,
    seed: int = 0,
    extra_texts: Sequence[str] | None = None,
    force: bool = False,
) -> Path:
    """Build (or reuse) the tiny Qwen2 model and tokenizer in ``output_dir`` and return its path.

    A complete build with the same parameters is returned as is unless ``force``; otherwise the model is rebuilt in a
    temporary sibling directory that atomically replaces ``output_dir``. A non-empty ``output_dir`` that is not a
    build of this function is never overwritten unless ``force``. Concurrent callers are serialised by a lock file.
    """
    output_dir = Path(output_dir)
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_attention_heads}), "
            f"itself divisible by num_key_value_heads ({num_key_value_heads})"
        )
    shape = {  # what _build_model takes; the build params add the tokenizer's inputs and the versions
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
    }
    params = _build_params(vocab_size=vocab_size, extra_texts=extra_texts, **shape)

    def build(_work: Path, tmp_dir: Path) -> dict[str, Any]:
        tokenizer = build_tiny_tokenizer(vocab_size, extra_texts, model_max_length=max_position_embeddings)
        model = _build_model(tokenizer, **shape)
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        return {
            "params": params,
            "files": {p.name: p.stat().st_size for p in sorted(tmp_dir.iterdir()) if p.is_file()},
            "num_parameters": model.num_parameters(),
            "tokenizer_size": len(tokenizer),
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
            },
        }

    info = cached_build(output_dir, params, build, what="tiny-model", force=force)
    if info is None:
        logger.debug("Reusing tiny model in %s", output_dir)
        return output_dir
    logger.info(
        "Built tiny Qwen2 (%d parameters, %d tokens) in %s in %.2fs",
        info["num_parameters"],
        info["tokenizer_size"],
        output_dir,
        info["build_seconds"],
    )
    return output_dir
