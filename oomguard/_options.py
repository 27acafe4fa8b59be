"""The guard's options: one frozen dataclass, defined once, checked once, with errors that name the fix; and the
step runner they configure.

:func:`oomguard.oom_guard`, :class:`oomguard.OOMGuard`, the Trainer integration and the planner all take these
options; the first two take them as keyword arguments whose names, types and defaults are this dataclass's own
(:func:`takes_options`). What each option does is documented on :func:`oomguard.oom_guard`. The guard and the
planner both run steps through the runner :func:`build_runner` assembles.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from oomguard._backends.units import parse_bytes
from oomguard._distributed.agreement import ddp_of, unwrap
from oomguard._effects.base import EffectTarget
from oomguard._effects.blocks import find_blocks
from oomguard._effects.effects import Effects
from oomguard._effects.hoststep import HOST_STEPS, HostStep
from oomguard._effects.sharding import check_sharded
from oomguard._effects.transaction import JournalMode, OptimizerTransaction, Scheduler
from oomguard._errors import GuardConfigError
from oomguard._events import EventSink
from oomguard._ladder.ladder import Ladder, resolve_ladder
from oomguard._ladder.rungs import Rung, RungContext
from oomguard._step.batch import batch_bucket, default_item_counter
from oomguard._step.runner import Reduction, StepRunner

__all__ = ["GuardOptions", "build_runner", "check_accelerator", "model_context", "takes_options"]

P = ParamSpec("P")
S = TypeVar("S")
F = TypeVar("F")


@dataclass(frozen=True, kw_only=True, eq=False)
class GuardOptions:
    """Everything a guard is configured with (see :func:`oomguard.oom_guard` for what each option does).

    Checked as it is made: a bad value raises :class:`~oomguard.GuardConfigError` naming the option and the fix.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Scheduler | None = None
    log_file: str | Path | None = None
    ladder: Iterable[str | Rung] | None = None
    max_grad_norm: float | None = None
    count_items: Callable[[Any], float] | None = None
    reduction: Reduction = "mean"
    max_attempts: int = 256
    max_recovery_seconds: float | None = 3600.0
    sinks: Sequence[EventSink] = ()
    step_journal: JournalMode = "auto"
    state_file: str | Path | None = None
    relax_after: int | None = 200
    tune_after: int | None = 4
    predictive: bool = True
    bucket: Callable[[Any], int] = batch_bucket
    log_every: int | None = 10
    fix_fragmentation: bool = False
    accelerator: Any = None
    preplan: bool = False
    host_memory: int | str | None = None
    host_step: HostStep = "fused"
    #: ``ladder`` resolved into rung objects (unknown names are refused here).
    rungs: Ladder = field(init=False, repr=False)
    #: ``host_memory`` in bytes (None: the default budget, see :mod:`oomguard._backends.host`).
    host_bytes: int | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_model_and_optimizer(self.model, self.optimizer)
        if self.scheduler is not None:
            if not callable(getattr(self.scheduler, "step", None)):
                raise GuardConfigError(f"scheduler= needs a .step() method, got {type(self.scheduler).__name__}")
            if getattr(self.scheduler, "optimizer", self.optimizer) is not self.optimizer:
                raise GuardConfigError("scheduler= was built over a different optimizer than optimizer=")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise GuardConfigError(
                f"max_grad_norm must be positive (or None to disable clipping), got {self.max_grad_norm!r}"
            )
        check_sharded(self.model)  # FSDP2 is guarded (FSDP1 refused): see _distributed.fsdp
        if self.reduction not in ("mean", "sum"):
            raise GuardConfigError(
                f"reduction must be 'mean' or 'sum' (how the step's loss reduces), got {self.reduction!r}"
            )
        if self.step_journal not in ("auto", "always", "never"):
            raise GuardConfigError(f"step_journal must be 'auto', 'always' or 'never', got {self.step_journal!r}")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise GuardConfigError(f"max_attempts must be an int >= 1, got {self.max_attempts!r}")
        if self.max_recovery_seconds is not None and not self.max_recovery_seconds > 0:
            raise GuardConfigError(f"max_recovery_seconds must be positive or None, got {self.max_recovery_seconds!r}")
        if self.host_step not in HOST_STEPS:
            raise GuardConfigError(
                f"host_step must be 'fused' (torch's fused CPU kernel for Adam and AdamW on what the offload rungs "
                f"step on the host: the same maths within float rounding) or 'exact' (the optimizer as configured, "
                f"every bit its own), got {self.host_step!r}"
            )
        _check_optional_positive_int("relax_after", self.relax_after)
        _check_optional_positive_int("tune_after", self.tune_after)
        _check_optional_positive_int("log_every", self.log_every)
        _check_distinct_files(self.log_file, self.state_file)
        check_accelerator(self.accelerator)
        object.__setattr__(self, "rungs", resolve_ladder(self.ladder))
        object.__setattr__(self, "host_bytes", _host_bytes(self.host_memory))


def _host_bytes(host_memory: int | str | None) -> int | None:
    """``host_memory=`` in bytes, refused clearly where it is no size."""
    if host_memory is None:
        return None
    try:
        return parse_bytes(host_memory)
    except (TypeError, ValueError) as exc:
        raise GuardConfigError(
            f"host_memory= is the host RAM the guard may fill with offloaded tensors, in bytes or as a string like "
            f"'16GiB' (None: what the OS says is available, less a margin): {exc}"
        ) from None


