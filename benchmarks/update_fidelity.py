"""Do the reference recipes' optimiser steps change the weights? Each recipe's precision, measured on CPU.

For every reference recipe (``recipes/grpo/<variant>.yaml``, ``<variant>_2gpu.yaml``, ``grpo_multinode.yaml``,
``recipes/sft/qwen2_5_7b*.yaml``) this takes, from the recipe through the entry script's own parser, the optimiser
the Trainer builds (class and keyword arguments: AdamW, betas, eps, weight decay), ``max_grad_norm``, the peak
learning rate, ``dtype`` and the LoRA settings, and from the accelerate config its launch command names (the
``--config_file`` of the recipe's header) whether fp32 master weights exist. It then trains a small Qwen2 whose weights
have a 7B model's scale (std 0.02) on a fixed batch for ``--steps`` steps, twice: as the recipe does, and all in fp32
(the reference). Printed per recipe:

* ``changed``: fraction of the trainable weights whose value (the fp32 master copy where there is one) differs from
  its start after the steps; ``ref_changed`` the same in the fp32 run; ``predicted`` what ``run.precision``'s
  pre-training check predicts (1 - the fraction it computes as lost);
* ``fwd_chg``: the same for the weights the model runs forward with (the bf16 copy of master weights, which moves
  only once the accumulated steps pass half a bf16 ulp: ~2% after 5 steps at 1e-6, most after ~100);
* ``loss_drop`` / ``ref_loss_drop``: loss on the fixed batch before minus after, evaluated in fp32 from the values the
  optimiser holds; ``tracking`` their ratio (1.0: the recipe optimises as fp32 does).

Emulation, said plainly: DeepSpeed is not installed on CPU, so a DeepSpeed launch (ZeRO-2 with the optimiser on the
CPU) is emulated with its precision semantics: bf16 model weights run forward and backward, the bf16 gradients are
upcast into fp32 master weights, clipped there, stepped with the recipe's optimiser in fp32 (DeepSpeed maps torch's
AdamW to its CPU AdamW with the same hyper-parameters; the arithmetic is AdamW's), and copied back rounded to bf16.
FSDP launches (accelerate upcasts trainable parameters to fp32 and computes in bf16) are the same. Without a master
copy, the optimiser steps the bf16 parameters in place (what ``single_gpu.yaml`` does). The peak learning rate is
used throughout (warm-up only makes steps smaller). Alternatives are measured alongside (``--alternatives``): the
same recipes launched without master weights, and bf16 AdamW with Kahan summation from ``optimi`` when installed
(``pip install --no-deps torch-optimi==0.3.3``).

Usage: ``python benchmarks/update_fidelity.py [--steps 5]``; the last line is the lowest ``changed`` over the recipes.
``tests/test_precision.py`` runs it.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer  # noqa: E402

from tau2_rl.run.precision import lost_update_fraction  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
LAUNCH = re.compile(r"accelerate launch .*?--config_file (\S+\.yaml)")


def reference_recipes() -> list[str]:
    """The 7B recipes: one per variant for one GPU, its ``_2gpu`` twin, the multi-node one and the SFT warm-ups."""
    from tau2_rl.configs import VARIANTS

    grpo = [f"recipes/grpo/{variant}{suffix}.yaml" for variant in VARIANTS for suffix in ("", "_2gpu")]
    found = [*grpo, "recipes/grpo/grpo_multinode.yaml", *glob.glob("recipes/sft/qwen2_5_7b*.yaml", root_dir=ROOT)]
    return sorted(p for p in found if (ROOT / p).is_file())


def recipe_launch_config(recipe: str) -> str:
    """The accelerate config the recipe's header tells the user to launch with (its first ``--config_file``)."""
    header = "\n".join(line for line in (ROOT / recipe).read_text().splitlines() if line.startswith("#"))
    match = LAUNCH.search(header.replace("\\\n#", " "))
    if match is None:
        raise ValueError(f"{recipe}: no 'accelerate launch ... --config_file <config>' in the header comment")
    return match.group(1)


def launch_keeps_fp32_master(accelerate_config: str) -> bool:
    """DeepSpeed keeps fp32 master weights; FSDP under accelerate upcasts trainable parameters when mixed precision
    is on (see tau2_rl/run/precision.py). Plain launches step the parameters in their own dtype."""
    config = yaml.safe_load((ROOT / accelerate_config).read_text())
    kind = str(config.get("distributed_type", "NO")).upper()
    mixed = str(config.get("mixed_precision", "no")).lower() in ("bf16", "fp16")
    return kind == "DEEPSPEED" or (kind == "FSDP" and mixed)


@dataclass(frozen=True)
class Setup:
    """What decides an optimiser step's precision in a recipe."""

    dtype: str
    learning_rate: float
    optimizer: str  # "torch": the Trainer's optimiser; "optimi-kahan": optimi.AdamW with Kahan summation
    optimizer_kwargs: tuple[tuple[str, Any], ...]
    max_grad_norm: float
    fp32_master: bool
    lora: tuple[int, int, tuple[str, ...]] | None  # r, alpha, target modules


