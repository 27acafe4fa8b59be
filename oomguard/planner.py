"""The dry-run planner's parts, for scripts that measure it: the benchmarks, or a study of one's own model.

Most users want :func:`oomguard.plan` (will a transformers model train on a device of a given size, and how) or
the guard's ``preplan=True``. Both are built from these, public so that a script can ask the planner the
questions they answer on the way:

- :data:`PRESETS` and :func:`load_config`: the architectures ``oomguard.plan`` knows by name (no weights, nothing
  downloaded), as transformers configs.
- :func:`device_overhead`: what a CUDA device adds to a tensor peak (its context, workspaces, the allocator's
  slack), which ``target="cuda"`` plans include.
- :class:`DeviceSpeed` and :func:`measure_speed`: the time model that ranks the plans that fit (pass one as
  ``oomguard.plan(..., speed=...)``), default or measured on this machine.
- :func:`dry_run`: one training step of any model, on fake tensors, on the plans given (or down the ladder); its
  :class:`~oomguard.PlanReport` holds each plan's predicted peak and time. Call it inside the
  ``FakeTensorMode`` that made the model, the optimizer and the batch.
- :func:`preplan`: what a guard would start on for a batch on this device (real model, real device or a
  :class:`~oomguard.testing.SimulatedGPU`): pass the guard's ``options`` (``OOMGuard(...).options``).

A sketch (the planner's tensor peak of a plan, on fake tensors)::

    from torch._subclasses.fake_tensor import FakeTensorMode
    from oomguard import Plan
    from oomguard.planner import dry_run

    with FakeTensorMode():
        model, batch = build_model(), make_batch()          # fakes: no memory, no time
        optimizer = torch.optim.AdamW(model.parameters())
        report = dry_run(lambda b: model(**b), batch, model=model, optimizer=optimizer, capacity=2**40,
                         target="cuda", label="mine", plans=[Plan(), Plan(precision="bf16")])
    peaks = [candidate.peak_bytes for candidate in report.candidates]
"""

# (a face over the private planner package, as oomguard.testing is over the simulator: nothing here of its own)
from oomguard._planner.engine import dry_run
from oomguard._planner.fakes import preplan
from oomguard._planner.presets import PRESETS, load_config
from oomguard._planner.report import device_overhead
from oomguard._planner.speed import DeviceSpeed, measure_speed

# (plain sorted order, as tests/test_public_api.py checks every public __all__; ruff would put PRESETS first)
__all__ = ["DeviceSpeed", "PRESETS", "device_overhead", "dry_run", "load_config", "measure_speed", "preplan"]  # noqa: RUF022