def _check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise GuardConfigError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise GuardConfigError(f"optimizer= must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    model_params = {id(p) for p in model.parameters()}
    if not model_params:
        raise GuardConfigError(
            f"the model ({type(model).__name__}) has no parameters, so there is nothing to train or guard"
        )
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in model_params)
    if foreign:
        raise GuardConfigError(
            f"the optimizer holds {foreign} parameter(s) that are not the model's: build it over "
            f"model.parameters() (the guard drops and recomputes the model's gradients on every retry)"
        )


def check_accelerator(accelerator: Any) -> None:
    """Refuse Accelerate's own gradient accumulation (at construction, and at each call: it can be switched on later).
    Its ``backward`` divides every loss by ``gradient_accumulation_steps``, and inside ``accumulate()`` its optimizer
    wrapper skips the step and ``zero_grad`` of every call but the last: a guarded call would claim a step it did not
    commit, and its retry would drop the gradients the calls before it accumulated. The guard accumulates itself."""
    if accelerator is None:
        return
    steps = getattr(accelerator, "gradient_accumulation_steps", 1)
    if steps == 1:  # (then accumulate() syncs at every call)
        return
    raise GuardConfigError(
        f"Accelerate's own gradient accumulation (gradient_accumulation_steps={steps}, accelerator.accumulate()) "
        f"cannot run under the guard: a guarded call is one whole optimizer step, and a retry of one micro-batch of "
        f"Accelerate's would drop or double what the calls before it accumulated. Let the guard accumulate: "
        f"Accelerator(gradient_accumulation_steps=1), no `with accelerator.accumulate(model):`, and give each "
        f"guarded call the whole effective batch ({steps} of your batches together); it splits that batch into "
        f"micro-batches, with exact accumulation, only when memory requires it (guard.plan = "
        f"Plan(micro_batch_size=...) fixes the split)"
    )


def _check_optional_positive_int(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise GuardConfigError(f"{name} must be an int >= 1 or None, got {value!r}")


def _check_distinct_files(log_file: str | Path | None, state_file: str | Path | None) -> None:
    """One file for both would be appended to as a log and replaced as a state file: each would destroy the
    other's contents, so refuse it before the first call."""
    if log_file is None or state_file is None:
        return
    log, state = _absolute(log_file), _absolute(state_file)
    if log == state:
        raise GuardConfigError(
            f"log_file= and state_file= are the same file ({log}): events appended to it would make the state "
            f"file unreadable, and every saved plan would replace the event log. Give them different paths, e.g. "
            f"log_file='oomguard.jsonl' and state_file='oomguard-plans.json'"
        )


def _absolute(path: str | Path) -> Path:
    """``path`` made absolute, with ``~``, ``..`` and symbolic links resolved where they can be."""
    expanded = Path(path).expanduser()
    try:
        return expanded.resolve()
    except (OSError, RuntimeError):  # a symlink loop, say: compare the plain absolute paths
        return Path(os.path.abspath(expanded))


def takes_options(
    options: Callable[P, GuardOptions],
) -> Callable[[Callable[Concatenate[S, F, ...], None]], Callable[Concatenate[S, F, P], None]]:
    """Give ``__init__(self, first, /, **options)`` the options' own keyword parameters, for type checkers and
    for ``help()``: the options are written once, in :class:`GuardOptions`."""

    def give(init: Callable[Concatenate[S, F, ...], None]) -> Callable[Concatenate[S, F, P], None]:
        init.__signature__ = with_options(init, leading=2)  # type: ignore[attr-defined]
        return init

    return give


def with_options(function: Callable[..., Any], leading: int) -> inspect.Signature:
    """The signature of ``function``'s first ``leading`` parameters followed by every option, keyword-only."""
    first = list(inspect.signature(function).parameters.values())[:leading]
    return inspect.Signature([*first, *inspect.signature(GuardOptions).parameters.values()])


def build_runner(
    step_fn: Callable[[Any], Any], options: GuardOptions, item_counter: Callable[[Any], float] | None = None
) -> StepRunner:
    """The runner of ``step_fn`` with ``options``: its effects work on the module inside DDP, never the wrapper."""
    core = unwrap(options.model)
    return StepRunner(
        step_fn,
        model=options.model,
        optimizer=options.optimizer,
        scheduler=options.scheduler,
        transaction=OptimizerTransaction(options.optimizer, options.step_journal),
        effects=Effects(
            EffectTarget(core, options.optimizer, find_blocks(core), options.accelerator),
            options.rungs.rungs,
            options.host_step,
        ),
        max_grad_norm=options.max_grad_norm,
        item_counter=item_counter or options.count_items or default_item_counter(options.model),
        reduction=options.reduction,
        ddp=ddp_of(options.model),
        accelerator=options.accelerator,
    )


def model_context(runner: StepRunner) -> RungContext:
    """What the rungs may assume about the runner's model and device; each call fills in its batch and phase.

    Each rung of the guard (registered or its own) says what it needs to know (:meth:`Rung.facts`, asked of the
    effect target); a fact named like a field of :class:`RungContext` fills it, any other goes to its ``facts``.
    """
    target = runner.effects.target
    facts: dict[str, Any] = {}
    for rung in runner.effects.rungs:
        facts.update(rung.facts(target))
    named = {name: facts.pop(name) for name in list(facts) if name in _CONTEXT_FIELDS}
    return RungContext(batch_size=0, num_blocks=len(target.blocks), **named, facts=facts)


_CONTEXT_FIELDS = frozenset(f.name for f in fields(RungContext)) - {"batch_size", "num_blocks", "facts"}
