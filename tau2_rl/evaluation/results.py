"""The results file of one evaluation (``results.json``), its resume logic and its markdown summary.

Schema (``format`` 1; docs/metrics.md documents every field)::

    {
      "format": 1,
      "config":   {...what was evaluated and how; FINGERPRINT_FIELDS must match to resume...},
      "metrics":  {...tau2_rl.evaluation.metrics.compute_metrics of "tasks"...},
      "tasks":    {"<task id>": {"group", "writes", "communicate", "refusal_passes", "successes", "valid_samples",
                                 "samples": [{"sample", "seed", "success", "reward": {...breakdown...}, "termination",
                                              "turns", "tool_calls", "tool_errors", "tool_error_kinds",
                                              "write_calls", "policy_tokens": [...per turn...], "truncated",
                                              "user_error", "agent_error" (served agents only)}, ...]}},
      "user_simulator": {...accounting summed over runs...},
      "runs":     [{"started", "seconds", "episodes", "timings", "user_simulator"}, ...],
      "updated":  "<ISO time>"
    }

Every save rewrites the whole file through a temporary file and ``os.replace`` (``run.hub.write_json_atomic``),
so an interrupted evaluation leaves the last complete save behind, never a torn file. A sample is keyed by
(task id, sample index); a rerun plays only the missing ones, and the ones whose user simulator failed.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tau2_rl.envs.data import domain_file_sha256
from tau2_rl.envs.episode import EpisodeRecord
from tau2_rl.envs.protocol import LEGACY_PROTOCOLS, TAU2_RL
from tau2_rl.rewards.outcome import empty_conversation_passes
from tau2_rl.run.hub import write_json_atomic

if TYPE_CHECKING:
    from tau2_rl.envs.data import Task
    from tau2_rl.envs.episode import Base
    from tau2_rl.envs.multi import RunEnv
    from tau2_rl.envs.spec import DomainSpec

from .metrics import GROUPS, compute_metrics, failed, refusal_passes
from .schema import SchemaError, check_results_types

FORMAT_VERSION = 1
RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.md"

FINGERPRINT_FIELDS = (
    "format",
    "agent",
    "model_path",
    "model_digest",
    "step",
    "backend",
    "dtype",
    "agent_endpoint",
    "domain",
    "split",
    "split_file",
    "data_dir",
    "task_set",
    "tasks",
    "num_samples",
    "seed",
    "temperature",
    "top_p",
    "max_new_tokens",
    "max_turn_tokens",
    "system_prompt",
    "protocol",
    "max_turns",
    "max_steps",
    "max_tool_errors",
    "user",
    "judge",
)
"""Config fields that change what an episode is: a results file is only resumed when all of them are equal."""

COUNTER_KEYS = ("requests", "replies", "cache_hits", "prompt_tokens", "completion_tokens", "retries", "failures")
LATENCY_KEYS = ("latency_p50", "latency_p90", "latency_p99")


class ResultsError(ValueError):
    """A results file cannot be used (unreadable, or written by another configuration); the message names it."""


class ConfigMismatchError(ResultsError):
    """A results file exists for a different configuration: it is refused, never overwritten."""


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def fingerprint_value(config: Mapping[str, Any], key: str) -> Any:
    """A fingerprint field of a config; files written before ``system_prompt`` was recorded prompted a model fully,
    files written before ``protocol`` was recorded played the ``tau2_rl`` protocol (named ``airline_rl`` before the
    package was renamed), and before ``domain`` was recorded the airline."""
    if key == "system_prompt" and key not in config and config.get("agent") == "model":
        return "full"
    if key == "protocol":
        protocol = config.get(key, TAU2_RL)
        return LEGACY_PROTOCOLS.get(protocol, protocol)
    if key == "domain" and key not in config:
        from tau2_rl.domains import legacy_domain

        return legacy_domain().name
    return config.get(key)


def config_differences(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """'field: file has X, this run has Y' for every fingerprint field that differs."""
    differences = []
    for key in FINGERPRINT_FIELDS:
        before, now = fingerprint_value(stored, key), fingerprint_value(current, key)
        if before != now:
            differences.append(f"{key}: file has {before!r}, this run has {now!r}")
    return differences


def read_results(path: str | Path) -> dict[str, Any]:
    """A results file as a dict; a missing, unreadable or malformed file raises ``ResultsError`` naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise ResultsError(f"results file {path} does not exist") from err
    except (OSError, ValueError) as err:
        raise ResultsError(f"results file {path} is unreadable ({err}); move it away to start over") from err
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("config"), dict)
        or not isinstance(data.get("tasks"), dict)
    ):
        raise ResultsError(f"results file {path} has no 'config' and 'tasks' sections; it is not an evaluation result")
    if data.get("format") != FORMAT_VERSION:
        raise ResultsError(f"results file {path} has format {data.get('format')!r}; this code reads {FORMAT_VERSION}")
    try:
        check_results_types(path, data)
    except SchemaError as err:
        raise ResultsError(str(err)) from None
    return data


