"""The public surface: a sorted, complete __all__, and a docstring on everything in it."""

from __future__ import annotations

import inspect
import types

import oomguard
import oomguard.planner
import oomguard.testing


def test_all_is_sorted_and_complete() -> None:
    for module in (oomguard, oomguard.testing):
        assert module.__all__ == sorted(module.__all__), f"{module.__name__}.__all__ is not sorted"
        public = {
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"
        }
        assert public == set(module.__all__), f"{module.__name__}: exported names differ from __all__"


def test_every_public_name_is_documented() -> None:
    for name in [*oomguard.__all__, "testing.SimulatedGPU"]:
        value = oomguard.testing.SimulatedGPU if name.startswith("testing.") else getattr(oomguard, name)
        assert inspect.getdoc(value), f"oomguard.{name} has no docstring"


def test_the_contracted_names_exist() -> None:
    for name in ("oom_guard", "is_oom", "LadderExhausted", "StepResult", "OOMGuard"):
        assert hasattr(oomguard, name)
    assert {"loss", "micro_batch_size", "rungs", "ooms"} <= set(oomguard.StepResult.__dataclass_fields__)


def test_the_decorator_and_the_guard_show_every_option_in_their_signatures() -> None:
    """The options are written once (a frozen dataclass); help() and IDEs still see each one as a keyword."""
    decorator = inspect.signature(oomguard.oom_guard).parameters
    guard = inspect.signature(oomguard.OOMGuard).parameters
    assert next(iter(decorator)) == "fn" and next(iter(guard)) == "step_fn"
    for name in ("model", "optimizer", "scheduler", "ladder", "max_attempts", "state_file", "relax_after", "preplan"):
        assert decorator[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert guard[name] == decorator[name], name
    assert (decorator["max_attempts"].default, decorator["relax_after"].default) == (256, 200)
    assert decorator["model"].default is inspect.Parameter.empty, "model= is required"


def test_the_public_modules_beside_the_package_list_and_document_every_name() -> None:
    """``oomguard.testing`` (the simulator, offline text, the demo's model) and ``oomguard.planner`` (the dry-run
    planner's parts): what examples and benchmarks import instead of private modules."""
    for module in (oomguard.testing, oomguard.planner):
        assert module.__all__ == sorted(module.__all__), f"{module.__name__}.__all__ is not sorted"
        public = {name for name, value in vars(module).items() if not name.startswith("_")}
        public -= {name for name, value in vars(module).items() if isinstance(value, types.ModuleType)}
        assert public == set(module.__all__), f"{module.__name__}: exported names differ from __all__"
        for name in module.__all__:
            value = getattr(module, name)
            if callable(value):  # (a constant such as PRESETS is described in the module's docstring)
                assert inspect.getdoc(value), f"{module.__name__}.{name} has no docstring"
    assert {"stdlib_text", "text_batches", "demo_model", "DemoConfig", "format_bytes"} <= set(oomguard.testing.__all__)
