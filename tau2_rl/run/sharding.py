"""How a sharded launch runs here: FSDP2 on CPU (the tested twin of the GPU configs), and the launches refused.

1. **CPU FSDP2.** accelerate 1.15 enters FSDP only from its GPU-family branches: on CPU
   (``Accelerator(cpu=True)``, gloo) an FSDP launch becomes ``MULTI_CPU`` and the model is wrapped in DDP, silently.
   torch itself shards on CPU (``fully_shard`` on a gloo group runs forward, backward and optimiser steps), so
   ``cpu_fsdp2`` promotes exactly that case (an FSDP2 launch, CPU, a gloo process group of > 1 process) to
   ``DistributedType.FSDP`` with the launcher's FSDP plugin, as accelerate does on a GPU. It patches
   ``AcceleratorState.__init__`` only while the trainer builds its accelerator, and changes nothing on any other
   launch. ``accelerate_configs/cpu_fsdp2.yaml`` is the config it exists for.
2. **Silent downgrades refused** (``check_launch``): a launch whose config asks for FSDP or DeepSpeed but whose
   accelerator is not sharded, several processes without a process group (accelerate's ``NO``: N unconnected
   copies training into one output directory) and FSDP1 on CPU (only FSDP2 is promoted). Prefix-reuse rollouts
   forced on where they cannot run are refused by the trainer, which knows why (``trl_prefix.unavailable``); a
   global batch that ``num_generations`` does not divide, by TRL's config check at parse time.
3. **Full parameters for generation** (``unsharded_for_generation``): under FSDP2 every forward all-gathers its
   layers, a collective that every rank must make in step; a rollout's forwards differ per rank (prompt lengths,
   turns). The rollout round therefore all-gathers the parameters once, on every rank at the same point, keeps them
   unsharded until the round ends, and generates locally; ZeRO-3 does the same through TRL's
   ``ds3_gather_for_generation`` context, entered once per round (``backends/trl_prefix.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from tau2_rl.run.start import release_process_group_at_exit

FSDP_ENV = "ACCELERATE_USE_FSDP"
DEEPSPEED_ENV = "ACCELERATE_USE_DEEPSPEED"

logger = logging.getLogger(__name__)


class LaunchError(ValueError):
    """A launch this trainer refuses, before any work; the message names the config or flag to change."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() == "true"


def world_size_from_env() -> int:
    """Processes the launcher started (torchrun's WORLD_SIZE; 1 outside a launcher)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _promote_to_fsdp(state: Any, fsdp_plugin: Any) -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = fsdp_plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def wants_cpu_fsdp2(cpu: bool, distributed_type: Any, fsdp_plugin: Any) -> bool:
    """The one case the shim changes: an FSDP2 plugin from the launcher, on CPU, in a multi-process gloo group."""
    from accelerate.utils import DistributedType

    return (
        fsdp_plugin is not None
        and getattr(fsdp_plugin, "fsdp_version", 1) == 2
        and distributed_type == DistributedType.MULTI_CPU
        and (cpu or not torch.cuda.is_available())
    )


@contextlib.contextmanager
def cpu_fsdp2() -> Iterator[None]:
    """While active, an ``AcceleratorState`` built for an FSDP2 launch on CPU is FSDP, not DDP (module doc, 1)."""
    from accelerate.state import AcceleratorState

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        fresh = not getattr(self, "_shared_state", {})
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if fresh and wants_cpu_fsdp2(bool(kwargs.get("cpu", False)), self.distributed_type, plugin):
            _promote_to_fsdp(self, plugin)

    AcceleratorState.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        AcceleratorState.__init__ = original  # type: ignore[method-assign]


def sharding_name(accelerator: Any) -> str:
    """What the run's accelerator really does with the parameters, for the log: FSDP2, ZeRO-N, DDP or none."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
        return f"FSDP{version} ({accelerator.num_processes} processes, {accelerator.device.type})"
    if kind == DistributedType.DEEPSPEED:
        stage = accelerator.state.deepspeed_plugin.zero_stage
        return f"DeepSpeed ZeRO-{stage} ({accelerator.num_processes} processes, {accelerator.device.type})"
    if accelerator.num_processes > 1:
        return f"DDP ({accelerator.num_processes} processes, {accelerator.device.type})"
    return f"one process ({accelerator.device.type})"


