"""Tests for the embedded default policy model (``tau2_rl.data.tiny_model``); offline, a few seconds on CPU."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import time
from pathlib import Path

import pytest
import torch
import trl
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM, Qwen2Tokenizer
from trl import chat_template_utils as ctu

from tau2_rl.data import tiny_model
from tau2_rl.data.tiny_model import (
    BUILD_INFO_FILE,
    EOS_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    TOOL_CALL_END_TOKEN,
    TOOL_CALL_START_TOKEN,
    build_tiny_model,
    default_tiny_model_dir,
)

VOCAB = 1024
TRL_QWEN2_5_TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_reservation_details",
            "description": "Get the details of a reservation.",
            "parameters": {
                "type": "object",
                "properties": {"reservation_id": {"type": "string", "description": "The reservation ID."}},
                "required": ["reservation_id"],
            },
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You are an airline agent."},
    {"role": "user", "content": "What is in reservation 4WQ150?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_reservation_details", "arguments": {"reservation_id": "4WQ150"}},
            }
        ],
    },
    {
        "role": "tool",
        "name": "get_reservation_details",
        "content": '{"reservation_id": "4WQ150", "cabin": "business"}',
    },
    {"role": "assistant", "content": "It is a business-class round trip from DFW to LAX."},
]


def _small_build(output_dir: Path, **kwargs) -> Path:
    return build_tiny_model(output_dir, vocab_size=VOCAB, **kwargs)


def _mtimes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _small_build(tmp_path_factory.mktemp("tiny") / "tiny-qwen2", extra_texts=[json.dumps(t) for t in TOOLS])


@pytest.fixture(scope="module")
def tokenizer(built: Path) -> Qwen2Tokenizer:
    return AutoTokenizer.from_pretrained(built)


@pytest.fixture(scope="module")
def model(built: Path) -> Qwen2ForCausalLM:
    return AutoModelForCausalLM.from_pretrained(built).eval()


def test_default_dir() -> None:
    assert default_tiny_model_dir() == Path("outputs") / "tiny-qwen2"
    assert default_tiny_model_dir("/tmp/runs") == Path("/tmp/runs/tiny-qwen2")


def test_reload_offline(built: Path, tokenizer: Qwen2Tokenizer, model: Qwen2ForCausalLM) -> None:
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", BUILD_INFO_FILE} <= names
    assert isinstance(tokenizer, Qwen2Tokenizer)
    assert isinstance(model, Qwen2ForCausalLM)
    assert len(tokenizer) == VOCAB

    config = model.config
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 128)
    assert config.max_position_embeddings == 16384
    assert config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (EOS_TOKEN, PAD_TOKEN, None)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (eos_id, pad_id)
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (eos_id, pad_id, pad_id)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (eos_id, pad_id)

    info = json.loads((built / BUILD_INFO_FILE).read_text())
    assert info["params"]["vocab_size"] == VOCAB
    assert info["tokenizer_size"] == VOCAB
    assert info["num_parameters"] == model.num_parameters()


def test_chat_template_is_trl_qwen2_5_byte_for_byte(built: Path, tokenizer: Qwen2Tokenizer) -> None:
    expected = TRL_QWEN2_5_TEMPLATE.read_text(encoding="utf-8")
    assert tokenizer.chat_template == expected
    assert tokenizer.chat_template == ctu.qwen2_5_chat_template
    saved = built / "chat_template.jinja"
    if saved.exists():  # transformers 5 stores the template in its own file
        assert saved.read_bytes() == TRL_QWEN2_5_TEMPLATE.read_bytes()


def test_special_tokens_are_single_ids(tokenizer: Qwen2Tokenizer) -> None:
    added = {token.content: (token_id, token.special) for token_id, token in tokenizer.added_tokens_decoder.items()}
    expected_special = {PAD_TOKEN: True, IM_START_TOKEN: True, EOS_TOKEN: True}
    expected_special |= {TOOL_CALL_START_TOKEN: False, TOOL_CALL_END_TOKEN: False}
    assert {content: special for content, (_, special) in added.items()} == expected_special
    # Qwen2.5's order: the added tokens come right after the BPE vocabulary.
    assert [added[t][0] for t in expected_special] == list(range(VOCAB - 5, VOCAB))
    for content, (token_id, _) in added.items():
        assert tokenizer.encode(content, add_special_tokens=False) == [token_id]
        assert tokenizer.encode(f"x{content}y", add_special_tokens=False).count(token_id) == 1

    text = f'{TOOL_CALL_START_TOKEN}\n{{"name": "x", "arguments": {{}}}}\n{TOOL_CALL_END_TOKEN}{EOS_TOKEN}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Tool-call tags are not special (as in Qwen2.5), so they survive skip_special_tokens; <|im_end|> does not.
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.removesuffix(EOS_TOKEN)
    assert tokenizer.decode(ids) == text


def test_tool_conversation_renders_and_tokenizes(tokenizer: Qwen2Tokenizer) -> None:
    text = tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are an airline agent.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert (
        '<tool_call>\n{"name": "get_reservation_details", "arguments": {"reservation_id": "4WQ150"}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n" in text
    assert text.endswith("<|im_start|>assistant\nIt is a business-class round trip from DFW to LAX.<|im_end|>\n")

    ids = tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=True, return_dict=False)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # lossless round trip
    # Two <tool_call> tags in the system prompt's tool instructions plus one for the call, each a single token.
    assert ids.count(tokenizer.convert_tokens_to_ids(TOOL_CALL_START_TOKEN)) == text.count(TOOL_CALL_START_TOKEN) == 3
    assert ids.count(tokenizer.convert_tokens_to_ids(TOOL_CALL_END_TOKEN)) == text.count(TOOL_CALL_END_TOKEN) == 3
    assert ids.count(tokenizer.convert_tokens_to_ids(EOS_TOKEN)) == 5
    # Trained on domain text and the tool schemas, even a 1024-token vocabulary averages over two characters a token.
    assert len(ids) < len(text) / 2


def test_generate(tokenizer: Qwen2Tokenizer, model: Qwen2ForCausalLM) -> None:
    inputs = tokenizer.apply_chat_template(
        TOOL_CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    prompt_len = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        logits = model(**inputs).logits
    assert out.shape == (1, prompt_len + 8)
    assert torch.equal(out[:, :prompt_len], inputs["input_ids"])
    assert int(out.max()) < len(tokenizer)
    assert logits.shape == (1, prompt_len, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_trl_recognises_qwen2_5_template(tokenizer: Qwen2Tokenizer) -> None:
    # GRPOTrainer's checks for tool training (trl/trainer/grpo_trainer.py), in order.
    assert ctu.supports_tool_calling(tokenizer)
    assert ctu.is_chat_template_prefix_preserving(tokenizer)
    assert ctu.get_training_chat_template(tokenizer) == ctu.qwen2_5_training_chat_template
    assert ctu.is_chat_template_stop_token_trained(tokenizer, chat_template=ctu.qwen2_5_training_chat_template)

    parser_tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    assert ctu.add_response_schema(parser_tokenizer) is parser_tokenizer  # raises on an unrecognised template
    assert parser_tokenizer.response_template is ctu.qwen3_template  # what TRL uses for the Qwen2.5 template

    # Parse a completion the way GRPOTrainer does: generated ids, with the prompt ids as prefix.
    prompt_ids = parser_tokenizer.apply_chat_template(
        TOOL_CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    completion = (
        '<tool_call>\n{"name": "get_reservation_details", "arguments": {"reservation_id": "4WQ150"}}\n'
        "</tool_call><|im_end|>"
    )
    completion_ids = parser_tokenizer.encode(completion, add_special_tokens=False)
    parsed = ctu.parse_response(parser_tokenizer, completion_ids, prefix=prompt_ids, tools=TOOLS)
    assert parsed["content"] == ""
    assert parsed["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "get_reservation_details", "arguments": {"reservation_id": "4WQ150"}},
        }
    ]
    text_ids = parser_tokenizer.encode("Your reservation is confirmed.<|im_end|>", add_special_tokens=False)
    parsed = ctu.parse_response(parser_tokenizer, text_ids, prefix=prompt_ids, tools=TOOLS)
    assert parsed == {"role": "assistant", "content": "Your reservation is confirmed."}


def test_second_call_hits_cache(built: Path) -> None:
    before = _mtimes(built)
    start = time.perf_counter()
    assert _small_build(built, extra_texts=[json.dumps(t) for t in TOOLS]) == built
    assert time.perf_counter() - start < 1.0  # a hit reads one small JSON file; a build takes ~0.5 s or more
    assert _mtimes(built) == before


def test_build_is_deterministic(tmp_path: Path, built: Path) -> None:
    other = _small_build(tmp_path / "again", extra_texts=[json.dumps(t) for t in TOOLS])
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (other / name).read_bytes() == (built / name).read_bytes(), name


def test_changed_params_rebuild(tmp_path: Path) -> None:
    out = _small_build(tmp_path / "m")
    weights = (out / "model.safetensors").read_bytes()
    tokenizer_json = (out / "tokenizer.json").read_bytes()

    _small_build(tmp_path / "m", seed=1)
    assert json.loads((out / BUILD_INFO_FILE).read_text())["params"]["seed"] == 1
    assert (out / "model.safetensors").read_bytes() != weights
    assert (out / "tokenizer.json").read_bytes() == tokenizer_json  # the seed only affects the weights

    _small_build(tmp_path / "m", seed=1, hidden_size=32, num_layers=1)
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (32, 1)

    # Extra texts (the tool schemas) go into the tokenizer's corpus: a made-up word repeated there gets merged.
    word = "Frobnicate"
    without = len(AutoTokenizer.from_pretrained(out).encode(word))
    _small_build(tmp_path / "m", seed=1, hidden_size=32, num_layers=1, extra_texts=[f"{word} " * 100])
    assert len(AutoTokenizer.from_pretrained(out).encode(word)) < without

    before = _mtimes(out)
    _small_build(tmp_path / "m", seed=1, hidden_size=32, num_layers=1, extra_texts=[f"{word} " * 100], force=True)
    assert _mtimes(out) != before


def test_incomplete_build_is_rebuilt(tmp_path: Path) -> None:
    out = _small_build(tmp_path / "m")
    (out / "model.safetensors").unlink()
    _small_build(tmp_path / "m")
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == VOCAB


def test_interrupted_build_leaves_previous_build_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_model.Qwen2Tokenizer, "save_pretrained", boom)  # model already written by then
    with pytest.raises(KeyboardInterrupt):
        _small_build(tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    monkeypatch.undo()

    out = _small_build(tmp_path / "m")
    info = (out / BUILD_INFO_FILE).read_text()
    monkeypatch.setattr(tiny_model.Qwen2Tokenizer, "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        _small_build(tmp_path / "m", seed=1)
    assert (out / BUILD_INFO_FILE).read_text() == info
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == VOCAB
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_refuses_to_overwrite_foreign_directory(tmp_path: Path) -> None:
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        _small_build(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    _small_build(foreign, force=True)
    assert not (foreign / "notes.txt").exists()
    assert (foreign / "config.json").is_file()
