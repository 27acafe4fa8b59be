"""The house rules of the package's layout (README, "Layout"), read from the source: no import cycle, policy that
touches no torch state, the planner beside the guard rather than on top of it, no use of the test double in the
library, small modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "oomguard"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every module of the package and the modules it imports, at any depth (functions, TYPE_CHECKING included)."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[_module(path)] = names
    return {module: {name for name in names if name in found and name != module} for module, names in found.items()}


IMPORTS = _imports()


def test_no_module_imports_itself_round_a_loop() -> None:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(IMPORTS[module]):
            if imported == "oomguard":  # the package's face: its own imports are checked as modules
                continue
            if state.get(imported) == 1:
                cycles.append([*path[path.index(imported) :], imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(IMPORTS):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def _importers_of(prefix: str) -> set[str]:
    return {module for module, names in IMPORTS.items() if any(name.startswith(prefix) for name in names)}


def test_only_the_test_double_itself_uses_oomguard_testing() -> None:
    assert {m for m in _importers_of("oomguard.testing") if not m.startswith("oomguard.testing")} == set()


def test_policy_knows_nothing_of_torch_state_and_the_planner_never_builds_a_guard() -> None:
    for path in (PACKAGE / "_ladder").glob("*.py"):
        source = path.read_text(encoding="utf-8")
        assert "import torch" not in source, f"{path.name}: policy imports torch"
    ladder = {m for m in IMPORTS if m.startswith("oomguard._ladder")}
    assert all(name.startswith(("oomguard._ladder", "oomguard._errors")) for m in ladder for name in IMPORTS[m])
    assert not {m for m in _importers_of("oomguard._guard") if m.startswith("oomguard._planner")}
    mechanism = {m for m in IMPORTS if m.startswith(("oomguard._effects", "oomguard._step", "oomguard._backends"))}
    assert not {m for m in mechanism if any(n.startswith(("oomguard._guard", "oomguard._planner")) for n in IMPORTS[m])}


def test_modules_stay_small() -> None:
    sizes = {path.name: len(path.read_text(encoding="utf-8").splitlines()) for path in PACKAGE.rglob("*.py")}
    assert max(sizes.values()) <= 400, sorted(sizes.items(), key=lambda item: -item[1])[:3]


SCRIPTS = [PACKAGE.parent / "examples", PACKAGE.parent / "benchmarks"]
# Micro-benchmarks whose figure is the cost of one private mechanism: no public name can stand in for what they
# time, so they import it by its private name, and say so here (a file in this list that stops doing so fails).
TIMES_A_PRIVATE_MECHANISM = {
    "benchmarks/master_weights.py": "the master level's checksums (oomguard._effects.fingerprint)",
    "benchmarks/trainer_records.py": "OOMGuardTrainer's per-attempt snapshot (oomguard.integrations._rollback)",
}


def _is_private(name: str) -> bool:
    """``oomguard._cli.data``, ``oomguard.integrations._rollback``: a dotted part after oomguard's own starts with _."""
    parts = name.split(".")
    return parts[0] == "oomguard" and any(part.startswith("_") for part in parts[1:])


def _private_imports(path: Path) -> list[str]:
    """Every private oomguard module (or name) ``path`` imports, at any depth: ``import oomguard._x``,
    ``from oomguard._x import y``, ``from oomguard import _x``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names = [node.module] if _is_private(node.module) else [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        found.extend(f"{where}: {name}" for name in names if _is_private(name))
    return found


def test_examples_and_benchmarks_use_public_names_only() -> None:
    """What a user copies from examples/ or benchmarks/ works on the public surface alone (a private module may
    change in any release)."""
    paths = {str(path.relative_to(PACKAGE.parent)): path for folder in SCRIPTS for path in folder.rglob("*.py")}
    assert paths, "no example or benchmark found"
    private = [line for name, path in sorted(paths.items()) for line in _private_imports(path)]
    forbidden = [line for line in private if line.split(":")[0] not in TIMES_A_PRIVATE_MECHANISM]
    assert not forbidden, "\n".join(forbidden)
    stale = {name for name in TIMES_A_PRIVATE_MECHANISM if name not in paths or not _private_imports(paths[name])}
    assert not stale, f"listed as timing a private mechanism, but import none (take them off the list): {stale}"


TESTS = PACKAGE.parent / "tests"
# What starts a Python process in a test: the subprocess module, a fork, the interpreter's path, helpers.launch.
STARTS_A_PROCESS = {"subprocess", "os.fork", "sys.executable", "launch"}


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The ``pytest.mark.<name>`` names among ``decorators`` (or a ``pytestmark`` value's elements)."""
    return {node.attr for d in decorators for node in ast.walk(d) if isinstance(node, ast.Attribute)} - {"mark"}


def _module_marks(tree: ast.Module) -> set[str]:
    """The marks a module's ``pytestmark = ...`` puts on every test in it."""
    values = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets)
    ]
    return _marks(values)


def _process_starters(tree: ast.Module) -> set[str]:
    """The module's top-level functions that start a Python process: directly, or through another of its functions
    or a fixture of its own that does."""
    uses: dict[str, set[str]] = {}
    for function in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
        names = {arg.arg for arg in function.args.args}  # (the fixtures it asks for)
        for node in ast.walk(function):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                names.add(f"{node.value.id}.{node.attr}")
        uses[function.name] = names
    starters = {name for name, names in uses.items() if names & STARTS_A_PROCESS}
    while True:  # (through the module's own helpers and fixtures, at any depth)
        more = {name for name, names in uses.items() if names & starters} - starters
        if not more:
            return starters
        starters |= more


def test_every_test_that_starts_a_process_is_marked_so() -> None:
    """``pytest -m "not integration and not slow"`` runs the fast core; ``-m "not subprocess"`` also leaves out the
    tests that start processes (gloo ranks, torchrun, the CLI, killed writers). A test that starts one says so."""
    unmarked: list[str] = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module, starters = _module_marks(tree), _process_starters(tree)
        tests = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
        for test in tests:
            if test.name in starters and "subprocess" not in module | _marks(test.decorator_list):
                unmarked.append(f"{path.name}::{test.name}")
    assert not unmarked, f"start a process but are not marked @pytest.mark.subprocess: {unmarked}"
