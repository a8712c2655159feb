"""The local hub: every checkpoint save also exports a loadable model + tokenizer + model card.

Layout (offline, plain directories; ``from_pretrained`` reads each revision directly):

    hub/<run_name>/step-000050/   config.json, weights, tokenizer files, README.md (model card)
    hub/<run_name>/step-000100/
    hub/<run_name>/refs.json      {"main": "step-000100", "revisions": {"step-000050": 50, ...},
                                   "written_by": {"step-000050": "../../outputs/my-run", ...}}

``resolve_model("<run_name>@100", hub_dir)`` gives the step-100 directory, ``"<run_name>"`` the newest one.
A revision is written to a temporary sibling and renamed into place before refs.json (replaced atomically) lists it,
and a step exported again is unlisted before its old directory goes: an interrupted export never leaves a listed
revision that is not whole.

Each revision records which run wrote it (``written_by``: that run's ``output_dir``, relative to the hub's run
directory so that moving the whole tree keeps it). The recipes fix ``run_name``, so two runs in different output dirs
share ``hub/<run_name>``; ``claim_hub_run`` refuses, before any work, a hub run holding another run's revisions (an
export would silently replace them) unless ``--overwrite_hub true``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from tau2_rl.files import honour_umask, mkstemp_honouring_umask

logger = logging.getLogger(__name__)

REFS_FILE = "refs.json"
WRITERS_KEY = "written_by"


class HubError(ValueError):
    """A local-hub path or model id is wrong; the message names it."""


def revision_name(step: int) -> str:
    return f"step-{step:06d}"


def ensure_writable(hub_dir: str | os.PathLike[str]) -> Path:
    """Fails before any work starts when the hub directory cannot be created or written."""
    path = Path(hub_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as err:
        raise HubError(f"hub directory {path} (--hub_dir) is not writable: {err}") from err
    return path


def write_json_atomic(path: Path, payload: Any) -> None:
    """Writes JSON through a temporary file and ``os.replace`` so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = mkstemp_honouring_umask(path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
    os.replace(tmp, path)


def read_refs(run_dir: Path) -> dict[str, Any]:
    refs_path = run_dir / REFS_FILE
    if not refs_path.is_file():
        return {"main": None, "revisions": {}}
    return json.loads(refs_path.read_text(encoding="utf-8"))


def writer_id(output_dir: str | os.PathLike[str], owner_dir: str | os.PathLike[str]) -> str:
    """How a revision records the run that wrote it: its ``output_dir`` relative to ``owner_dir`` (the hub's run dir,
    or a hub dataset's directory), POSIX-style; absolute when no relative path exists."""
    target, base = Path(output_dir).resolve(), Path(owner_dir).resolve()
    try:
        return Path(os.path.relpath(target, base)).as_posix()
    except ValueError:  # another drive (Windows)
        return target.as_posix()


def writer_path(writer: str, owner_dir: str | os.PathLike[str]) -> str:
    """The output_dir a ``writer_id`` names, as a path a user can read (relative to the working directory)."""
    path = Path(os.path.normpath(Path(owner_dir).resolve() / writer))
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def check_writer(
    recorded: str | None,
    output_dir: str | os.PathLike[str],
    owner_dir: str | os.PathLike[str],
    *,
    what: str,
    rename_flag: str,
    overwrite: bool,
) -> None:
    """Refuses (``HubError``, one line) when ``what`` in ``owner_dir`` was written by a run other than the one in
    ``output_dir``; ``recorded`` is its ``writer_id`` (None: written before writers were recorded)."""
    if overwrite or recorded == writer_id(output_dir, owner_dir):
        return
    other = "a run that did not record its output_dir" if recorded is None else writer_path(recorded, owner_dir)
    raise HubError(
        f"{what} holds the export of another run ({other}), not of this one (--output_dir {output_dir}): pass "
        f"another {rename_flag}, or --overwrite_hub true to replace it"
    )


def claim_hub_run(
    hub_dir: str | os.PathLike[str], run_name: str, output_dir: str | os.PathLike[str], *, overwrite: bool = False
) -> None:
    """Refuses, before a training run starts, ``<hub_dir>/<run_name>`` when it holds revisions of another run."""
    run_dir = Path(hub_dir) / run_name
    refs = read_refs(run_dir)
    writers = refs.get(WRITERS_KEY) or {}
    for name in sorted(refs.get("revisions") or {}):
        if (run_dir / name).is_dir():
            check_writer(
                writers.get(name), output_dir, run_dir, what=f"{run_dir}/{name}", rename_flag="--run_name",
                overwrite=overwrite,
            )  # fmt: skip


def record_revision(run_dir: Path, name: str, step: int, output_dir: str | os.PathLike[str] | None) -> None:
    """Adds a revision (and the run that wrote it) to ``refs.json`` and moves ``main`` to the newest step."""
    refs = read_refs(run_dir)
    refs["revisions"][name] = step
    refs["main"] = max(refs["revisions"], key=refs["revisions"].get)
    writers = refs.setdefault(WRITERS_KEY, {})
    if output_dir is not None:
        writers[name] = writer_id(output_dir, run_dir)
    else:
        writers.pop(name, None)
    write_json_atomic(run_dir / REFS_FILE, refs)


def unlist_revision(run_dir: Path, name: str) -> None:
    """Drops a revision from ``refs.json`` (``main`` moves to the newest one left); its writer stays recorded, so the
    hub run is still claimed by the same output_dir."""
    refs = read_refs(run_dir)
    if refs["revisions"].pop(name, None) is None:
        return
    refs["main"] = max(refs["revisions"], key=refs["revisions"].get) if refs["revisions"] else None
    write_json_atomic(run_dir / REFS_FILE, refs)


def load_snippet(run_name: str, step: int, hub_dir: str | os.PathLike[str] = "hub") -> list[str]:
    """Python that loads the revision from where a user stands: the repository root (``<hub_dir>/<run>/step-N``),
    the hub dir (``<run>/step-N``), the run dir (``step-N``) or the revision itself; an absolute ``hub_dir`` works
    from anywhere."""
    revision = f"{run_name}/{revision_name(step)}"
    candidates = [f"{Path(hub_dir).as_posix()}/{revision}", revision, revision_name(step), "."]
    return [
        "from pathlib import Path",
        "",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"candidates = {candidates!r}  # from the repository root, the hub dir, the run dir, the revision",
        'path = next(c for c in candidates if (Path(c) / "config.json").is_file())',
        "model = AutoModelForCausalLM.from_pretrained(path)",
        "tokenizer = AutoTokenizer.from_pretrained(path)",
    ]


GRPO_CARD_TEXT = "Policy trained on the τ²-bench {domains} with tau2_rl (multi-turn GRPO on TRL)."
"""``{domains}``: "airline domain", "airline and retail domains" (the run's ``--domain``)."""


def config_domains(config: dict[str, Any]) -> list[str]:
    """The domains a run's config names (``domain``: one, or several comma-separated); a config written before
    domains were recorded is the legacy domain's (``tau2_rl.domains.legacy_domain``)."""
    from tau2_rl.domains import legacy_domain

    named = str(config.get("domain") or "")
    return [name.strip() for name in named.split(",") if name.strip()] or [legacy_domain().name]


def model_card(
    run_name: str,
    step: int,
    info: dict[str, Any],
    hub_dir: str | os.PathLike[str] = "hub",
    *,
    method: str = "grpo",
    text: str = GRPO_CARD_TEXT,
) -> str:
    """A short README.md for a revision: what it is (``method`` tag, ``text``), how it was trained, its data when
    ``info`` has a ``data`` summary (SFT's), the last logged metrics, and how to load it offline. Its domains are the
    config's (``--domain``, ``config_domains``)."""
    domains = config_domains(info.get("config", {}))
    words = f"{domains[0]} domain" if len(domains) == 1 else f"{' and '.join(domains)} domains"
    text = text.replace("{domains}", words)
    lines = [
        "---",
        "library_name: transformers",
        f"tags: [trl, {method}, tau2-bench, {', '.join(domains)}, tool-calling]",
        "---",
        f"# {run_name} @ step {step}",
        "",
        text,
        "",
        "## Training",
    ]
    for key, value in sorted(info.get("config", {}).items()):
        lines.append(f"- `{key}`: {value}")
    if info.get("data"):
        lines += ["", "## Data", "", info["data"]]
    metrics = info.get("metrics", {})
    if metrics:
        lines += ["", "## Last logged metrics", "", "| metric | value |", "|---|---|"]
        for key, value in sorted(metrics.items()):
            lines.append(f"| {key} | {value:.4g} |" if isinstance(value, int | float) else f"| {key} | {value} |")
    lines += ["", "Load offline:", "", "```python", *load_snippet(run_name, step, hub_dir), "```", ""]
    return "\n".join(lines)


def save_consolidated(trainer: Any, output_dir: str) -> None:
    """One plain HF model in ``output_dir`` whatever the sharding (all ranks call it; the main process writes): the
    same files with the same tensor names for 1 process, DDP, FSDP2 and ZeRO-2/3.

    ``Trainer.save_model`` writes FSDP's sharded state (``pytorch_model_fsdp_0/``) when the launch keeps
    ``SHARDED_STATE_DICT`` (fsdp2.yaml does, for fast checkpoints): no ``from_pretrained`` could load that, so
    under FSDP the full state dict is gathered (a collective) and saved with the tokenizer; DeepSpeed's goes the same
    way (ZeRO-3 gathers its partitions, ZeRO-2 clones the tensors). Such a state dict holds a tied weight
    (``lm_head.weight`` of a model with ``tie_word_embeddings``) as a second tensor equal to the first, which
    ``save_pretrained`` only recognises as tied when both share storage: it would store a second 151,936-row
    embedding in every revision, so it is dropped here. Everything else goes through ``save_model``."""
    gathered, state_dict = False, None
    if getattr(trainer, "is_fsdp_enabled", False):
        gathered, state_dict = True, trainer.accelerator.get_state_dict(trainer.model)  # on the main process's CPU
    elif getattr(trainer, "is_deepspeed_enabled", False):
        try:  # every rank takes the same branch: ZeRO-3's gather is a collective (only rank 0 gets the tensors)
            gathered, state_dict = True, trainer.accelerator.get_state_dict(trainer.model_wrapped)
        except ValueError:  # stage3_gather_16bit_weights_on_model_save off (on every rank): the Trainer's fallback
            gathered = False
    if gathered:
        if trainer.is_world_process_zero():
            model = trainer.accelerator.unwrap_model(trainer.model)
            trainer._save(output_dir, state_dict=without_tied_copies(model, state_dict))
    else:
        trainer.save_model(output_dir)
    if trainer.is_world_process_zero():
        honour_umask(output_dir)


def without_tied_copies(model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` without the tied names a plain ``save_pretrained`` of ``model`` leaves out (those the model's
    config ties to another weight that is in the state dict); an untied model keeps every tensor."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    tied = expand(all_submodels=True) if callable(expand) else {}
    return {k: v for k, v in state_dict.items() if not (k in tied and tied[k] in state_dict)}


def export_revision(trainer: Any, hub_dir: str | os.PathLike[str], run_name: str, step: int, info: dict) -> Path:
    """Saves the trainer's model and tokenizer as ``hub/<run_name>/step-<N>`` (all ranks call it; rank 0 writes)."""
    run_dir = Path(hub_dir) / run_name
    final = run_dir / revision_name(step)
    tmp = run_dir / f".{revision_name(step)}.tmp"
    if trainer.is_world_process_zero():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    trainer.accelerator.wait_for_everyone()
    save_consolidated(trainer, str(tmp))
    if trainer.is_world_process_zero():
        (tmp / "README.md").write_text(model_card(run_name, step, info, hub_dir), encoding="utf-8")
        style = info.get("config", {}).get("system_prompt")
        if style is not None:  # the prompt the policy was trained with, for evaluate.py (envs/prompt_style.py)
            from tau2_rl.domains import get_domain
            from tau2_rl.envs.prompt_style import COMPACT, write_prompt_style

            specs = [get_domain(name) for name in config_domains(info.get("config", {}))]
            write_prompt_style(tmp, style == COMPACT, specs)
        honour_umask(tmp)  # save_pretrained writes model.safetensors 0600: others on a shared hub could not load it
        if final.exists():  # a rerun exporting a step again: unlisted first, so refs.json never names a torso
            unlist_revision(run_dir, final.name)
            shutil.rmtree(final)
        os.replace(tmp, final)
        record_revision(run_dir, final.name, step, trainer.args.output_dir)
        logger.info("exported %s", final)
    trainer.accelerator.wait_for_everyone()
    return final


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def missing_model_files(path: str | os.PathLike[str]) -> list[str]:
    """What a local model directory lacks for ``from_pretrained`` (config, weights, tokenizer); [] when complete.
    An adapter directory (``adapter_config.json``) needs no tokenizer of its own."""
    path = Path(path)
    adapter = (path / "adapter_config.json").is_file()
    missing = []
    if not adapter and not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        missing.append(f"weights ({' or '.join(WEIGHT_FILES[:3])})")
    if not adapter and not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    return missing


def check_model_dir(path: str | os.PathLike[str], flag: str) -> None:
    """Refuses (``HubError``, one line) a model directory ``from_pretrained`` cannot load, naming what is missing
    (an empty directory used to end in a 45-line traceback blaming sentencepiece)."""
    if not Path(path).is_dir():
        raise HubError(f"{flag} {path} is not a directory: pass a model directory written by save_pretrained")
    missing = missing_model_files(path)
    if missing:
        empty = " (it is empty)" if not any(Path(path).iterdir()) else ""
        raise HubError(
            f"{flag} {path} is not a complete model directory{empty}: it lacks {', '.join(missing)}; pass a "
            "directory written by save_pretrained (a training run's output_dir, a hub revision)"
        )


def resolve_model(spec: str, hub_dir: str | os.PathLike[str] = "hub") -> Path:
    """A model directory from a path, ``<run>`` (newest revision) or ``<run>@<step|revision>`` in the local hub."""
    as_path = Path(spec)
    if as_path.is_dir() and any((as_path / name).exists() for name in ("config.json", "adapter_config.json")):
        check_model_dir(as_path, "--model")
        return as_path
    in_hub = Path(hub_dir) / spec.partition("@")[0]
    hub_run = in_hub.is_dir() and (in_hub / REFS_FILE).is_file()
    if as_path.is_dir() and not (as_path / REFS_FILE).is_file() and not hub_run:
        check_model_dir(as_path, "--model")  # a directory that is neither a model nor a hub run: say what it lacks
    run, _, revision = spec.partition("@")
    run_dir = Path(hub_dir) / run
    if not run_dir.is_dir():
        raise HubError(
            f"model {spec!r} is neither a model directory nor a run in the local hub directory {hub_dir} (--hub_dir)"
        )
    refs = read_refs(run_dir)
    if not revision:
        if not refs["main"]:
            raise HubError(f"run {run!r} in {hub_dir} has no exported revision yet")
        return run_dir / refs["main"]
    name = (
        revision if revision.startswith("step-") else revision_name(int(revision)) if revision.isdigit() else revision
    )
    if name not in refs["revisions"] or not (run_dir / name).is_dir():
        available = sorted(refs["revisions"].values())
        raise HubError(f"run {run!r} has no checkpoint step {revision!r}; available steps: {available}")
    return run_dir / name


class LocalHubCallback(TrainerCallback):
    """Exports a local-hub revision after every checkpoint save (and once at the end of training)."""

    def __init__(self, trainer: Any, hub_dir: str | os.PathLike[str], run_name: str, config: dict[str, Any]) -> None:
        self.trainer = trainer
        self.hub_dir = hub_dir
        self.run_name = run_name
        self.config = config
        self.exported: set[int] = set()
        self.last_exported: Path | None = None

    def _info(self, state: Any) -> dict[str, Any]:
        metrics = {}
        for entry in reversed(state.log_history):
            metrics = {k: v for k, v in entry.items() if isinstance(v, int | float)}
            if metrics:
                break
        return {"config": self.config, "metrics": metrics}

    def export(self, state: Any) -> Path | None:
        if state.global_step in self.exported:
            return None
        self.exported.add(state.global_step)
        self.last_exported = export_revision(
            self.trainer, self.hub_dir, self.run_name, state.global_step, self._info(state)
        )
        return self.last_exported

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        stop = getattr(self.trainer, "user_error_stop", None)
        if stop is not None and stop.stopped:  # a checkpoint to resume from, not a model to publish
            return
        self.export(state)
