"""The local hub is guarded like ``output_dir``: a revision records the run that wrote it, and another run (another
output_dir under the same ``run_name``, which the recipes fix) is refused before it could replace it (issue 23.1:
``--output_dir outputs/det-b --run_name det-a`` silently replaced ``hub/det-a/step-000002``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run_guard import grpo_argv
from test_sft import model_dir, short_dataset  # noqa: F401 (fixtures)

import train_grpo
import train_sft
from tau2_rl.configs import CollectArguments
from tau2_rl.data.collect import collect
from tau2_rl.run.hub import HubError, claim_hub_run, read_refs, record_revision, writer_id

REPO_ROOT = Path(__file__).resolve().parent.parent


def fake_revision(hub: Path, run_name: str, step: int, output_dir: Path | None) -> Path:
    """A revision as an export leaves it (directory + refs.json entry), written by ``output_dir``."""
    run_dir = hub / run_name
    (run_dir / f"step-{step:06d}").mkdir(parents=True)
    record_revision(run_dir, f"step-{step:06d}", step, output_dir)
    return run_dir


def test_a_revision_records_its_writer_relative_to_the_hub_run(tmp_path: Path) -> None:
    run_dir = fake_revision(tmp_path / "hub", "det-a", 2, tmp_path / "outputs" / "det-a")
    refs = read_refs(run_dir)
    assert refs["written_by"] == {"step-000002": "../../outputs/det-a"} and refs["main"] == "step-000002"
    claim_hub_run(tmp_path / "hub", "det-a", tmp_path / "outputs" / "det-a")  # the same run: accepted
    claim_hub_run(tmp_path / "hub", "det-b", tmp_path / "outputs" / "det-b")  # an empty hub run: accepted
    with pytest.raises(HubError) as err:
        claim_hub_run(tmp_path / "hub", "det-a", tmp_path / "outputs" / "det-b")
    message = str(err.value)
    assert "step-000002 holds the export of another run" in message and "outputs/det-a" in message
    assert "--output_dir " + str(tmp_path / "outputs" / "det-b") in message
    assert "--run_name" in message and "--overwrite_hub true" in message and "\n" not in message
    claim_hub_run(tmp_path / "hub", "det-a", tmp_path / "outputs" / "det-b", overwrite=True)


def test_a_revision_of_unknown_origin_is_refused_too(tmp_path: Path) -> None:
    fake_revision(tmp_path / "hub", "old", 4, None)
    with pytest.raises(HubError, match="a run that did not record its output_dir"):
        claim_hub_run(tmp_path / "hub", "old", tmp_path / "outputs" / "old")


def test_the_writer_survives_moving_the_whole_tree(tmp_path: Path) -> None:
    fake_revision(tmp_path / "a" / "hub", "r", 1, tmp_path / "a" / "outputs" / "r")
    (tmp_path / "a").rename(tmp_path / "b")
    claim_hub_run(tmp_path / "b" / "hub", "r", tmp_path / "b" / "outputs" / "r")
    assert writer_id(tmp_path / "b" / "outputs" / "r", tmp_path / "b" / "hub" / "r") == "../../outputs/r"


def test_train_grpo_refuses_another_runs_hub_revision_before_training(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    """The issue's command: a run into another output_dir under the run_name of an earlier run."""
    hub = tmp_path / "hub"
    fake_revision(hub, "det-a", 2, tmp_path / "det-a")
    argv = grpo_argv(model_dir, tmp_path / "det-b", hub, "--run_name", "det-a")
    with pytest.raises(SystemExit, match=r"^error: .*det-a/step-000002 holds the export of another run .*det-a"):
        train_grpo.main(*train_grpo.parse_args(argv))
    assert not (tmp_path / "det-b" / "run_config.json").exists()  # refused before the output dir was claimed
    assert read_refs(hub / "det-a")["written_by"]["step-000002"] == writer_id(tmp_path / "det-a", hub / "det-a")


def sft_argv(model: Path, data: Path, output_dir: Path, hub: Path, *extra: str) -> list[str]:
    return [
        "--config", str(REPO_ROOT / "recipes" / "sft" / "cpu_smoke.yaml"), "--model_name_or_path", str(model),
        "--dataset_path", str(data), "--output_dir", str(output_dir), "--hub_dir", str(hub), "--run_name", "sft",
        "--max_steps", "1", "--gradient_accumulation_steps", "1", "--report_to", "none", "--save_strategy", "no",
        "--disable_tqdm", "true", "--max_length", "1024", *extra,
    ]  # fmt: skip


def test_train_sft_records_its_export_and_refuses_another_runs(tmp_path: Path, model_dir, short_dataset) -> None:  # noqa: F811
    short_dataset.save_to_disk(str(tmp_path / "data"))
    hub = tmp_path / "hub"
    first = train_sft.main(*train_sft.make_parser().parse_args_and_config(sft_argv(model_dir, tmp_path / "data",
                                                                                   tmp_path / "a", hub)))  # fmt: skip
    assert Path(first["hub_path"]).is_dir()
    assert read_refs(hub / "sft")["written_by"] == {"step-000001": writer_id(tmp_path / "a", hub / "sft")}
    before = (Path(first["hub_path"]) / "model.safetensors").stat().st_mtime_ns
    argv = sft_argv(model_dir, tmp_path / "data", tmp_path / "b", hub)
    with pytest.raises(HubError, match=r"sft/step-000001 holds the export of another run \(.*a\)"):
        train_sft.main(*train_sft.make_parser().parse_args_and_config(argv))
    assert (Path(first["hub_path"]) / "model.safetensors").stat().st_mtime_ns == before


