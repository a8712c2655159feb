"""The project's modules do not import each other in a circle, type-checking imports included.

A circle between two modules means neither is one concept on its own (the held-out evaluation and the trainer were
one: the trainer runs the evaluation, the evaluation named the trainer's class; it now names the ``EvaluatingTrainer``
protocol instead). Imports inside functions are the deliberate way to load an optional or heavy dependency late; they
count too, in a test of their own, so that a late import cannot hide a circle (the rollout worker's took the trainer's
``_max_context``, issue 51.6).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tau2_rl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Module-level imports, and those of module-level ``if`` blocks (``if TYPE_CHECKING:``, version switches)."""
    nodes: list[ast.stmt] = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.If):
            nodes += node.body + node.orelse
        elif isinstance(node, ast.Try):
            nodes += node.body + [stmt for handler in node.handlers for stmt in handler.body]
    return [node for node in nodes if isinstance(node, (ast.Import, ast.ImportFrom))]


def _every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of the module, those inside functions included."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_graph(late: bool = False) -> dict[str, set[str]]:
    """Project module -> the project modules it imports at module level (``late``: anywhere, inside functions too)."""
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    imports = _every_import if late else _top_level_imports
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            graph[name].update(t for t in targets if t in graph and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    graph = import_graph()
    assert "tau2_rl.evaluation.heldout" in graph and "tau2_rl.trainers.multiturn_grpo" in graph
    assert "tau2_rl.evaluation.heldout" in graph["tau2_rl.trainers.multiturn_grpo"]  # the edge that stays
    assert circles(graph) == []


def test_late_imports_close_no_circle_either() -> None:
    """The worker (``generation_ahead``) and the trainer (``multiturn_grpo``) imported each other, the worker late:
    what both need (``policy_max_context``) now lives below both, in ``tau2_rl.rollout``."""
    graph = import_graph(late=True)
    assert "tau2_rl.trainers.generation_ahead" in graph["tau2_rl.trainers.multiturn_grpo"]
    assert "tau2_rl.rollout" in graph["tau2_rl.trainers.generation_ahead"]
    assert circles(graph) == []


def _imports_of(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The modules of ``package`` (and its subpackages) with the project modules each imports at module level."""
    return {name: targets for name, targets in graph.items() if name == package or name.startswith(package + ".")}


def _into(targets: set[str], package: str) -> set[str]:
    return {t for t in targets if t == package or t.startswith(package + ".")}


def test_the_domain_does_not_import_the_run_machinery() -> None:
    """``envs/`` and ``rewards/`` are what an episode and a reward are, for every domain; ``run/`` (flags, console,
    guards, hub, sharding) sits above them and is free to change without touching either."""
    graph = import_graph()
    assert "tau2_rl.run.training_run" in graph and "tau2_rl.envs.runner" in graph
    offending = {
        name: sorted(_into(targets, "tau2_rl.run"))
        for domain in ("tau2_rl.envs", "tau2_rl.rewards")
        for name, targets in _imports_of(graph, domain).items()
        if _into(targets, "tau2_rl.run")
    }
    assert offending == {}


def test_the_environment_imports_neither_rewards_nor_trainers() -> None:
    """``rewards/`` reads what ``envs/`` records, and the trainers use both: an edge from ``envs/`` back up would
    make the layers one. The episode loop gets its scorer from its caller (``run_episodes(..., score=...)``)."""
    graph = import_graph()
    offending = {
        name: sorted(_into(targets, "tau2_rl.rewards") | _into(targets, "tau2_rl.trainers"))
        for name, targets in _imports_of(graph, "tau2_rl.envs").items()
        if _into(targets, "tau2_rl.rewards") | _into(targets, "tau2_rl.trainers")
    }
    assert offending == {}


def test_configs_do_not_import_the_trainers() -> None:
    """The configs are read by every script and by the trainers; the variant table they check lives beside them."""
    graph = import_graph()
    assert _into(graph["tau2_rl.configs"], "tau2_rl.trainers") == set()


def test_the_package_root_holds_no_run_plumbing() -> None:
    """The root holds the domain's shared pieces (configs, rendering, rollouts, sampling, file writes); the run
    machinery lives in ``run/`` (issue 32's layout)."""
    root = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert root == {"configs", "files", "learning_gain", "render", "rollout", "sampling", "variants"}
    assert {path.stem for path in (PACKAGE / "run").glob("*.py")} >= {"cli", "console", "guard", "hub", "stop"}


def test_the_run_machinery_reaches_into_neither_evaluation_nor_the_driver() -> None:
    """``run/`` sits below ``evaluation/`` and ``experiment/`` (which use it); the summary's learning gain and the
    variant names they share live in root modules below all three. Imports inside functions count here too."""
    offending = {}
    for path in sorted((PACKAGE / "run").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("tau2_rl.evaluation", "tau2_rl.experiment")
            ):
                offending.setdefault(path.name, []).append(node.module)
    assert offending == {}


def test_the_driver_and_the_configs_share_one_variant_table() -> None:
    from tau2_rl import configs, experiment, variants

    assert configs.VARIANTS is variants.VARIANTS
    assert experiment.ALL_VARIANTS == tuple(variants.VARIANTS) == ("vanilla", "turn_discount", "prm_lite", "lata",
                                                                   "joint")  # fmt: skip


def test_the_entry_scripts_that_only_wire_stay_within_150_lines() -> None:
    """House style: an entry script parses, wires and calls; what it builds lives in the package
    (``trainers/grpo_run``, ``trainers/sft_run``). train_grpo.py had grown to 153 lines (issue 51.6)."""
    lengths = {name: len((PACKAGE.parent / name).read_text(encoding="utf-8").splitlines())
               for name in ("train_grpo.py", "train_sft.py", "evaluate.py")}  # fmt: skip
    assert all(length <= 150 for length in lengths.values()), lengths
