"""The system prompt a policy was trained with travels with its weights (tau2_rl/envs/prompt_style.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_evaluate import env, load, tiny_args, tiny_model  # noqa: F401 (fixtures)

from tau2_rl.domains import get_domain
from tau2_rl.envs.episode import DomainEnv
from tau2_rl.envs.prompt_style import (
    PROMPT_STYLE_FILE,
    compact_env,
    read_prompt_style,
    use_compact_prompt,
    write_prompt_style,
)
from tau2_rl.evaluation import EvaluationError, run_evaluation
from tau2_rl.evaluation import evaluator as evaluator_module
from tau2_rl.evaluation.results import ConfigMismatchError

AIRLINE = get_domain("airline")
COMPACT_SYSTEM_PROMPT = AIRLINE.compact_prompt


def test_recorded_style_round_trips_and_the_flag_wins(tmp_path: Path) -> None:
    assert read_prompt_style(tmp_path) is None and read_prompt_style(None) is None
    assert use_compact_prompt(None, tmp_path) is False and use_compact_prompt(None, tmp_path, default=True) is True
    write_prompt_style(tmp_path, compact=True, specs=[AIRLINE])
    assert json.loads((tmp_path / PROMPT_STYLE_FILE).read_text()) == {"system_prompt": "compact",
                                                                      "text": COMPACT_SYSTEM_PROMPT,
                                                                      "domains": ["airline"]}  # fmt: skip
    assert use_compact_prompt(None, tmp_path) is True and use_compact_prompt(False, tmp_path) is False
    write_prompt_style(tmp_path, compact=False, specs=[AIRLINE])
    assert read_prompt_style(tmp_path) == "full" and use_compact_prompt(None, tmp_path, default=True) is False
    (tmp_path / PROMPT_STYLE_FILE).write_text('{"system_prompt": "short"}')
    with pytest.raises(ValueError, match=f"{PROMPT_STYLE_FILE}: system_prompt must be 'compact' or 'full'"):
        read_prompt_style(tmp_path)
    (tmp_path / PROMPT_STYLE_FILE).write_text("{")
    with pytest.raises(ValueError, match="unreadable.*--compact_prompt"):
        read_prompt_style(tmp_path)


def test_compact_env_keeps_the_tools_running() -> None:
    compact = compact_env(DomainEnv(AIRLINE))
    assert compact.system_prompt == COMPACT_SYSTEM_PROMPT and compact.tools == []
    episode = compact.reset("0")
    assert episode.messages[0]["content"] == COMPACT_SYSTEM_PROMPT
    episode.user_response("Hi")
    results = episode.env_response(
        '<tool_call>{"name": "get_user_details", "arguments": {"user_id": "emma_kim_9957"}}</tool_call>'
    )
    assert results and "emma_kim_9957" in results[0]["content"]


def test_evaluate_prompts_a_model_as_its_directory_records(
    tmp_path: Path,
    tiny_model: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts: list[tuple[str, int]] = []  # (system prompt, number of tool schemas) of each run_episodes call
    real = evaluator_module.run_episodes

    def spy(airline_env, agent, *args, **kwargs):
        prompts.append((airline_env.system_prompt, len(airline_env.tools)))  # what its episodes show the agent
        return real(airline_env, agent, *args, **kwargs)

    monkeypatch.setattr(evaluator_module, "run_episodes", spy)
    model = tmp_path / "compact-model"
    shutil.copytree(tiny_model, model)
    write_prompt_style(model, compact=True, specs=[AIRLINE])
    (path,) = run_evaluation(tiny_args(tmp_path / "eval", model, tasks="0", num_samples=1))
    assert load(path)["config"]["system_prompt"] == "compact"
    assert prompts == [(COMPACT_SYSTEM_PROMPT, 0)]

    # the flag overrides the record, and a file of the other prompt is not resumed
    with pytest.raises(ConfigMismatchError, match="system_prompt: file has 'compact', this run has 'full'"):
        run_evaluation(tiny_args(tmp_path / "eval", model, tasks="0", num_samples=1, compact_prompt=False))

    # a plain checkpoint (no record) gets the full prompt and the 14 tool schemas
    (path,) = run_evaluation(tiny_args(tmp_path / "eval2", tiny_model, tasks="0", num_samples=1))
    assert load(path)["config"]["system_prompt"] == "full"
    assert prompts[-1][0] != COMPACT_SYSTEM_PROMPT and prompts[-1][1] == 14


def test_revisions_trained_with_different_prompts_are_not_evaluated_together(tmp_path: Path, tiny_model: Path) -> None:  # noqa: F811
    run = tmp_path / "hub" / "mixed"
    for step in (1, 2):
        shutil.copytree(tiny_model, run / f"step-{step:06d}")
    write_prompt_style(run / "step-000002", compact=True, specs=[AIRLINE])
    (run / "refs.json").write_text(json.dumps({"main": "step-000002",
                                               "revisions": {"step-000001": 1, "step-000002": 2}}))  # fmt: skip
    with pytest.raises(EvaluationError, match="different system prompts"):
        run_evaluation(tiny_args(tmp_path / "eval", "mixed", steps="1,2", tasks="0", num_samples=1,
                                 hub_dir=str(tmp_path / "hub")))  # fmt: skip


def test_files_written_before_the_package_rename_are_read_as_todays(tmp_path: Path) -> None:
    """The package (and with it the training protocol's name and the prompt file's) was ``airline_rl``: a model
    directory, a results.json and a τ² export written then still resume, compare and load."""
    import evaluate
    from tau2_rl.envs.prompt_style import LEGACY_PROMPT_STYLE_FILE
    from tau2_rl.evaluation.results import config_differences

    (tmp_path / LEGACY_PROMPT_STYLE_FILE).write_text('{"system_prompt": "compact"}')
    assert read_prompt_style(tmp_path) == "compact"
    write_prompt_style(tmp_path, compact=False, specs=[AIRLINE])  # today's file wins over the old one
    assert read_prompt_style(tmp_path) == "full"

    assert config_differences({"protocol": "airline_rl"}, {"protocol": "tau2_rl"}) == []
    assert config_differences({}, {"protocol": "tau2_rl"}) == []  # before the protocol was recorded at all
    assert config_differences({"protocol": "airline_rl"}, {"protocol": "tau2"}) == [
        "protocol: file has 'tau2_rl', this run has 'tau2'"
    ]

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"metrics": {"valid_episodes": 1, "episodes": 1}}))
    rejected = {"task_id": "3", "sample": 0, "error": "bad message"}
    (tmp_path / evaluate.TAU2_INCOMPLETE_FILE).write_text(json.dumps({"airline_rl": {"rejected": [rejected]}}))
    assert "rejected 1 conversation(s): task 3 sample 0 (bad message)" in evaluate.unfinished(results)
