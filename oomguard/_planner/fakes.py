"""``preplan=True``: before the first step, plan the user's own step on fake copies of its model and batch.

The model's parameters and buffers are swapped, in place, for fake tensors of the same shapes (so the user's
step function, which calls the real model object, runs on them), the optimizer is rebuilt over the fakes with
the same options, and the batch is faked too. :func:`oomguard._planner.engine.dry_run` then walks the ladder on them
within the memory that is free for this model; the real tensors are put back before anything else runs.
Nothing real is computed or allocated on the device.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.optim.optimizer as torch_optimizer
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from oomguard._backends.dispatch import tensors_of
from oomguard._backends.memory import MemoryBackend
from oomguard._backends.units import available_bytes, format_bytes, requested_bytes, rounding_of_figures
from oomguard._bitsandbytes import fake_parameter
from oomguard._distributed.agreement import ddp_of, quiet_ddp
from oomguard._effects.blocks import find_blocks
from oomguard._effects.effects import Effects
from oomguard._effects.sharding import is_fsdp
from oomguard._ladder.plan import Phase, Plan
from oomguard._options import GuardOptions
from oomguard._planner.compose import Traces, uniform_blocks
from oomguard._planner.engine import Residue, ShallowModel, dry_run
from oomguard._planner.isolation import Kept, leftovers
from oomguard._planner.report import CUDA_CONTEXT_BYTES, Candidate, PlanReport, Target
from oomguard._planner.speed import DeviceSpeed
from oomguard._step.batch import map_tensors

__all__ = ["MAX_SECONDS", "memory_was_short", "planning_capacity", "preplan"]

logger = logging.getLogger("oomguard")
#: A bound on one dry run of the guard's (the jump, preplan, tuning), so that a step that cannot be planned never
#: stalls training for long; past it the guard walks the ladder.
MAX_SECONDS = 600.0
#: Step functions whose dry run left fake tensors behind: never planned again.
_LEAKY: weakref.WeakSet[Callable[[Any], Any]] = weakref.WeakSet()


def preplan(
    step_fn: Callable[[Any], Any],
    batch: Any,
    options: GuardOptions,
    backend: MemoryBackend,
    *,
    bf16: bool,
    purpose: str = "preplan",
    search_around: Plan | None = None,
    speed: DeviceSpeed | None = None,
    plans: Sequence[Plan] | None = None,
    effects: Effects | None = None,
    host_budget: int | None = None,
    search_seconds: float | None = None,
    known: dict[Plan, Candidate] | None = None,
    traces: Traces | None = None,
    failed: tuple[Plan, Phase] | None = None,
) -> PlanReport | None:
    """The planner's answer for a guard's step on this device, or None (logged) where it cannot tell.

    ``purpose`` names the caller in the log lines: ``"preplan"`` (before the first step), ``"jump"`` (after the
    first OOM of a batch bucket; it passes the plan that ran out of memory and the phase, ``failed``, which the walk
    starts past: :func:`~oomguard._planner.walk.walk`) or ``"tuning"`` (which passes ``search_around``, the plan a
    bucket settled on, the ``speed`` of the device measured, at most ``search_seconds``, reusing the plans measured
    in ``known`` and the shallow steps in ``traces``: :class:`~oomguard._planner.search.SearchBudget`). ``plans``
    measures just those (a benchmark's). ``effects``, the guard's, step aside while the planner runs (the model as
    the user made it; nothing moves). ``host_budget``: the guard's; a plan whose host bytes are past it does not
    fit.

    The dry run leaves nothing behind (:mod:`oomguard._planner.isolation`): what the step and the model keep is
    put back after it; where fake tensors escape all the same, the step is not planned again.
    """
    if is_fsdp(options.model):  # (its dry run would run FSDP's all-gathers on fake tensors, outside any agreement)
        logger.info("%s: not for a model sharded with fully_shard (FSDP2) yet", purpose)
        return None
    if step_fn in _LEAKY:
        logger.info("%s: off for this step, whose dry run kept fake tensors (see the warning then)", purpose)
        return None
    model = options.model
    device = next(model.parameters()).device
    capacity = planning_capacity(options, backend)
    if capacity is None:
        logger.info("%s: no device memory to plan for (%s)", purpose, device)
        return None
    target: Target = "simulated" if backend.tracks_allocations else "cuda"
    residue = Residue()
    report, failure = None, None
    try:
        # (under DDP, as the guard's own attempts: no collective in forward or backward, each rank plans alone)
        with _collector_paused(), _stepped_aside(effects), _isolated(model, step_fn), quiet_ddp(ddp_of(model)):
            report = _dry_run(step_fn, batch, options, capacity, target, device, residue, bf16=bf16,
                              search_around=search_around, speed=speed, plans=plans, host_budget=host_budget,
                              search_seconds=search_seconds, known=known, traces=traces,
                              failed=failed)  # fmt: skip
    except Exception as error:  # a step the planner cannot run on fake tensors (an output sized by values, say)
        failure = f"{type(error).__name__}: {error}"
    # (outside the except block: its traceback, which holds the dry run's frames and their fakes, is gone)
    searched = search_around is not None or plans is not None
    return _answer(report, failure, leftovers(residue.storages), step_fn, purpose, capacity, searched)


def planning_capacity(options: GuardOptions, backend: MemoryBackend) -> int | None:
    """The device memory a dry run of the guard's step plans in now: what this process may use, less what is in
    use besides the model and the optimizer state (which the planner measures itself); None where there is no
    device memory to plan for (a CPU without the simulator)."""
    total = backend.total_memory()
    device = next(options.model.parameters()).device
    if total is None or not (backend.tracks_allocations or device.type == "cuda"):
        return None
    target: Target = "simulated" if backend.tracks_allocations else "cuda"
    resident = _resident_bytes(backend, options.model, options.optimizer)
    return _limit(total, device, target) - (backend.memory_allocated() - resident)


def _answer(
    report: PlanReport | None,
    failure: str | None,
    escaped: list[str],
    step_fn: Callable[[Any], Any],
    purpose: str,
    capacity: int,
    searched: bool,
) -> PlanReport | None:
    """What a dry run's outcome tells the guard: its report, or None (logged) where fake tensors escaped or the
    dry run failed. (``searched``: tuning's or a benchmark's own plans, whose report is theirs to read.)"""
    if escaped:
        _LEAKY.add(step_fn)
        logger.warning(
            "%s: the dry run of this step left fake tensors behind, at %s: state kept where the planner cannot put "
            "it back. The planner is off for this step from now on (the guard walks the ladder); a real step that "
            "computes on such a tensor raises LossError instead of training on it. Keep such state in module "
            "attributes or buffers, the step's closure or its own globals, or pass predictive=False, "
            "tune_after=None",
            purpose,
            ", ".join(escaped),
        )
        return None
    if failure is not None:
        logger.warning(
            "%s: the dry run of this step failed (%s); walking the ladder instead. Fake tensors hold no values: "
            "reads of them get placeholders (1.0, 1, False), but an output sized by values (torch.unique, say) or "
            "a step that fails on a placeholder cannot be planned.",
            purpose,
            failure,
        )
        return None
    if report is None or searched:
        return report
    if report.recommended is None:
        logger.warning("%s: no plan on the ladder fits %s", purpose, format_bytes(capacity))
    else:
        logger.log(
            logging.DEBUG,  # (the guard's event says it: a jump's fallback event, preplan's planned event)
            "%s: starting on %s (predicted peak %s of %s available)",
            purpose,
            report.recommended.describe(report.batch_size),
            format_bytes(report.predicted_peak_bytes + report.device_overhead_bytes),
            format_bytes(capacity),
        )
    return report


def _dry_run(
    step_fn: Callable[[Any], Any], batch: Any, options: GuardOptions, capacity: int, target: Target,
    device: torch.device, residue: Residue, **planning: Any,
) -> PlanReport:  # fmt: skip
    """:func:`dry_run` on fake copies of the guard's model, optimizer and batch (which no frame holds after)."""
    model = options.model
    stepped = stepped_every_parameter(options.optimizer)  # (read before the fakes replace the parameters)
    with _faked(model, options.optimizer, batch, cuda=device.type == "cuda") as (fake_optimizer, fake_batch):
        return dry_run(
            step_fn, fake_batch, model=model, optimizer=fake_optimizer, capacity=capacity, target=target,
            label=type(model).__name__, ladder=options.rungs.rungs, max_grad_norm=options.max_grad_norm,
            residue=residue, max_seconds=MAX_SECONDS, shallow=_shallow(step_fn, model, fake_optimizer),
            every_parameter_steps=stepped, **planning,
        )  # fmt: skip


def stepped_every_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the real steps so far made ``optimizer`` state for every parameter it trains: then the dry run's
    warm-up need only be an optimizer step (see :meth:`~oomguard._planner.bench.StepBench.warm`). False before
    the first step, and where the step leaves a parameter without a gradient (a real step makes it no state)."""
    trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return bool(trained) and all(optimizer.state.get(p) for p in trained)


def _shallow(
    step_fn: Callable[[Any], Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> Callable[[int], ShallowModel] | None:
    """``dry_run``'s ``shallow`` for the guard's own model: the step function calls that model object, so a
    shallow copy is the model itself with its block container cut to the first ``n`` blocks while it runs, and an
    optimizer of the same class and options over what is left (None: the model has no block container)."""
    container = _block_container(model)
    if container is None or not uniform_blocks(getattr(model, "config", None)):
        return None

    def make(blocks: int) -> ShallowModel:
        with _cut(container, blocks):
            kept = {id(p) for p in model.parameters()}
        groups = [{**g, "params": [p for p in g["params"] if id(p) in kept]} for g in optimizer.param_groups]
        fewer: torch.optim.Optimizer = cast(Any, type(optimizer))(groups)
        return ShallowModel(step_fn, model, fewer, around=lambda: _cut(container, blocks))

    return make


def _block_container(model: torch.nn.Module) -> torch.nn.Module | None:
    """The ``ModuleList`` (or ``Sequential``) that holds the model's repeated blocks, if one holds them all."""
    blocks = find_blocks(model)
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and list(module.children()) == blocks:
            return module
    return None


@contextlib.contextmanager
def _cut(container: torch.nn.Module, blocks: int) -> Iterator[None]:
    """``container`` holding its first ``blocks`` blocks only, inside the block."""
    whole = dict(container._modules)
    try:
        container._modules = dict(list(whole.items())[:blocks])
        yield
    finally:
        container._modules = whole


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused inside the block (as it was after). A dry run makes and drops
    objects by the hundred thousand, so the collector would run several times inside it, now and then a full pass
    over every object of the process (0.1-0.2 s with transformers loaded): the longest of a job's calls would be
    longer still by chance. Its garbage, all of it young, is collected after it (:func:`leftovers`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _stepped_aside(effects: Effects | None) -> Iterator[None]:
    """The guard's effects out of the planner's way (see :meth:`Effects.suspended`), if there are any."""
    if effects is None or not effects.holds:
        yield
        return
    with effects.suspended():
        yield


@contextlib.contextmanager
def _isolated(model: torch.nn.Module, step_fn: Callable[[Any], Any]) -> Iterator[None]:
    """What the step and the model keep, put back after the block; torch's global optimizer hooks (a user's step
    counter, a profiler) do not see the planner's fake steps meanwhile."""
    kept = Kept(model, step_fn)
    hooks: tuple[dict[int, Any], ...] = (
        torch_optimizer._global_optimizer_pre_hooks,
        torch_optimizer._global_optimizer_post_hooks,
    )
    saved = [dict(table) for table in hooks]
    for table in hooks:
        table.clear()
    try:
        yield
    finally:
        for table, entries in zip(hooks, saved, strict=True):
            table.update(entries)
        kept.restore()


def memory_was_short(message: str, device: torch.device) -> bool:
    """Whether an OOM asked for more than its message says was available: a shortage the planner can plan
    around, not fragmentation or an injected fault (where the planner would only say the plan fits). True where
    the message does not say, or a per-process cap on CUDA makes the device's free figure meaningless; and where
    its rounded figures cannot tell the two apart ("Tried to allocate 4.0 MiB ... of which 4.0 MiB is free": the
    allocation failed, so the request was the larger)."""
    requested, available = requested_bytes(message), available_bytes(message)
    capped = device.type == "cuda" and getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device) < 1
    if requested is None or available is None or capped:
        return True
    return requested + rounding_of_figures(message) > available


def _limit(total: int, device: torch.device, target: Target) -> int:
    """The device memory this process may use: a per-process cap set on CUDA applies to tensors only."""
    if target == "cuda":
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
        if fraction < 1.0:
            return min(total, int(fraction * total) + CUDA_CONTEXT_BYTES)
    return total


def _resident_bytes(backend: MemoryBackend, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Device bytes held by the model and the optimizer state: the planner measures these itself."""
    state = [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    # (a quantized weight's: its codes; a bitsandbytes 4-bit weight's: its quantization state too)
    plain = tensors_of(model) + tensors_of(state)
    storages = {id(t.untyped_storage()): t.untyped_storage() for t in plain if backend.is_device(t)}
    return sum(int(s.nbytes()) for s in storages.values())


@contextlib.contextmanager
def _faked(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, cuda: bool
) -> Iterator[tuple[torch.optim.Optimizer, Any]]:
    """Inside a ``FakeTensorMode``: ``model`` with fake parameters and buffers, an optimizer and a batch over fakes.

    The simulator's accounting (if any) must not see the fakes: every dispatch mode is left while planning.
    """
    # (allow_non_fake_inputs: a real tensor the step closes over, the Trainer's item count say, is a constant)
    with _disable_current_modes(), FakeTensorMode(allow_non_fake_inputs=True):
        fakes: dict[int, torch.Tensor] = {}

        def fake(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in fakes:  # on the CPU: the planner's accounting tracks CPU tensors
                made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
                if isinstance(tensor, torch.nn.Parameter):  # (a bitsandbytes 4-bit weight's: a stand-in)
                    made = fake_parameter(tensor, made, fake)
                fakes[id(tensor)] = made
            return fakes[id(tensor)]

        with _swapped(model, fake):
            fake_batch = map_tensors(fake, batch)  # (a BatchEncoding's too: a leaf to torch's pytree)
            yield _rebuilt(optimizer, fake, cuda=cuda), fake_batch


@contextlib.contextmanager
def _swapped(model: torch.nn.Module, fake: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Replace every parameter and buffer of ``model`` by its fake, in place; put the real ones back after."""
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, tensor in list(table.items()):
                    if tensor is not None:
                        saved.append((table, name, tensor))
                        table[name] = fake(tensor)
        yield
    finally:
        for table, name, tensor in reversed(saved):
            table[name] = tensor


def _rebuilt(
    optimizer: torch.optim.Optimizer, fake: Callable[[torch.Tensor], torch.Tensor], cuda: bool
) -> torch.optim.Optimizer:
    """The same optimizer class and options over the fake parameters (foreach where CUDA would default to it); for
    a wrapper such as Accelerate's, the optimizer it wraps (whose step it runs)."""
    inner = getattr(optimizer, "optimizer", None)
    optimizer = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    groups = []
    for group in optimizer.param_groups:
        options = {key: value for key, value in group.items() if key != "params"}
        if cuda and options.get("foreach", False) is None and not options.get("fused"):
            options["foreach"] = True
        groups.append({**options, "params": [fake(p) for p in group["params"]]})
    rebuilt: torch.optim.Optimizer = cast(Any, type(optimizer))(groups)
    return rebuilt