def recipe_setup(recipe: str, fp32_master: bool | None = None) -> Setup:
    """The recipe's optimiser, learning rate, dtype and LoRA settings, parsed as its entry script parses them."""
    tmp = tempfile.mkdtemp(prefix="update-fidelity-")
    overrides = ["--config", str(ROOT / recipe), "--output_dir", tmp, "--report_to", "none", "--bf16", "false"]
    if recipe.startswith("recipes/grpo/"):
        import train_grpo

        parser, overrides = train_grpo.make_parser(), [*overrides, "--use_vllm", "false"]
    else:
        import train_sft

        parser = train_sft.make_parser()
    # unknown keys are the entry script's business (it refuses them); only the optimiser's fields matter here
    _, args, model_args, *_ = parser.parse_args_and_config(args=overrides, fail_with_unknown_args=False)
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    if optimizer_cls is not torch.optim.AdamW:
        raise ValueError(f"{recipe}: optim {args.optim} is not AdamW; this benchmark models AdamW only")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("lr", "fused", "foreach")}
    kwargs["weight_decay"] = args.weight_decay
    lora = None
    if model_args.use_peft:
        targets = model_args.lora_target_modules
        targets = tuple(targets) if isinstance(targets, list) else (targets,)
        lora = (model_args.lora_r, model_args.lora_alpha, targets)
    if str(model_args.dtype) not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"{recipe}: dtype {model_args.dtype!r}: a reference recipe names its dtype explicitly")
    if fp32_master is None:
        fp32_master = launch_keeps_fp32_master(recipe_launch_config(recipe))
    return Setup(
        dtype=str(model_args.dtype),
        learning_rate=args.learning_rate,
        optimizer="torch",
        optimizer_kwargs=tuple(sorted(kwargs.items())),
        max_grad_norm=args.max_grad_norm,
        fp32_master=fp32_master,
        lora=lora,
    )


def small_model(seed: int = 0) -> Qwen2ForCausalLM:
    """A small Qwen2 initialised like a 7B one: linear and embedding weights N(0, 0.02), norms 1, biases 0."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,  # shrunk: the LM head dominates a small model's cost
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.02,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).float().eval()  # eval: no dropout; gradients still flow


def fixed_batch(seed: int = 0) -> torch.Tensor:
    """Every token id twice (two shuffles of the vocabulary), so that every embedding row gets a gradient."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randperm(VOCAB, generator=generator) for _ in range(2)])
    return ids.reshape(4, -1)


def _with_lora(model: torch.nn.Module, lora: tuple[int, int, tuple[str, ...]] | None) -> torch.nn.Module:
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    r, alpha, targets = lora
    targets_arg: Any = "all-linear" if targets == ("all-linear",) else list(targets)
    torch.manual_seed(1)  # the same adapter initialisation in the recipe's run and the fp32 one
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets_arg))


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> float:
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def _fp32_loss(model: torch.nn.Module, held: dict[str, torch.Tensor], batch: torch.Tensor) -> float:
    """Loss of the trained state in fp32: the model with the optimiser's values (master copies) put back."""
    clone = copy.deepcopy(model).float()
    params = dict(clone.named_parameters())
    with torch.no_grad():
        for name, value in held.items():
            params[name].copy_(value.float())
    return _loss(clone, batch)