def check_launch_environment() -> None:
    """What can be refused before accelerate builds anything: FSDP1 without a GPU (accelerate's FSDP1 plugin would
    fail with a device error; on CPU it could only have been DDP anyway)."""
    version = os.environ.get("FSDP_VERSION", "1")
    if _env_flag(FSDP_ENV) and version != "2" and not torch.cuda.is_available():
        raise LaunchError(
            f"the accelerate config asks for FSDP (fsdp_version {version}), which needs a GPU: on CPU only FSDP2 "
            "runs (fsdp_version: 2, as in accelerate_configs/cpu_fsdp2.yaml)"
        )


def check_launch(accelerator: Any) -> None:
    """Refuses the launches of the module doc (2) with one line each; returns when the launch is what it says."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    kind_name = getattr(kind, "value", str(kind))
    launched = world_size_from_env()
    if launched > 1 and accelerator.num_processes == 1:
        raise LaunchError(
            f"the launcher started {launched} processes but they share no process group (accelerate's distributed "
            "type is NO): each would train its own copy into one output_dir. On CPU pass --use_cpu true (the CPU "
            "recipes do); on GPUs check that every process sees its CUDA device"
        )
    if _env_flag(FSDP_ENV) and kind != DistributedType.FSDP:
        version = os.environ.get("FSDP_VERSION", "1")
        hint = (
            "on CPU only FSDP2 runs: fsdp_version: 2, as in accelerate_configs/cpu_fsdp2.yaml"
            if version != "2"
            else "on CPU it needs --use_cpu true and more than one process (accelerate_configs/cpu_fsdp2.yaml)"
        )
        raise LaunchError(
            f"the accelerate config asks for FSDP (fsdp_version {version}) but the accelerator is {kind_name}: "
            f"the run would not be sharded; {hint}"
        )
    if _env_flag(DEEPSPEED_ENV) and kind != DistributedType.DEEPSPEED:
        raise LaunchError(
            f"the accelerate config asks for DeepSpeed but the accelerator is {kind_name}: accelerate initialises "
            "DeepSpeed only on an accelerator device, never with --use_cpu true (docs/reproducing.md, 'Sharded runs')"
        )


def parameters_sharded_for_generation(accelerator: Any, ds3_gather: bool = True) -> bool:
    """FSDP1, and ZeRO-3 without ``ds3_gather_for_generation``, keep the parameters sharded while generating (every
    forward is a collective); FSDP2 and gathering ZeRO-3 hold them whole for the rollout round, and DDP / ZeRO-2
    never shard them."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2
    if kind == DistributedType.DEEPSPEED:
        return accelerator.state.deepspeed_plugin.zero_stage == 3 and not ds3_gather
    return False


def _fsdp2_modules(model: torch.nn.Module) -> list[Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


@contextlib.contextmanager
def unsharded_for_generation(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """FSDP2: all-gathers every layer once (a collective: every rank enters here at the same point), keeps the
    parameters unsharded across all forwards inside, reshards on exit. Anything else: the model as it is."""
    modules = _fsdp2_modules(model)
    if not modules:
        yield model
        return
    saved = []  # FSDP2's own settings, restored as they were (the root module never reshards after forward)
    for module in modules:
        state = module._get_fsdp_state()
        groups = [(group, group.post_forward_mesh_info) for group in state._fsdp_param_groups]
        saved.append((state, state._auto_reshard_after_forward, groups))
        module.set_reshard_after_forward(False, recurse=False)
    for module in modules:  # the same order on every rank: model.modules() of the same architecture
        module.unshard()
    try:
        yield model
    finally:
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, mesh_info in groups:
                group.post_forward_mesh_info = mesh_info
        for module in modules:
            module.reshard()


class ShardedLaunch:
    """Mixin for a transformers ``Trainer``: its accelerator is built under ``cpu_fsdp2``, then the launch checked
    (``check_launch``) before the model is wrapped or any step runs, and the log says how the run is sharded."""

    accelerator: Any

    def create_accelerator_and_postprocess(self) -> None:
        check_launch_environment()
        release_process_group_at_exit()  # a trainer built outside our entry scripts (tests, notebooks) too
        with cpu_fsdp2():
            super().create_accelerator_and_postprocess()  # type: ignore[misc]
        check_launch(self.accelerator)
        if self.accelerator.is_main_process:
            logger.warning("sharding: %s", sharding_name(self.accelerator))