def check_compatible(path: str | Path, config: Mapping[str, Any]) -> bool:
    """True when ``path`` holds results of this configuration, False when it does not exist; raises otherwise."""
    path = Path(path)
    if not path.exists():
        return False
    stored = read_results(path)["config"]
    differences = config_differences(stored, config)
    if differences:
        raise ConfigMismatchError(
            f"results file {path} was written by another configuration and is kept as is (not overwritten). "
            f"Differing fields: {'; '.join(differences)}. Pass another --output_dir or --eval_name, or rerun with "
            "the file's settings to resume it."
        )
    return True


def _prm_entry(record: EpisodeRecord, spec: DomainSpec) -> dict[str, Any]:
    """PRM-Lite's verdict on an evaluated episode (default rule set, default clip): what the within-group signal
    metrics (``prm_signal`` in the metrics) read, so an evaluation shows whether the process reward tracks success."""
    from tau2_rl.rewards.prm import DEFAULT_RULE_SET, score_episode, vocabulary
    from tau2_rl.rewards.prm.rules import POLICY_RULES

    result = score_episode(record, rules=DEFAULT_RULE_SET, spec=spec)
    entry = {"rules": DEFAULT_RULE_SET, "process_score": result.process_score, "rule_counts": result.rule_counts}
    if vocabulary(spec).policy is None:  # the domain has no policy checks: those rules are off, not "never fired"
        off = [rule for rule in POLICY_RULES if rule in result.rule_counts]
        entry["rule_counts"] = {k: v for k, v in result.rule_counts.items() if k not in off}
        entry["off"] = off
    return entry


def sample_entry(record: EpisodeRecord, sample: int, spec: DomainSpec, save_messages: bool = False) -> dict[str, Any]:
    """What a results file keeps of one episode (``spec``: its domain, whose vocabulary PRM-Lite's verdict uses)."""
    reward = dict(record.reward or {})
    entry: dict[str, Any] = {
        "sample": sample,
        "seed": record.seed,
        "success": float(reward.get("reward", 0.0)) >= 1.0,
        "reward": reward,
        "termination": record.termination,
        "turns": len(record.turns),
        "tool_calls": record.num_tool_calls,
        "tool_errors": record.num_tool_errors,
        "tool_error_kinds": dict(Counter(c.error_kind or "error" for c in record.tool_calls if c.error)),
        "write_calls": sum(1 for c in record.tool_calls if c.is_write),
        "policy_tokens": [t.num_policy_tokens for t in record.turns if t.num_policy_tokens is not None],
        "truncated": record.truncated,
        "user_error": record.user_error,
        **({"agent_error": record.agent_error} if record.agent_error else {}),
        "prm": _prm_entry(record, spec),
    }
    if save_messages:
        entry["messages"] = record.messages[1:]  # the system prompt is the same for every episode
    return entry


def task_meta(task: Task, group: str, base: Base, with_domain: bool = False) -> dict[str, Any]:
    """The per-task fields metrics need besides the samples (group, write stratum, the noop floor; its domain in a
    run over several).

    ``refusal_passes`` is what τ²'s reward gives the empty conversation (``empty_conversation_passes``: every term
    of the task's basis)."""
    writes = bool(task.writes)
    communicate = bool(task.communicate_info)
    passes = empty_conversation_passes(task, base)
    meta = {"group": group, "writes": writes, "communicate": communicate, "refusal_passes": passes}
    if with_domain:
        meta["domain"] = task.domain
    return meta


def domains_config(env: RunEnv) -> dict[str, Any]:
    """What a results file records of the run's domains: ``domain`` (``--domain``'s names) and the task set scored
    (``tasks_sha256``: a domain's tasks file; with several, one per domain, and each one's release)."""
    shas = {m.spec.name: domain_file_sha256(m.spec, m.data_dir, "tasks.json") for m in env.members}
    if len(env.members) == 1:
        (name,) = shas
        return {"domain": name, "tasks_sha256": shas[name]}
    return {
        "domain": ",".join(shas),
        "tasks_sha256": shas,
        "domains": {
            m.spec.name: {"tasks_sha256": shas[m.spec.name], "release": m.spec.release_of(m.data_dir)}
            for m in env.members
        },  # fmt: skip
    }