def train(setup: Setup, steps: int, fp32_reference: bool = False) -> dict[str, float]:
    """Trains the small model ``steps`` steps on the fixed batch under ``setup``; fractions and loss drop."""
    batch = fixed_batch()
    model = small_model()
    dtype = torch.float32 if fp32_reference else getattr(torch, setup.dtype)
    model = _with_lora(model.to(dtype), setup.lora)  # PEFT creates the adapters in fp32 over a bf16 base
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    master = setup.fp32_master and not fp32_reference
    kahan = setup.optimizer == "optimi-kahan" and not fp32_reference
    # the pre-training check's prediction; it does not model Kahan summation (no such launch in the project)
    trainable = [p for _, p in named]
    predicted = float("nan") if kahan else 1.0 - lost_update_fraction(trainable, setup.learning_rate, master)
    kwargs = dict(setup.optimizer_kwargs)
    if master:
        held = {n: p.detach().float().clone().requires_grad_(True) for n, p in named}
    else:
        held = {n: p for n, p in named}
    if kahan:
        import optimi

        optimizer: torch.optim.Optimizer = optimi.AdamW(list(held.values()), lr=setup.learning_rate, kahan_sum=True,
                                                        **kwargs)  # fmt: skip
    else:
        optimizer = torch.optim.AdamW(list(held.values()), lr=setup.learning_rate, **kwargs)

    def exact(name: str) -> torch.Tensor:  # the value the optimiser accumulates into, in fp32
        value = held[name].detach().float()
        comp = optimizer.state.get(held[name], {}).get("kahan_comp") if kahan else None
        return value + comp.float() if comp is not None and comp.numel() == value.numel() else value.clone()

    start = {n: exact(n) for n in held}
    forward_start = {n: p.detach().clone() for n, p in named}  # the weights the model runs with (vLLM's copy)
    loss_start = _fp32_loss(model, start, batch)
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if master:  # DeepSpeed/FSDP: bf16 gradients upcast into the fp32 master copies
            for name, param in named:
                held[name].grad = param.grad.float()
                param.grad = None
        torch.nn.utils.clip_grad_norm_(list(held.values()), setup.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master:
            with torch.no_grad():
                for name, param in named:
                    param.copy_(held[name])  # the bf16 copy the next forward (and vLLM) uses
    end = {n: exact(n) for n in held}
    changed = sum(int((end[n] != start[n]).sum()) for n in held) / sum(v.numel() for v in start.values())
    forward_changed = sum(int((p.detach() != forward_start[n]).sum()) for n, p in named)
    return {
        "changed": changed,
        "forward_changed": forward_changed / sum(v.numel() for v in forward_start.values()),
        "predicted": predicted,
        "loss_drop": loss_start - _fp32_loss(model, end, batch),
    }


def measure(setup: Setup, steps: int) -> dict[str, float]:
    run = train(setup, steps)
    ref = train(setup, steps, fp32_reference=True)
    return {
        **run,
        "ref_changed": ref["changed"],
        "ref_loss_drop": ref["loss_drop"],
        "tracking": run["loss_drop"] / ref["loss_drop"] if ref["loss_drop"] else float("nan"),
    }


def run(steps: int = 5, alternatives: bool = True, recipes: list[str] | None = None) -> dict[str, Any]:
    """Measures every reference recipe (and the alternatives); returns rows and the lowest ``changed``."""
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    cache: dict[Setup, dict[str, float]] = {}
    rows = []
    for recipe in recipes or reference_recipes():
        setup = recipe_setup(recipe)
        cache[setup] = cache.get(setup) or measure(setup, steps)
        rows.append({"recipe": recipe, "launch": recipe_launch_config(recipe), "setup": setup, **cache[setup]})
    extra = []
    if alternatives:
        seen = set()
        for row in rows:
            base = row["setup"]
            key = (base.learning_rate, base.optimizer_kwargs)
            if base.lora is not None or base.dtype != "bfloat16" or key in seen:
                continue
            seen.add(key)
            kind = "GRPO" if row["recipe"].startswith("recipes/grpo/") else "SFT"
            options = {"single_gpu.yaml (no master)": replace(base, fp32_master=False)}
            try:
                import optimi  # noqa: F401

                options["optimi AdamW, Kahan sum"] = replace(base, fp32_master=False, optimizer="optimi-kahan")
            except ImportError:
                pass
            for label, setup in options.items():
                cache[setup] = cache.get(setup) or measure(setup, steps)
                extra.append({"recipe": f"{kind} recipes, lr={base.learning_rate:g}", "launch": label,
                              "setup": setup, **cache[setup]})  # fmt: skip
    lowest = min(rows, key=lambda r: r["changed"])
    return {"steps": steps, "recipes": rows, "alternatives": extra, "lowest": lowest}


def replace(setup: Setup, **changes: Any) -> Setup:
    from dataclasses import replace as dataclass_replace

    return dataclass_replace(setup, **changes)


def describe(setup: Setup) -> str:
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(setup.dtype, setup.dtype)
    where = "fp32 master" if setup.fp32_master else ("fp32 LoRA" if setup.lora else f"{dtype} params")
    kahan = "+Kahan" if setup.optimizer == "optimi-kahan" else ""
    return f"{dtype} model, {where}{kahan}, lr {setup.learning_rate:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="optimiser steps per run")
    parser.add_argument("--alternatives", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", help="also write the rows to this file")
    options = parser.parse_args()
    result = run(options.steps, options.alternatives)
    numbers = (("changed", "changed"), ("fwd_chg", "forward_changed"), ("predict", "predicted"),
               ("ref_chg", "ref_changed"), ("track", "tracking"))  # fmt: skip
    header = f"{'recipe':<36} {'launch':<38} {'setup':<33} " + " ".join(f"{title:>7}" for title, _ in numbers)
    for title, rows in (("reference recipes", result["recipes"]), ("alternatives", result["alternatives"])):
        if not rows:
            continue
        print(f"# {title}: {result['steps']} steps on a small Qwen2 with 7B-scale weights (std 0.02)")
        print(header)
        for row in rows:
            values = " ".join(f"{row[key]:>7.4f}" for _, key in numbers)
            print(f"{row['recipe']:<36} {row['launch']:<38} {describe(row['setup']):<33} {values}")
    if options.json:
        rows = [{**r, "setup": describe(r["setup"])} for r in result["recipes"] + result["alternatives"]]
        Path(options.json).write_text(json.dumps(rows, indent=1))
    lowest = result["lowest"]
    print(f"lowest fraction of weights changed over the reference recipes: {lowest['changed']:.4f} "
          f"({lowest['recipe']})")  # fmt: skip


if __name__ == "__main__":
    main()
