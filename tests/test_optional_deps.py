"""The base install is enough: importing every project module and parsing every recipe needs no vLLM or DeepSpeed.

A fresh machine has only ``requirements.txt`` + ``requirements-dev.txt``. The check runs in a subprocess whose
import system refuses ``vllm`` and ``deepspeed`` (a meta-path finder that records every attempt and raises
``ModuleNotFoundError``; ``find_spec`` answers None), so it holds whether or not they are installed here (CI's vLLM
stage installs vLLM into the same environment). Every attempt to import them is a failure, even one that was caught.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("vllm", "deepspeed")

PROBE = r"""
import importlib, importlib.abc, importlib.util, json, pkgutil, sys
from pathlib import Path

OPTIONAL = {optional!r}
attempts = []

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in OPTIONAL:
            attempts.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
        return None

for name in list(sys.modules):  # nothing optional preloaded by site hooks
    if name.split(".")[0] in OPTIONAL:
        del sys.modules[name]
sys.meta_path.insert(0, Refuse())
_real_find_spec = importlib.util.find_spec

def find_spec(name, *args):  # what TRL and transformers use to ask "is it installed?": a plain no, not an attempt
    return None if name.split(".")[0] in OPTIONAL else _real_find_spec(name, *args)

importlib.util.find_spec = find_spec

root = Path({root!r})
sys.path.insert(0, str(root))
import tau2_rl

modules = sorted(m.name for m in pkgutil.walk_packages(tau2_rl.__path__, "tau2_rl."))
scripts = ["train_grpo", "train_sft", "evaluate", "collect_trajectories", "play", "plot_run", "run_ablation"]
scripts += ["scripts." + p.stem for p in sorted((root / "scripts").glob("*.py")) if p.stem != "__init__"]
for name in ["tau2_rl", *modules, *scripts]:
    importlib.import_module(name)

import evaluate, train_grpo, train_sft

recipes = []
cpu = ["--bf16", "false", "--use_cpu", "true"]  # GPU recipes on a CPU-only machine: only bf16 is overridden
for folder, prefix, parser in (("grpo", "", train_grpo), ("sft", "", train_sft), ("ablation", "grpo_", train_grpo),
                               ("ablation", "sft_", train_sft)):
    for path in sorted((root / "recipes" / folder).glob(prefix + "*.yaml")):
        parser.make_parser().parse_args_and_config(args=["--config", str(path), *cpu])
        recipes.append(str(path.relative_to(root)))
eval_recipes = [*(root / "recipes" / "eval").glob("*.yaml"), *(root / "recipes" / "ablation").glob("eval_*.yaml")]
for path in sorted(eval_recipes):
    evaluate.make_parser().parse_args_and_config(["--config", str(path)])
    recipes.append(str(path.relative_to(root)))

loaded = sorted(n for n in sys.modules if n.split(".")[0] in OPTIONAL)
print(json.dumps({{"modules": len(modules) + len(scripts), "recipes": recipes, "attempts": attempts,
                  "loaded": loaded}}))
"""


def test_modules_and_recipes_need_neither_vllm_nor_deepspeed(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(optional=OPTIONAL, root=str(REPO_ROOT)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(probe)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["attempts"] == [] and report["loaded"] == [], report
    assert report["modules"] > 50  # the walk really imported the package, not an empty list
    use_vllm = [r for r in report["recipes"] if "use_vllm: true" in (REPO_ROOT / r).read_text()]
    assert use_vllm, "no GPU recipe with use_vllm was parsed: the check would pass vacuously"
    assert {"recipes/grpo/joint.yaml", "recipes/sft/qwen2_5_7b.yaml", "recipes/eval/gpu_vllm.yaml"} <= set(
        report["recipes"]
    )