def split_group_sizes(split: Any) -> dict[str, int]:
    """Tasks per group of a split: the generalization weights (24 uncovered_seen, 10 unseen on the seed split)."""
    return {group: len(split.group(group)) for group in GROUPS}


def domain_group_sizes(env: RunEnv, split: Any) -> dict[str, dict[str, int]]:
    """Each domain's group sizes in a run over several (its own generalization weights); empty for one domain."""
    if len(env.members) < 2:
        return {}
    sizes: dict[str, dict[str, int]] = {}
    for group in GROUPS:
        for key in split.group(group):
            domain = env.task(key).domain
            sizes.setdefault(domain, dict.fromkeys(GROUPS, 0))[group] += 1
    return sizes


def metrics_of(data: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics of a results dict, recomputed from its samples with the settings in its config (bootstrap, the
    split's group sizes, the pass^k convention). An evaluation over several domains also gets each domain's metrics
    apart (``domains``: domain → the same metrics over its tasks, with its own group sizes)."""
    config = data["config"]

    def metrics(tasks: Mapping[str, Any], group_sizes: Mapping[str, int] | None) -> dict[str, Any]:
        return compute_metrics(
            tasks,
            int(config["num_samples"]),
            bootstrap_samples=int(config.get("bootstrap_samples") or 2000),
            confidence=float(config.get("confidence") or 0.95),
            seed=int(config.get("seed") or 0),
            group_sizes=group_sizes,
            pass_k_convention=str(config.get("pass_k_convention") or "tau2"),
        )

    overall = metrics(data["tasks"], config.get("group_sizes"))
    domains = sorted({entry["domain"] for entry in data["tasks"].values() if entry.get("domain")})
    if domains:
        sizes = config.get("domain_group_sizes") or {}
        overall["domains"] = {
            domain: metrics({k: v for k, v in data["tasks"].items() if v.get("domain") == domain}, sizes.get(domain))
            for domain in domains
        }
    return overall


def _merge_user_accounting(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters summed over runs; mean latency weighted by requests; percentiles: the largest per-run value."""
    stats = [r.get("user_simulator") or {} for r in runs]
    merged: dict[str, Any] = {"name": next((s.get("name") for s in reversed(stats) if s.get("name")), None)}
    timed = [s for s in stats if s.get("requests")]
    if not timed:
        return merged
    for key in COUNTER_KEYS:
        merged[key] = sum(int(s.get(key, 0)) for s in stats)
    requests = sum(int(s["requests"]) for s in timed)
    merged["latency_mean"] = sum(float(s.get("latency_mean", 0.0)) * int(s["requests"]) for s in timed) / requests
    for key in LATENCY_KEYS:
        merged[key] = max(float(s.get(key, 0.0)) for s in timed)
    return merged


class ResultsFile:
    """One evaluation's results on disk: load or create, add samples, save atomically with fresh metrics."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data

    @classmethod
    def open(
        cls,
        path: str | Path,
        config: Mapping[str, Any],
        tasks: Mapping[str, Mapping[str, Any]],
    ) -> ResultsFile:
        """The results at ``path`` if they belong to ``config`` (resumed), else fresh ones; raises on a mismatch."""
        path = Path(path)
        if check_compatible(path, config):
            data = read_results(path)
            data["config"] = {**data["config"], **dict(config)}  # non-fingerprint fields (label...) may be updated
        else:
            data = {"format": FORMAT_VERSION, "config": dict(config), "metrics": {}, "tasks": {}, "runs": []}
        for task_id, meta in tasks.items():
            entry = data["tasks"].setdefault(task_id, {"samples": []})
            entry.update(meta)
        return cls(path, data)

    @property
    def config(self) -> dict[str, Any]:
        return self.data["config"]

    def pending(self) -> list[tuple[str, int]]:
        """(task id, sample) pairs still to play: missing ones and those whose user simulator failed."""
        todo = []
        for task_id in self.config["tasks"]:
            done = {s["sample"] for s in self.data["tasks"][task_id]["samples"] if not failed(s)}
            todo.extend((task_id, sample) for sample in range(self.config["num_samples"]) if sample not in done)
        return todo

    def add(self, task_id: str, entry: dict[str, Any]) -> None:
        """Stores a sample, replacing an earlier one with the same index (a retried user-simulator failure)."""
        samples = [s for s in self.data["tasks"][task_id]["samples"] if s["sample"] != entry["sample"]]
        samples.append(entry)
        samples.sort(key=lambda s: s["sample"])
        self.data["tasks"][task_id]["samples"] = samples

    def add_run(self, run: dict[str, Any]) -> None:
        self.data.setdefault("runs", []).append(run)

    def refresh(self) -> None:
        """Recomputes per-task counts, the metrics and the user-simulator accounting from the samples."""
        for entry in self.data["tasks"].values():
            valid = [s for s in entry["samples"] if not failed(s)]
            entry["valid_samples"] = len(valid)
            entry["successes"] = sum(1 for s in valid if s.get("success"))
        self.data["metrics"] = metrics_of(self.data)
        self.data["user_simulator"] = _merge_user_accounting(self.data.get("runs", []))
        self.data["updated"] = now()

    def save(self) -> None:
        """Writes results.json and summary.md next to it, each atomically."""
        self.refresh()
        write_json_atomic(self.path, self.data)
        summary = self.path.with_name(SUMMARY_FILE)
        tmp = summary.with_name(f".{SUMMARY_FILE}.tmp")
        tmp.write_text(summary_markdown(self.data), encoding="utf-8")
        tmp.replace(summary)


# ---------------------------------------------------------------------------------------------------------------------
# markdown


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: '—' for a missing value, fixed decimals for floats."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def fmt_ci(entry: Mapping[str, Any] | None) -> str:
    if not entry or entry.get("ci_low") is None:
        return "—"
    return f"[{entry['ci_low']:.3f}, {entry['ci_high']:.3f}]"


PASS1_LABELS = {
    "overall": "overall",
    "covered_seen": "covered_seen",
    "uncovered_seen": "uncovered_seen",
    "unseen": "unseen",
    "generalization": "generalization (uncovered_seen + unseen)",
    "write": "tasks whose gold writes",
    "no_write": "tasks that need no write",
}


def _domain_lines(config: Mapping[str, Any]) -> list[str]:
    """What the tasks were: the domain(s) and each one's tasks file (sha256), and the model's training domains when
    they are not the evaluated ones."""
    shas = config.get("tasks_sha256")
    if isinstance(shas, Mapping):
        releases = {name: entry.get("release") for name, entry in (config.get("domains") or {}).items()}
        files = ", ".join(
            f"`{domain}` (tasks.json sha256 `{sha[:12]}…`"
            + (f"; {releases[domain]}" if releases.get(domain) else "")
            + ")"
            for domain, sha in shas.items()
        )
        lines = [f"- domains: {files}"]
    else:
        domain = fingerprint_value(config, "domain")
        lines = [f"- domain `{domain}`" + (f" (tasks.json sha256 `{shas[:12]}…`)" if shas else "")]
    trained = config.get("trained_on")
    evaluated = str(fingerprint_value(config, "domain")).split(",")
    if trained and not set(evaluated) <= set(trained):
        lines.append(f"- **trained on {', '.join(trained)}**, evaluated on {', '.join(evaluated)}")
    return lines


def describe_model(config: Mapping[str, Any]) -> str:
    name = config.get("label") or config.get("model")
    return f"{name} @ step {config['step']}" if config.get("step") is not None else str(name)


def summary_markdown(data: Mapping[str, Any]) -> str:
    """The human-readable summary written next to results.json."""
    config, metrics = data["config"], data.get("metrics") or {}
    n = config.get("num_samples")
    lines = [
        f"# Evaluation: {describe_model(config)}",
        "",
        f"- model: `{config.get('model')}`" + (f" (`{config['model_path']}`)" if config.get("model_path") else ""),
        *_domain_lines(config),
        f"- split `{config.get('split')}`, {len(config.get('tasks', []))} tasks × {n} samples; user simulator "
        f"`{(config.get('user') or {}).get('simulator')}`"
        + (
            f"; backend `{config['backend']}`, temperature {config.get('temperature')}"
            if config.get("backend")
            else f"; served at `{config['agent_endpoint']['base_url']}`, temperature {config.get('temperature')}"
            if config.get("agent_endpoint")
            else ""
        ),
        f"- episodes: {metrics.get('episodes', 0)} ({metrics.get('user_errors', 0)} user-simulator and "
        f"{metrics.get('agent_errors', 0)} agent-endpoint failures, left out "
        f"of every metric); complete: {fmt(metrics.get('complete', False))}",
        "",
        "## pass^1",
        "",
        "The noop floor is the pass^1 of refusing everything (no write, nothing said); "
        f"{config.get('confidence', 0.95):.0%} intervals are bootstrapped over tasks and samples.",
        "",
        "| slice | tasks | pass^1 | CI | noop floor |",
        "|---|---:|---:|---|---:|",
    ]
    pass1 = metrics.get("pass1") or {}
    floor = metrics.get("refusal_floor") or {}
    for key, label in PASS1_LABELS.items():
        entry = pass1.get(key) or {}
        lines.append(f"| {label} | {entry.get('tasks', 0)} | {fmt(entry.get('value'))} | {fmt_ci(entry)} | "
                     f"{fmt(floor.get(key))} |")  # fmt: skip
    domains = metrics.get("domains") or {}
    if domains:
        lines += [
            "",
            "## Domains",
            "",
            "Each domain's tasks apart (its own groups; the noop floor of its tasks).",
            "",
            "| domain | tasks | pass^1 | CI | generalization | noop floor |",
            "|---|---:|---:|---|---:|---:|",
        ]
        for domain, domain_metrics in domains.items():
            entry = (domain_metrics.get("pass1") or {}).get("overall") or {}
            general = (domain_metrics.get("pass1") or {}).get("generalization") or {}
            domain_floor = (domain_metrics.get("refusal_floor") or {}).get("overall")
            lines.append(f"| {domain} | {entry.get('tasks', 0)} | {fmt(entry.get('value'))} | {fmt_ci(entry)} | "
                         f"{fmt(general.get('value'))} | {fmt(domain_floor)} |")  # fmt: skip
    pass_k = metrics.get("pass_hat_k") or {}
    if pass_k:
        lines += ["", "## pass^k", "", "| k | " + " | ".join(pass_k) + " |", "|---|" + "---:|" * len(pass_k)]
        lines.append("| pass^k | " + " | ".join(fmt(v) for v in pass_k.values()) + " |")
        if metrics.get("pass_hat_k_convention") == "tau2":
            lines += ["", f"As τ² reports it: for k up to the smallest number of valid samples of a task "
                      f"({metrics.get('pass_hat_k_max')}); larger k are left out (—)."]  # fmt: skip
    terminations = ", ".join(f"{k}: {v}" for k, v in (metrics.get("terminations") or {}).items()) or "—"
    lines += [
        "",
        "## Behaviour",
        "",
        "| metric | value |",
        "|---|---:|",
        f"| error rate (share of episodes with ≥ 1 failed tool call) | {fmt(metrics.get('error_rate'))} |",
        f"| tool-call error rate (failed / all tool calls) | {fmt(metrics.get('tool_call_error_rate'))} |",
        f"| reasoning depth (p50 policy tokens per assistant turn) | {fmt(metrics.get('reasoning_depth_p50'), 1)} |",
        f"| turns per episode | {fmt(metrics.get('turns_per_episode'), 2)} |",
        f"| tool calls per episode | {fmt(metrics.get('tool_calls_per_episode'), 2)} |",
        f"| truncation rate (token budget) | {fmt(metrics.get('truncation_rate'))} |",
        f"| terminations | {terminations} |",
    ]
    user = data.get("user_simulator") or {}
    if user.get("requests"):
        lines += [
            "",
            "## User simulator",
            "",
            "| " + " | ".join(COUNTER_KEYS) + " | latency mean / p50 / p90 / p99 (s) |",
        ]
        lines.append("|" + "---:|" * (len(COUNTER_KEYS) + 1))
        latency = " / ".join(fmt(user.get(k)) for k in ("latency_mean", *LATENCY_KEYS))
        lines.append("| " + " | ".join(str(user.get(k, 0)) for k in COUNTER_KEYS) + f" | {latency} |")
    lines += ["", "## Groups", "", "| group | tasks |", "|---|---:|"]
    tasks = data.get("tasks") or {}
    for group in GROUPS:
        lines.append(f"| {group} | {sum(1 for t in tasks.values() if t.get('group') == group)} |")
    noop_tasks = sorted((t for t, e in tasks.items() if refusal_passes(e)), key=lambda t: (len(t), t))
    lines += ["", f"Tasks a refusal passes ({len(noop_tasks)}): {', '.join(noop_tasks) or '—'}", ""]
    return "\n".join(lines)
