"""Several domains in one run: their environments behind one ``reset``, each task keyed ``<domain>/<task id>``.

A run over one domain uses its ``DomainEnv`` as it is (task keys are the plain ids, so nothing a one-domain run writes
changes). A run over several (``--domain airline,retail``: one model trained or evaluated on every domain, as
AReaL-SEA trains on all of τ²'s) uses a ``MultiDomainEnv``, which answers the same questions a run asks of its
environment (``members``, ``task_keys``, ``key``, ``task``, ``env_of``, ``base_of``, ``reset``, ``config``) with
keys that name the domain. An episode keeps its task (plain id, its domain's spec); its record's ``task_id`` is the
key, so rewards, results and GRPO groups tell the two tasks "3" apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.data import DomainDataError
from tau2_rl.envs.episode import DomainEnv, EnvConfig, Episode
from tau2_rl.envs.spec import DomainSpec, split_task_key, task_key
from tau2_rl.envs.splits import Split, SplitError, split_for

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task
    from tau2_rl.envs.state import CanonicalBase


class MultiDomainEnv:
    """The environments of a run's domains (see the module docstring)."""

    def __init__(self, envs: Sequence[DomainEnv]) -> None:
        if len(envs) < 2:
            raise ValueError("MultiDomainEnv joins two or more domains; use the DomainEnv of a single one")
        self._envs = {env.spec.name: env for env in envs}
        if len(self._envs) != len(envs):
            raise ValueError(f"a domain is named twice: {[env.spec.name for env in envs]}")

    @property
    def members(self) -> list[DomainEnv]:
        return list(self._envs.values())

    @property
    def config(self) -> EnvConfig:
        """The protocol and limits, the same for every domain of the run."""
        return self.members[0].config

    @property
    def task_keys(self) -> list[str]:
        """Every task of every domain, domain by domain in the run's order."""
        return [task_key(env.spec.name, task_id) for env in self.members for task_id in env.domain.tasks]

    def key(self, task: Task) -> str:
        return task_key(task.domain, task.task_id)

    def env_of(self, key: str) -> DomainEnv:
        """The environment of the domain ``key`` names (``<domain>/<task id>``); any other key is a ``KeyError``
        that says what a key looks like here."""
        domain, _ = split_task_key(key)
        if domain not in self._envs:
            raise KeyError(
                f"Unknown task {key!r}: a run over several domains names a task <domain>/<task id>, the domain one "
                f"of {', '.join(self._envs)} (e.g. {self.task_keys[0]})"
            )
        return self._envs[domain]

    def task(self, key: str) -> Task:
        return self.env_of(key).task(split_task_key(key)[1])

    def base_of(self, key: str) -> CanonicalBase:
        return self.env_of(key).base

    def reset(self, key: str, seed: int = 0) -> Episode:
        """A fresh episode of the task ``key``; its record is filed under the key."""
        episode = self.env_of(key).reset(split_task_key(key)[1], seed)
        episode.record.task_id = key
        return episode

    def __reduce__(self) -> tuple[Any, ...]:
        return (MultiDomainEnv, (self.members,))


def run_env(
    specs: Sequence[DomainSpec],
    data_dir: str | Mapping[str, str | None] | None = None,
    config: EnvConfig | None = None,
) -> Any:
    """The environment of a run over ``specs``: the ``DomainEnv`` of one domain, a ``MultiDomainEnv`` of several.
    ``data_dir``: one directory (with several domains, a τ²-bench checkout's ``data/`` holding each one's files), or
    each domain's own (``EnvArguments.data_dirs``: ``--task_set``)."""
    if isinstance(data_dir, Mapping):
        envs = [DomainEnv(spec, data_dir.get(spec.name), config) for spec in specs]
        return envs[0] if len(envs) == 1 else MultiDomainEnv(envs)
    if data_dir is not None and len(specs) > 1:
        root = Path(data_dir) / "tau2" / "domains"
        missing = [spec.name for spec in specs if not (root / spec.tau2_domain).is_dir()]
        if missing:
            raise DomainDataError(
                f"--data_dir {data_dir}: with several domains it must be a τ²-bench checkout's data/ holding "
                f"tau2/domains/<domain> for each; missing: {', '.join(missing)}"
            )
    envs = [DomainEnv(spec, data_dir, config) for spec in specs]
    return envs[0] if len(envs) == 1 else MultiDomainEnv(envs)


RunEnv = DomainEnv | MultiDomainEnv
"""What a run plays in: one domain's environment or several behind one ``reset``."""


def run_split(env: RunEnv, name: str | None = None, path: str | None = None) -> Split:
    """The split ``name`` (each domain's default when not given) of the run's tasks: a domain's own split, or for
    several domains one split over their task keys, each domain's groups kept (``--split_file`` names one domain's
    file, so it needs a single domain)."""
    if isinstance(env, DomainEnv):
        return split_for(env.domain, name, path)
    if path is not None:
        raise SplitError("--split_file names one domain's split file: pass it with a single --domain")
    parts = [(member.spec.name, split_for(member.domain, name)) for member in env.members]

    def keyed(side: str) -> tuple[str, ...]:
        return tuple(task_key(domain, task_id) for domain, split in parts for task_id in getattr(split, side))

    names = sorted({split.name for _, split in parts})
    return Split(
        name=",".join(names),
        train=keyed("train"),
        test=keyed("test"),
        covered=keyed("covered"),
        description="; ".join(f"{domain}: {split.description or split.name}" for domain, split in parts),
    )
