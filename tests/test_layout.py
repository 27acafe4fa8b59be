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
