"""A domain is one folder: nothing outside ``tau2_rl/domains/`` names a domain, and ``envs/`` imports none (issue 61).

τ²-bench's orchestrator, agents, user simulator and evaluator never import a domain; here neither do the episode
loop, the protocol, rendering, the trainer, the evaluation or the hub. They take a ``DomainSpec`` (or the task or
episode that carries one) from the registry, which the entry scripts fill from ``--domain``. Three checks:

1. no string literal outside ``tau2_rl/domains/`` names a domain (Python's tokenizer; docstrings and comments
   aside; a name is a whole word, so ``airline_rl``, the package's name before its rename, is not one);
2. no parameter or field below the entry scripts defaults to a domain: a forgotten pass-through must fail, not run
   one domain's prompt, vocabulary or data on another's episode;
3. ``envs/`` imports nothing from ``domains/`` (late imports included), and no module outside ``domains/`` imports a
   domain's folder: they reach a domain through the registry.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from tau2_rl.domains import DOMAINS, get_domain

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tau2_rl"
ENTRY_SCRIPTS = ("train_grpo.py", "train_sft.py", "evaluate.py", "collect_trajectories.py", "play.py",
                 "run_ablation.py", "plot_run.py", "launch.py")  # fmt: skip
DOMAIN_NAMES = {name for name in DOMAINS} | {get_domain(name).tau2_domain for name in DOMAINS} | {"telecom", "mock"}


def _outside_domains() -> list[Path]:
    files = [path for path in PACKAGE.rglob("*.py") if "domains" not in path.relative_to(PACKAGE).parts]
    return sorted(files) + [ROOT / name for name in ENTRY_SCRIPTS]


def _docstring_tokens(source: str) -> set[tuple[int, int]]:
    """Start positions of the string tokens that are docstrings (a module's, a class's, a function's) or bare string
    statements (the attribute docstrings below a field)."""
    starts = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            starts.add((node.lineno, node.col_offset))
    return starts


def domain_literals(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line: literal`` for every string literal that names a domain (docstrings and comments aside)."""
    source = path.read_text(encoding="utf-8")
    docstrings = _docstring_tokens(source)
    words = re.compile(r"\b(" + "|".join(sorted(DOMAIN_NAMES)) + r")\b", re.IGNORECASE)
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        kinds = {tokenize.STRING} | ({tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set())
        if token.type in kinds and token.start not in docstrings and words.search(token.string):
            found.append(f"{path.relative_to(root)}:{token.start[0]}: {token.string[:70]}")
    return found


def test_the_literal_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""The airline module (a docstring: not counted)."""\n'
        "# the airline, a comment: not counted\n"
        'NAME = "airline"\n'
        'LEGACY = "airline_rl_prompt.json"  # the old package name, one word: not counted\n'
        'def f(domain="retail"):\n'
        '    """Doc of retail: not counted."""\n'
        '    return f"{domain} telecom"\n',
        encoding="utf-8",
    )
    lines = [hit.split(":")[1] for hit in domain_literals(sample, tmp_path)]
    assert lines == ["3", "5", "7"]


def test_nothing_outside_the_domain_folders_names_a_domain() -> None:
    found = [hit for path in _outside_domains() for hit in domain_literals(path)]
    assert found == [], "\n".join(found)


_DOMAIN_PARAMETERS = re.compile(r"^(domain|domains|spec|specs|domain_spec)$")


def domain_defaults(path: Path) -> list[str]:
    """Parameters (and dataclass fields) named for a domain that default to anything but ``None``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
            for arg, default in pairs:
                none = isinstance(default, ast.Constant) and default.value is None
                if _DOMAIN_PARAMETERS.match(arg.arg) and not none:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}({arg.arg}=...)")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            if _DOMAIN_PARAMETERS.match(node.target.id) and _field_default(node.value) not in ("none", "cli"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: field {node.target.id} = ...")
    return found


def _field_default(value: ast.expr) -> str:
    """What a dataclass field defaults to: ``none`` (no default, or ``None``), ``cli`` (the registry's
    ``DEFAULT_DOMAIN``: a command line's ``--domain`` default) or ``other``."""
    default: ast.expr | None = value
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        keywords = {keyword.arg: keyword.value for keyword in value.keywords}
        default = keywords.get("default", keywords.get("default_factory"))
    if default is None or (isinstance(default, ast.Constant) and default.value is None):
        return "none"
    return "cli" if isinstance(default, ast.Name) and default.id == "DEFAULT_DOMAIN" else "other"


def test_no_parameter_below_the_entry_scripts_defaults_to_a_domain() -> None:
    """The command lines' ``--domain`` default is their config fields' ``DEFAULT_DOMAIN`` (the registry's); below
    them, a domain is handed down, never assumed."""
    below = [path for path in _outside_domains() if PACKAGE in path.parents]
    found = [hit for path in below for hit in domain_defaults(path)]
    assert found == [], "\n".join(found)


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def test_the_environment_imports_no_domain() -> None:
    envs = sorted((PACKAGE / "envs").rglob("*.py"))
    assert envs
    found = {
        str(path.relative_to(ROOT)): [name for name in _imports(path) if name.startswith("tau2_rl.domains")]
        for path in envs
    }
    assert {path: names for path, names in found.items() if names} == {}


def test_only_the_registry_is_imported_outside_the_domain_folders() -> None:
    """A module outside ``domains/`` may ask the registry (``tau2_rl.domains``) for a spec, never import a
    domain's folder."""
    folders = tuple(f"tau2_rl.domains.{name}" for name in DOMAINS)
    found = {
        str(path.relative_to(ROOT)): [name for name in _imports(path) if name.startswith(folders)]
        for path in _outside_domains()
    }
    assert {path: names for path, names in found.items() if names} == {}


def test_every_registered_domain_is_one_folder_with_its_spec() -> None:
    for name, module in DOMAINS.items():
        spec = get_domain(name)
        folder = PACKAGE / "domains" / (spec.variant_of or name)  # a policy variant lives in its domain's folder
        assert folder.is_dir() and (folder / "__init__.py").is_file()
        home = f"tau2_rl.domains.{spec.variant_of}." if spec.variant_of else None
        assert module == f"tau2_rl.domains.{name}" or (home is not None and module.startswith(home))
        assert spec.name == name and spec.module == module
        assert Path(spec.split_file()).parent == folder  # its split file lives in its folder


def test_a_run_prints_none_of_taus_import_warnings() -> None:
    """τ²'s package warns "No .env file found" through loguru on import; the project imports it quietly
    (``envs/protocol.py: quiet_tau2``), so a run's output holds only its own lines."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "play.py", "--domain", "mock", "--no_progress"], cwd=root,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "pass rate (oracle agent, scripted user): 9/9" in done.stdout
    assert ".env" not in done.stdout + done.stderr and "WARNING" not in done.stderr