def test_collect_refuses_a_hub_dataset_of_another_collection(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    common = {"hub_dir": str(hub), "progress": False, "tasks": "27", "dataset_name": "oracle"}
    first = collect(CollectArguments(output_dir=str(tmp_path / "a"), **common))
    info = json.loads((Path(first.hub_path) / "collect_info.json").read_text())
    assert info["written_by"] == writer_id(tmp_path / "a", first.hub_path)
    collect(CollectArguments(output_dir=str(tmp_path / "a"), **common))  # the same collection again: fine
    with pytest.raises(HubError, match=r"datasets/oracle holds the export of another run .*--dataset_name"):
        collect(CollectArguments(output_dir=str(tmp_path / "b"), **common))
    assert not (tmp_path / "b").exists()  # refused before anything was played or written
    collect(CollectArguments(output_dir=str(tmp_path / "b"), overwrite_hub=True, **common))


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_json_written_atomically_honours_the_umask(tmp_path: Path, umask: int) -> None:
    """results.json, refs.json, run_config.json... get what ``open`` would give them, not mkstemp's 0600."""
    import os
    import stat

    from tau2_rl.envs.users.llm import ReplyCache
    from tau2_rl.run.hub import write_json_atomic

    saved = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "results.json", {"a": 1})
        (tmp_path / "summary.md").write_text("x")  # a plain open, for comparison
        cache = ReplyCache(tmp_path / "cache")
        cache.put("ab" * 32, "hello", "m")
        cached = next((tmp_path / "cache").rglob("*.json"))
    finally:
        os.umask(saved)
    expected = 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "results.json").stat().st_mode) == expected
    assert stat.S_IMODE((tmp_path / "summary.md").stat().st_mode) == expected
    assert stat.S_IMODE(cached.stat().st_mode) == expected
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": 1}
    assert not list(tmp_path.glob(".results.json.*"))  # no temporary file left


class _Crash(RuntimeError):
    pass


class _FakeTrainer:
    """What ``export_revision`` uses of a Trainer: one process, a save that writes files (or dies half-way)."""

    def __init__(self, output_dir: Path) -> None:
        from types import SimpleNamespace

        self.args = SimpleNamespace(output_dir=str(output_dir))
        self.accelerator = SimpleNamespace(wait_for_everyone=lambda: None)
        self.crash = False

    def is_world_process_zero(self) -> bool:
        return True

    def save_model(self, output_dir: str) -> None:
        (Path(output_dir) / "config.json").write_text("{}")
        if self.crash:  # the weights half-written when the process died
            (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 10)
            raise _Crash
        (Path(output_dir) / "model.safetensors").write_bytes(b"\0" * 100)


def test_a_half_exported_revision_is_never_listed_in_refs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An export that dies mid-save, or between removing a step's old revision and renaming its new one into place,
    leaves refs.json listing only whole revisions; a failed re-export keeps the old revision listed and intact."""
    from tau2_rl.run import hub

    trainer, run_dir = _FakeTrainer(tmp_path / "out"), tmp_path / "hub" / "r"
    hub.export_revision(trainer, tmp_path / "hub", "r", 1, {})
    assert read_refs(run_dir)["revisions"] == {"step-000001": 1}
    trainer.crash = True
    for step in (2, 1):  # a new step, then the same step again
        with pytest.raises(_Crash):
            hub.export_revision(trainer, tmp_path / "hub", "r", step, {})
        refs = read_refs(run_dir)
        assert refs["revisions"] == {"step-000001": 1} and refs["main"] == "step-000001"
        assert (run_dir / "step-000001" / "model.safetensors").stat().st_size == 100
    with pytest.raises(HubError, match="no checkpoint step '2'"):
        hub.resolve_model("r@2", tmp_path / "hub")
    trainer.crash = False
    hub.export_revision(trainer, tmp_path / "hub", "r", 2, {})

    rmtree = hub.shutil.rmtree

    def removes_then_dies(path: Path, *args: object, **kwargs: object) -> None:
        rmtree(path, *args, **kwargs)
        if Path(path).name == "step-000001":
            raise _Crash  # the process died after the old step-1 directory went, before the new one was renamed in

    monkeypatch.setattr(hub.shutil, "rmtree", removes_then_dies)
    with pytest.raises(_Crash):
        hub.export_revision(trainer, tmp_path / "hub", "r", 1, {})
    refs = read_refs(run_dir)
    assert refs["revisions"] == {"step-000002": 2} and refs["main"] == "step-000002"
    assert not (run_dir / "step-000001").exists()
    assert refs["written_by"]["step-000001"]  # the hub run stays claimed by this output_dir
