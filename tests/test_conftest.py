"""The test layout's own promise (pyproject.toml's addopts, tests/conftest.py): under ``pytest -n 2`` the tests of a
module run on one worker, so a module-scoped shared run starts once, and both workers get work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULE = """
import os
import pytest

@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    with open({log!r}, "a", encoding="utf-8") as f:
        f.write("fixture " + __name__ + "\\n")

@pytest.mark.parametrize("case", range(4))
def test_case(shared_run, case):
    with open({log!r}, "a", encoding="utf-8") as f:
        f.write(__name__ + " " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_a_modules_tests_share_one_worker_and_its_shared_run_starts_once(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    for name in ("test_first", "test_second"):
        (tmp_path / f"{name}.py").write_text(MODULE.format(log=str(log)), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS" and not k.startswith("PYTEST_XDIST")}
    command = [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
               "-p", "no:cacheprovider", "-q", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = log.read_text(encoding="utf-8").splitlines()
    fixtures = sorted(line for line in lines if line.startswith("fixture"))
    assert fixtures == ["fixture test_first", "fixture test_second"]  # once per module
    workers = {}
    for line in lines:
        if not line.startswith("fixture"):
            module, worker = line.split()
            workers.setdefault(module, set()).add(worker)
    assert {module: len(ids) for module, ids in workers.items()} == {"test_first": 1, "test_second": 1}, workers
    assert workers["test_first"] != workers["test_second"], workers  # both cores at work


def test_the_default_suite_alone_is_spread_test_by_test(monkeypatch) -> None:
    """``-m "not slow"`` (README, CI's stage 1): xdist's ``load``; anything else: a module per worker."""
    from types import SimpleNamespace

    import xdist.scheduler

    from tests.conftest import pytest_xdist_make_scheduler

    for name in ("LoadScheduling", "LoadFileScheduling"):  # stand-ins that record which one was made
        monkeypatch.setattr(xdist.scheduler, name, lambda config, log, name=name: name)

    def scheduler(markexpr: str) -> str:
        return pytest_xdist_make_scheduler(SimpleNamespace(getoption=lambda option: markexpr), log=None)

    assert scheduler("not slow") == "LoadScheduling"
    assert scheduler("slow and not exhaustive") == "LoadFileScheduling"
    assert scheduler("vllm and not exhaustive") == "LoadFileScheduling"
    assert scheduler("") == "LoadFileScheduling"


def test_modules_with_serial_tests_start_first_then_the_longest(monkeypatch) -> None:
    """The slow and vLLM stages' order (``schedule_order``): a module's tests stay together and in their order."""
    from types import SimpleNamespace

    import tests.conftest as conftest

    monkeypatch.setattr(conftest, "MODULE_SECONDS", {"test_long.py": 500, "test_mid.py": 100, "test_serial.py": 50})

    def item(module: str, name: str, serial: bool = False) -> SimpleNamespace:
        marker = object() if serial else None
        return SimpleNamespace(path=Path(module), name=name, get_closest_marker=lambda mark: marker)

    items = [item("test_fast.py", "a"), item("test_mid.py", "b"), item("test_serial.py", "c"),
             item("test_serial.py", "d", serial=True), item("test_long.py", "e"),
             item("test_mid.py", "f")]  # fmt: skip
    conftest.schedule_order(items)
    assert [i.name for i in items] == ["c", "d", "e", "b", "f", "a"]


def test_each_worker_binds_its_vllm_engines_to_a_core_of_its_own() -> None:
    """``pytest -n 2`` runs two vLLM modules at once: gw1's cores are gw0's turned by one (tests/vllm_cpu.py)."""
    from tests.vllm_cpu import worker_cores

    assert [worker_cores("0", worker, 2) for worker in ("", "gw0", "gw1")] == ["0", "0", "1"]
    assert worker_cores("1", "gw1", 2) == "0"  # a test's second engine goes to the other core
    assert worker_cores("0|1", "gw1", 2) == "1|0"  # two ranks: a core each, whichever worker
    assert worker_cores("0-3", "gw1", 16) == "1-4"
