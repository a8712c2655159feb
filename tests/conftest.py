"""Shared fixtures: one tiny random Qwen2 per test session, the airline environment, and a fast short-prompt variant.

Everything is offline: the model and its tokenizer are built locally (``tau2_rl.data.tiny_model``) in a few
seconds, once per session, with the real system prompt and tool schemas in the tokenizer corpus.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from pathlib import Path

import pytest
import torch

from tau2_rl.domains import get_domain
from tau2_rl.domains.airline.tools import TOOL_SCHEMAS
from tau2_rl.envs.episode import DomainEnv, EnvConfig

AIRLINE = get_domain("airline")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # ``pytest -n 2`` (the default suite, README): each worker is one of the two cores. A second torch thread per
    # worker only spins against the other worker (see ``single_thread``), and the processes a test starts inherit
    # one thread each too.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"

# 1,024 tokens instead of the default 4,096: a smaller embedding / LM head keeps every forward and backward cheap.
TINY_VOCAB = 1024
SHORT_SYSTEM_PROMPT = "You are an airline customer service agent. Follow the airline policy."


def make_short_env(max_turns: int = 4, tools: bool = False) -> DomainEnv:
    """The real airline environment with a one-line system prompt (and, unless ``tools``, no tool schemas in it).

    The real prompt is ~7k tokens with the 1k-token test vocabulary; trainer tests forward and backward every
    sequence, so they use this one (~40 tokens). The tools still run: only the prompt text changes.
    """
    env = DomainEnv(AIRLINE, config=EnvConfig(max_turns=max_turns))
    env.system_prompt = SHORT_SYSTEM_PROMPT
    if not tools:
        env.tools = []
    return env


@pytest.fixture(scope="session")
def airline_env() -> DomainEnv:
    return DomainEnv(AIRLINE)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, airline_env: DomainEnv) -> Path:
    from tau2_rl.data.tiny_model import build_tiny_model

    extra = [airline_env.system_prompt, SHORT_SYSTEM_PROMPT, *(str(schema) for schema in TOOL_SCHEMAS)]
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2", vocab_size=TINY_VOCAB, extra_texts=extra)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def tiny_model(tiny_model_dir: Path):
    """A fresh copy of the tiny model (tests that train it must not leak weights into other tests)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def short_env():
    """Factory: ``short_env(max_turns=..., tools=...)`` (see ``make_short_env``)."""
    return make_short_env


def quick_start_warmup() -> tuple[str, int]:
    """recipes/grpo/cpu_smoke.yaml's warm-up tasks and epochs: the quick start's, not a copy."""
    import yaml

    path = Path(__file__).resolve().parents[1] / "recipes" / "grpo" / "cpu_smoke.yaml"
    recipe = yaml.safe_load(path.read_text(encoding="utf-8"))
    return str(recipe["warmup_tasks"]), int(recipe["warmup_epochs"])


@pytest.fixture(scope="session")
def default_policy_cache() -> Path:
    """``outputs/``, holding the embedded default policy of ``recipes/grpo/cpu_smoke.yaml`` (warm-up tasks 3 and 40,
    96 epochs), built once for every slow test that trains from it.

    The same cache a run from the repository's root reads (``--warmup_cache_dir outputs``), built as the quick start
    builds it (one process, one thread: the same weights); before, each quick-start test and each learning module
    built its own (~40 s each on 2 cores)."""
    import subprocess
    import sys

    from tau2_rl.data.default_policy import default_policy_dir

    root = Path(__file__).resolve().parents[1]
    outputs = root / "outputs"
    tasks, epochs = quick_start_warmup()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "tau2_rl.data.default_policy", "--tasks", tasks, "--epochs", str(epochs),
               "--output_dir", str(default_policy_dir(outputs, tasks.split(","), epochs, [AIRLINE]))]  # fmt: skip
    subprocess.run(command, cwd=root, env=env, check=True, capture_output=True, timeout=1200)
    return outputs


@pytest.fixture(scope="session")
def default_policy_path(default_policy_cache: Path) -> Path:
    """The quick start's default policy itself (the cache's entry for cpu_smoke.yaml's warm-up setting)."""
    from tau2_rl.data.default_policy import default_policy_dir

    tasks, epochs = quick_start_warmup()
    return default_policy_dir(default_policy_cache, tasks.split(","), epochs, [AIRLINE])


@pytest.fixture(scope="module")
def single_thread():
    """One torch intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("single_thread")``).

    The tiny model's tensors gain nothing from a second thread, and on a 2-core machine shared with other jobs the
    threads spin-wait on each other: measured 10x slower training steps with 2 threads under load.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def hide_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM looks missing (``importlib.util.find_spec("vllm")`` is None) even where it is installed, as in CI's vLLM
    stage: the tests of the missing-vLLM errors run everywhere instead of being skipped."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "vllm" else real(name, *args))


def default_suite_alone(config: pytest.Config) -> bool:
    """``-m "not slow"`` (the README's test command, CI's stage 1): spread test by test, in file order."""
    return "not slow" in (config.getoption("markexpr") or "")


def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 - xdist's types
    """How ``pytest -n 2`` shares the tests out. A run that includes slow or vLLM tests sends a module's tests to one
    worker (``--dist loadfile``, pyproject.toml), so a module's shared run starts once; the default suite alone
    (``-m "not slow"``: many short tests, few shared runs) is spread test by test (``load``), which balanced the two
    workers better: 254 s against 299 s for stage 1 of a fresh clone's .ci/run (b68501f)."""
    from xdist.scheduler import LoadFileScheduling, LoadScheduling

    if default_suite_alone(config):
        return LoadScheduling(config, log)
    return LoadFileScheduling(config, log)


