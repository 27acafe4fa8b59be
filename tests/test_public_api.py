"""The public surface: a sorted, complete __all__, and a docstring on everything in it."""

from __future__ import annotations

import inspect
import types

import oomguard
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
