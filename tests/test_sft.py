"""SFT on teacher trajectories: data preparation and its errors, ``train_sft.py`` end to end, and (slow) proof that it
learns. The fast tests train a tiny model for two steps on short conversations; the slow ones use the real oracle
trajectories with their ~4.4k-token system prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

import train_grpo
import train_sft
from tau2_rl.configs import CollectArguments
from tau2_rl.data.collect import collect, decode_rows, load_trajectories, rows_to_dataset
from tau2_rl.data.tiny_model import build_tiny_model, qwen2_5_chat_template
from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import DomainEnv
from tau2_rl.envs.splits import get_split
from tau2_rl.render import assistant_mask_rows
from tau2_rl.run.hub import read_refs, resolve_model
from tau2_rl.trainers.sft import SFTDataError, prepare_sft_dataset, teacher_forced_accuracy, trainer_columns

AIRLINE = get_domain("airline")

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_user_details",
            "description": "Get the details of a user.",
            "parameters": {"type": "object", "properties": {"user_id": {"type": "string"}}, "required": ["user_id"]},
        },
    }
]


def conversation(user_id: str, extra_turns: int = 0) -> list[dict]:
    call = {"type": "function", "function": {"name": "get_user_details", "arguments": {"user_id": user_id}}}
    messages = [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "assistant", "content": "Hi! How can I help you today?"},
        {"role": "user", "content": f"My user id is {user_id}."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {
            "role": "tool",
            "name": "get_user_details",
            "content": json.dumps({"user_id": user_id, "membership": "gold"}),
        },
        {"role": "assistant", "content": "You are a gold member."},
    ]
    for k in range(extra_turns):
        messages += [{"role": "user", "content": f"And {k}?"}, {"role": "assistant", "content": f"Answer {k}."}]
    return messages


def row(task_id: str, messages: list[dict], reward: float = 1.0) -> dict:
    return {"task_id": task_id, "attempt": 0, "seed": 0, "messages": messages, "tools": TOOLS, "reward": reward}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", vocab_size=1024)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def short_dataset():
    rows = [row("1", conversation("mia_li_3668")), row("3", conversation("raj_sanchez_7340", extra_turns=3))]
    return rows_to_dataset(rows)


# ------------------------------------------------------------------------------------------------ preparation


def test_prepared_rows_are_the_render_twice_diff_masks(tokenizer, short_dataset) -> None:
    dataset, report = prepare_sft_dataset(short_dataset, tokenizer)
    assert report.conversations == 2 and report.rows == 2 and report.tasks == ["1", "3"]
    for example, source in zip(dataset, decode_rows(short_dataset), strict=True):
        expected = assistant_mask_rows(tokenizer, source["messages"], source["tools"]).rows[0]
        assert example["input_ids"] == expected.input_ids and example["assistant_masks"] == expected.assistant_masks
    assert report.assistant_tokens == sum(sum(m) for m in dataset["assistant_masks"])


def test_trl_builds_labels_from_the_assistant_masks(model_dir, tokenizer, short_dataset, tmp_path) -> None:
    dataset, _ = prepare_sft_dataset(short_dataset, tokenizer)
    args = SFTConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_length=None)
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=trainer_columns(dataset),
        processing_class=tokenizer,
    )
    for prepared, ours in zip(trainer.train_dataset, dataset, strict=True):
        assert prepared["input_ids"] == ours["input_ids"]
        assert prepared["labels"] == [
            t if m else -100 for t, m in zip(ours["input_ids"], ours["assistant_masks"], strict=True)
        ]


def test_truncation_is_reported(tokenizer, short_dataset, caplog) -> None:
    full, _ = prepare_sft_dataset(short_dataset, tokenizer)
    lengths = [len(ids) for ids in full["input_ids"]]
    first_mask = full["assistant_masks"][0].index(1)
    cut = max(min(lengths) - 1, first_mask + 1)  # both cut, both keep an assistant token
    dataset, report = prepare_sft_dataset(short_dataset, tokenizer, max_length=cut)
    assert report.truncated == 2 and report.dropped_fully_masked == 0 and max(map(len, dataset["input_ids"])) == cut
    assert "truncated 2 of 2 examples" in report.summary()
    # keep_start with a limit inside the first context: the examples keep no assistant token and are dropped
    with pytest.raises(SFTDataError, match="raise --max_length"):
        prepare_sft_dataset(short_dataset, tokenizer, max_length=first_mask)
    dataset, report = prepare_sft_dataset(short_dataset, tokenizer, max_length=20, truncation_mode="keep_end")
    assert report.truncated == 2 and all(len(ids) == 20 for ids in dataset["input_ids"])


# ------------------------------------------------------------------------------------------------ bad input


def test_missing_columns_are_named(tokenizer) -> None:
    dataset = rows_to_dataset([row("1", conversation("a_1"))]).remove_columns(["tools", "messages"])
    with pytest.raises(SFTDataError, match=r"lacks the required column\(s\) \['messages', 'tools'\]"):
        prepare_sft_dataset(dataset, tokenizer)


@pytest.mark.parametrize(
    ("tool_call", "error"),
    [
        ({"type": "function", "function": {"arguments": {}}}, "malformed tool call 0: the function has no name"),
        (
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}},
            r"malformed tool call 0 \(f\): .*JSON",
        ),
        (
            {"type": "function", "function": {"name": "f", "arguments": [1]}},
            r"malformed tool call 0 \(f\): arguments must be",
        ),
        ({"name": "f"}, "malformed tool call 0: expected"),
    ],
)
def test_malformed_tool_call_names_the_row(tokenizer, tool_call, error) -> None:
    bad = conversation("b_2")
    bad[3] = {"role": "assistant", "content": "", "tool_calls": [tool_call]}
    dataset = rows_to_dataset([row("1", conversation("a_1")), row("3", bad)])
    with pytest.raises(SFTDataError, match=rf"row 1 \(task 3\), message 3: {error}"):
        prepare_sft_dataset(dataset, tokenizer)


def test_raw_tool_call_text_is_malformed(tokenizer) -> None:
    bad = conversation("b_2")
    bad[3] = {
        "role": "assistant",
        "content": '<tool_call>{"name": "get_user_details", "arguments": {oops}</tool_call>',
    }
    with pytest.raises(SFTDataError, match=r"row 0 \(task 3\), message 3: assistant turn with a malformed tool call"):
        prepare_sft_dataset(rows_to_dataset([row("3", bad)]), tokenizer)


def test_arguments_as_json_string_are_accepted(tokenizer) -> None:
    messages = conversation("a_1")
    function = messages[3]["tool_calls"][0]["function"]
    as_string = conversation("a_1")
    as_string[3]["tool_calls"][0]["function"] = {**function, "arguments": json.dumps(function["arguments"])}
    ours, _ = prepare_sft_dataset(rows_to_dataset([row("1", as_string)]), tokenizer)
    expected, _ = prepare_sft_dataset(rows_to_dataset([row("1", messages)]), tokenizer)
    assert ours["input_ids"] == expected["input_ids"]


def test_empty_after_filtering_names_the_flags(tokenizer, short_dataset) -> None:
    with pytest.raises(SFTDataError, match=r"empty after filtering .*--tasks: 2"):
        prepare_sft_dataset(short_dataset, tokenizer, tasks=["42"])
    low = rows_to_dataset([row("1", conversation("a_1"), reward=0.0)])
    with pytest.raises(SFTDataError, match=r"--min_reward 1.0: 1"):
        prepare_sft_dataset(low, tokenizer)


def test_test_tasks_need_the_force_flag(tokenizer) -> None:
    split = get_split("seed", AIRLINE.split_file())
    test_task = split.test[0]
    dataset = rows_to_dataset([row("1", conversation("a_1")), row(test_task, conversation("b_2"))])
    with pytest.raises(SFTDataError, match=rf"test tasks \['{test_task}'\] .*row 1.*--allow_test_tasks"):
        prepare_sft_dataset(dataset, tokenizer, split=split)
    _, report = prepare_sft_dataset(dataset, tokenizer, split=split, allow_test_tasks=True)
    assert report.rows == 2
    _, report = prepare_sft_dataset(dataset, tokenizer, split=split, tasks=["1"])  # selecting train tasks is fine
    assert report.tasks == ["1"]


def test_conversation_without_a_trained_turn(tokenizer) -> None:
    messages = conversation("a_1")[:3]
    with pytest.raises(SFTDataError, match=r"row 0 \(task 1\): no assistant turn after a user message"):
        prepare_sft_dataset(rows_to_dataset([row("1", messages)]), tokenizer)


# ------------------------------------------------------------------------------------------------ train_sft.py


def run_train_sft(tmp_path: Path, model_dir: Path, dataset_path: Path, *extra: str) -> dict:
    argv = [
        "--config", str(REPO_ROOT / "recipes" / "sft" / "cpu_smoke.yaml"),
        "--model_name_or_path", str(model_dir),
        "--dataset_path", str(dataset_path),
        "--output_dir", str(tmp_path / "sft"),
        "--hub_dir", str(tmp_path / "hub"),
        "--run_name", "sft-test",
        "--max_steps", "2",
        "--gradient_accumulation_steps", "1",
        "--report_to", "none",
        "--save_strategy", "no",
        "--disable_tqdm", "true",
        *extra,
    ]  # fmt: skip
    script_args, training_args, model_args = train_sft.make_parser().parse_args_and_config(args=argv)
    return train_sft.main(script_args, training_args, model_args)


def test_train_sft_saves_a_model_grpo_can_start_from(tmp_path, model_dir, short_dataset, capsys) -> None:
    short_dataset.save_to_disk(str(tmp_path / "data"))
    lengths = [len(r.input_ids) for r in (assistant_mask_rows_for(model_dir, short_dataset))]
    outcome = run_train_sft(tmp_path, model_dir, tmp_path / "data", "--max_length", str(min(lengths) + 5))
    last = capsys.readouterr().out.strip().splitlines()[-1]  # the run ends with one summary line, as train_grpo's
    assert last.startswith("done: 2 steps in ") and " | loss " in last and "first → last quarter" in last, last
    assert f"hub revision {tmp_path / 'hub' / 'sft-test' / 'step-000002'}" in last and "plot_run" not in last
    report = json.loads((tmp_path / "sft" / "sft_data_report.json").read_text())
    assert report["truncated"] == 1 and outcome["report"]["rows"] == 2
    hub_path = Path(outcome["hub_path"])
    assert hub_path == tmp_path / "hub" / "sft-test" / "step-000002"
    assert (
        read_refs(hub_path.parent)["main"] == "step-000002" and resolve_model("sft-test", tmp_path / "hub") == hub_path
    )
    assert "truncated 1 of 2 examples" in (hub_path / "README.md").read_text()
    for directory in (tmp_path / "sft", hub_path):
        model = AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        assert tokenizer.chat_template == qwen2_5_chat_template()  # TRL still recognises the template
        assert not torch.equal(
            model.model.embed_tokens.weight, AutoModelForCausalLM.from_pretrained(model_dir).model.embed_tokens.weight
        )
    # train_grpo.py takes the SFT output as its --model_name_or_path.
    grpo_args = ["--config", str(REPO_ROOT / "recipes" / "grpo" / "cpu_smoke.yaml"), "--model_name_or_path",
                 str(tmp_path / "sft"), "--output_dir", str(tmp_path / "grpo")]  # fmt: skip
    script_args, training_args, model_args = train_grpo.make_parser().parse_args_and_config(args=grpo_args)
    env = DomainEnv(AIRLINE)
    assert train_grpo.resolve_model_path(model_args, script_args, training_args.output_dir, env) == str(
        tmp_path / "sft"
    )


def assistant_mask_rows_for(model_dir: Path, dataset) -> list:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [assistant_mask_rows(tokenizer, r["messages"], r["tools"]).rows[0] for r in decode_rows(dataset)]


def test_train_sft_with_lora_saves_the_merged_model(tmp_path, model_dir, short_dataset) -> None:
    short_dataset.save_to_disk(str(tmp_path / "data"))
    run_train_sft(
        tmp_path, model_dir, tmp_path / "data", "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8",
        "--lora_target_modules", "q_proj", "v_proj", "--learning_rate", "0.05", "--max_length", "1024",
    )  # fmt: skip
    out = tmp_path / "sft"
    assert (out / "adapter" / "adapter_config.json").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    names = dict(merged.named_parameters()).keys()
    assert names == dict(base.named_parameters()).keys()  # a plain model, no LoRA layers
    changed = [n for n, p in merged.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)
    assert (tmp_path / "hub" / "sft-test" / "step-000002" / "model.safetensors").is_file()


def test_train_sft_refuses_test_tasks(tmp_path, model_dir) -> None:
    test_task = get_split("seed", AIRLINE.split_file()).test[0]
    rows_to_dataset([row(test_task, conversation("a_1"))]).save_to_disk(str(tmp_path / "data"))
    with pytest.raises(SFTDataError, match="--allow_test_tasks"):
        run_train_sft(tmp_path, model_dir, tmp_path / "data")


def test_teacher_forced_accuracy_counts_assistant_tokens(model_dir, tokenizer, short_dataset) -> None:
    dataset, report = prepare_sft_dataset(short_dataset, tokenizer)
    result = teacher_forced_accuracy(AutoModelForCausalLM.from_pretrained(model_dir), dataset)
    assert result["tokens"] == sum(sum(mask[1:]) for mask in dataset["assistant_masks"])
    assert 0.0 <= result["accuracy"] <= 0.05  # a random model


# ------------------------------------------------------------------------------------------------ slow


@pytest.mark.slow
def test_sft_learns(tmp_path) -> None:
    """Oracle trajectories of two covered tasks, tiny model: teacher-forced accuracy on the assistant tokens rises far
    above its value before training, and greedy rollouts reproduce the first gold tool call (benchmarks/sft_learning.py
    prints the full report)."""
    from benchmarks.sft_learning import run

    result = run(workdir=str(tmp_path))
    assert result["accuracy_before"] < 0.1
    assert result["accuracy_after"] > 0.9
    assert result["first_gold_call_reproduced"] >= 1, result["rollouts"]


@pytest.mark.slow
def test_embedded_default_recipe(tmp_path, monkeypatch) -> None:
    """``train_sft.py --config recipes/sft/cpu_smoke.yaml``: tiny model + oracle trajectories of all covered tasks."""
    monkeypatch.chdir(tmp_path)
    argv = ["--config", str(REPO_ROOT / "recipes" / "sft" / "cpu_smoke.yaml"), "--num_train_epochs", "1",
            "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip
    script_args, training_args, model_args = train_sft.make_parser().parse_args_and_config(args=argv)
    outcome = train_sft.main(script_args, training_args, model_args)
    split = get_split("seed", AIRLINE.split_file())
    assert outcome["report"]["tasks"] == list(split.covered)
    assert outcome["report"]["truncated"] == 1  # task 39 is longer than max_length 8192
    assert Path(outcome["hub_path"]).is_dir() and (tmp_path / "hub" / "datasets" / "oracle-seed").is_dir()
    assert load_trajectories("oracle-seed", hub_dir=tmp_path / "hub").num_rows == len(split.covered)
    AutoModelForCausalLM.from_pretrained(tmp_path / "outputs" / "sft-cpu-smoke")
    assert collect(CollectArguments(hub_dir=str(tmp_path / "hub"), progress=False)).played == 0  # cached, resumed
