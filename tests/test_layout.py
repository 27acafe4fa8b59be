"""The house rules of the package's layout (README, "Layout"), read from the source: no import cycle, policy that
touches no torch state (``_ladder/``: plans, the rungs' pure base and their registry; the built-in rungs, one
module each in ``_rungs/``, name their effects and ask the model through them), the planner beside the guard
rather than on top of it, no use of the test double in the library, small modules and functions, counted as
``ruff format`` writes them (a ``# fmt: skip`` does not make a module smaller)."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "oomguard"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60
#: Modules over a limit, and their owners, who are fixing them (issue 24): each mark comes off with its fix.


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


def _third_party(path: Path) -> set[str]:
    """The top-level names of what ``path`` imports from outside the package, at any depth."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_policy_knows_nothing_of_torch_state_and_the_planner_never_builds_a_guard() -> None:
    for path in (PACKAGE / "_ladder").glob("*.py"):
        assert "torch" not in _third_party(path), f"{path.name}: policy imports torch"
    ladder = {m for m in IMPORTS if m.startswith("oomguard._ladder")}
    assert all(name.startswith(("oomguard._ladder", "oomguard._errors")) for m in ladder for name in IMPORTS[m])
    # The rungs build on the policy and the effects; nothing below them (policy, mechanism) knows them.
    rungs = {m for m in IMPORTS if m.startswith("oomguard._rungs")}
    below = ("oomguard._ladder", "oomguard._effects", "oomguard._backends", "oomguard._errors", "oomguard._rungs")
    assert all(name.startswith(below) or name == "oomguard" for m in rungs for name in IMPORTS[m])
    assert not {m for m in _importers_of("oomguard._rungs") if m.startswith(("oomguard._ladder", "oomguard._effects"))}
    assert not {m for m in _importers_of("oomguard._guard") if m.startswith("oomguard._planner")}
    mechanism = {m for m in IMPORTS if m.startswith(("oomguard._effects", "oomguard._step", "oomguard._backends"))}
    assert not {m for m in mechanism if any(n.startswith(("oomguard._guard", "oomguard._planner")) for n in IMPORTS[m])}


_SKIP = re.compile(r"[ \t]*# fmt: skip[ \t]*$", re.MULTILINE)


def formatted(source: str, name: str = str(PACKAGE / "module.py")) -> str:
    """``source`` as ``ruff format`` writes it, every ``# fmt: skip`` taken out first."""
    ruff = [sys.executable, "-m", "ruff", "format", "--stdin-filename", name, "-"]
    return subprocess.run(ruff, input=_SKIP.sub("", source), capture_output=True, text=True, check=True).stdout


def function_lengths(source: str) -> dict[str, int]:
    """The lines of each function of ``source`` (qualified by its class), from ``def`` to its end, less its
    docstring: the documentation of a public function is not what makes it hard to read."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = child.body[0]
                documented = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
                docstring = first.end_lineno - first.lineno + 1 if documented and first.end_lineno else 0
                lengths[prefix + child.name] = (child.end_lineno or child.lineno) - child.lineno + 1 - docstring
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return lengths


@functools.cache
def _formatted_package() -> dict[str, str]:
    """Every module, relative to the package, as :func:`formatted` writes it (one ruff run over a copy)."""
    with tempfile.TemporaryDirectory() as folder:
        copies = {path.relative_to(PACKAGE).as_posix(): Path(folder) / path.relative_to(PACKAGE) for path in _modules()}
        for name, copy in copies.items():
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(_SKIP.sub("", (PACKAGE / name).read_text(encoding="utf-8")), encoding="utf-8")
        config = str(PACKAGE.parent / "pyproject.toml")  # (the project's line length, not ruff's default)
        subprocess.run(
            [sys.executable, "-m", "ruff", "format", "--config", config, folder], capture_output=True, check=True
        )
        return {name: copy.read_text(encoding="utf-8") for name, copy in copies.items()}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.subprocess
def test_the_counting_is_ruff_formats_and_a_format_skip_does_not_shrink_a_module() -> None:
    squeezed = "def f(a, b):\n    return [a,\n            b]  # fmt: skip\n"
    assert formatted(squeezed).count("\n") == 2, "the skip is ignored: the list is joined as ruff joins it"
    long_call = "def f():\n    return g(" + ", ".join(f"argument_{i}" for i in range(40)) + ")  # fmt: skip\n"
    assert formatted(long_call).count("\n") > 10, "a line ruff would split counts as the lines it splits into"
    source = 'def f():\n    """Docs\n\n    more docs."""\n    x = 1\n    return x\n\n\n'
    source += "class C:\n    def g(self):\n        pass\n"
    assert function_lengths(source) == {"f": 3, "C.g": 2}


@pytest.mark.subprocess
def test_modules_stay_small() -> None:
    sizes = {name: text.count("\n") for name, text in _formatted_package().items()}
    assert max(sizes.values()) <= MAX_MODULE_LINES, sorted(sizes.items(), key=lambda item: -item[1])[:3]


def _calls_and_writes(path: Path) -> tuple[set[str], set[str]]:
    """The methods ``path`` calls by name (``x.held()``), and what it writes of a call's record (``call.plan =``,
    ``call.tried.append(...)``, ``Call(...)``)."""
    called, written = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            called.add(node.func.attr)
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "call":
                written.add(f"call.{owner.attr}.{node.func.attr}()")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Call":
            written.add("Call()")
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "call":
                written.add(f"call.{target.attr} =")
    return called, written


def test_signals_are_held_and_delivered_and_the_call_record_written_by_the_recovery_loop_alone() -> None:
    """Issue 24: shutdown signals were held and delivered from eight places in five files, and the per-call record
    was written from four modules. Now both are the recovery loop's (``oomguard/_guard/loop.py``); the module
    that defines the holding (``interrupts.py``) and the record (``call.py``) aside."""
    holders, writers = set(), set()
    for path in PACKAGE.rglob("*.py"):
        called, written = _calls_and_writes(path)
        name = str(path.relative_to(PACKAGE))
        if {"held", "deliver"} & called and name != "_effects/interrupts.py":
            holders.add(name)
        if {w for w in written if not w.startswith("call.tried.") or w.endswith(("append()", "extend()"))}:
            writers.add(name)
    assert holders == {"_guard/loop.py"}
    assert writers == {"_guard/loop.py"}


@pytest.mark.subprocess
def test_functions_stay_small() -> None:
    long = {
        f"{name}:{function}": lines
        for name, text in _formatted_package().items()
        for function, lines in function_lengths(text).items()
        if lines > MAX_FUNCTION_LINES
    }
    assert not long, long


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