MODULE_SECONDS = {
    # slow stage (measured at ad66fc1 on a fresh clone, 2 cores; a module's test time, setup included)
    "test_sharded.py": 480, "test_readme_numbers.py": 215, "test_default_learning.py": 190, "test_sft.py": 145,
    "test_quick_start_ahead.py": 125, "test_graceful_stop.py": 120, "test_generation_ahead.py": 110,
    "test_experiment.py": 92, "test_multiprocess.py": 45, "test_sharded_sft.py": 45, "test_schedule_e2e.py": 43,
    "test_deepspeed_cpu.py": 40, "test_retail_training.py": 190,  # the mixed quick start: at f027585, measured alone
    "test_telecom_training.py": 85,  # its quick start, its default policy built: measured alone
    # vLLM stage (the same run's measure; test_vllm_served.py's from its 8 tasks then, 4 now)
    "test_vllm.py": 500, "test_vllm_served.py": 300, "test_vllm_async.py": 175,
}  # fmt: skip
"""How long each slow or vLLM module takes: under ``--dist loadfile`` xdist hands modules out in collection order,
so the order decides how the two workers' loads end. ``schedule_order`` starts the modules that hold ``serial``
tests (they stop the other worker anyway), then the longest: a replay of the measured durations under xdist's
scheduler and the serial lock gave 1,417 s for the slow stage against 1,556 s in file order (lower bound 1,277 s).
A module missing here only starts later; nothing breaks. The default suite alone (``-m "not slow"``, spread test
by test) keeps file order: sorted, a fresh clone's stage 1 took 368 s of tests; in file order 314 s (ac44447,
same machine)."""


def schedule_order(items: list[pytest.Item]) -> None:
    """Sorts ``items`` module by module (stable: a module's own order is kept) for ``MODULE_SECONDS``'s reason."""
    serial_modules = {item.path.name for item in items if item.get_closest_marker("serial") is not None}
    items.sort(key=lambda item: (item.path.name not in serial_modules, -MODULE_SECONDS.get(item.path.name, 0)))


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected: only the tests that run decide the order
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vllm`` start vLLM engines (seconds to minutes each on CPU): they run only when ``-m`` names
    ``vllm`` (CI's vLLM stage: ``-m vllm``), so ``-m "not slow"`` stays fast on a machine that has vLLM installed.
    Under ``pytest -n 2`` two vLLM modules run at once, each worker's engines bound to a core of their own
    (``tests/vllm_cpu.py::cpu_env``); a test that needs both cores at once (two ranks, an engine each) is marked
    ``serial`` itself. (Before dd2178f every vLLM test ran alone: 1,133 s for the stage.)

    Under ``pytest -n 2`` (pyproject.toml's addopts: both cores) ``--dist loadfile`` sends a module's tests to one
    worker, so a module's shared run (a module-scoped fixture: one run, many checks) starts once (the default suite
    alone is spread test by test: ``pytest_xdist_make_scheduler`` above). (Not ``loadgroup``
    with an ``xdist_group`` per module: pytest 9.2 derives ``nodeid`` from the node's path, so pytest-xdist 3.8's
    ``@group`` suffix on ``item._nodeid`` no longer reaches its scheduler and every group was spread over both
    workers: tests/test_conftest.py checks the grouping.)"""
    if not default_suite_alone(config):  # the loadfile runs (``pytest_xdist_make_scheduler``)
        schedule_order(items)
    if "vllm" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="vLLM stage: run with -m vllm (CI installs vllm-cpu for it)")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A test marked ``serial`` (it times a signal, a deadline or a rendezvous, or needs both cores at once) runs
    alone: under ``pytest -n 2`` the other worker waits between its tests until it is done, so no such test shares
    the two cores. A two-process run whose outcome does not depend on timing (DDP, FSDP2 or ZeRO against one
    process) is not serial: it shares the cores, slower but with the same result (dd2178f: 882 s of the slow
    stage ran alone, 40% of its test time).

    The lock wraps setup, call and teardown, so a module-scoped run set up by a serial test is alone too. Readers
    (every other test) hold the lock shared; a serial test holds it exclusive. The turnstile, held by a waiting
    serial test, stops new readers from slipping in ahead of it (no starvation while the other worker keeps
    starting tests). Without xdist (``-n 0``) the lock is never contended."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    import fcntl
    import tempfile

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "run")
    base = Path(tempfile.gettempdir()) / f"pytest-serial-{run}"
    exclusive = item.get_closest_marker("serial") is not None
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
