"""``@oom_guard``: the decorator users put on a forward-only training step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, overload

from oomguard._guard.guard import OOMGuard
from oomguard._guard.results import StepResult
from oomguard._options import GuardOptions, with_options

__all__ = ["GuardedStep", "oom_guard"]

BatchT = TypeVar("BatchT")
P = ParamSpec("P")


class GuardedStep(Generic[BatchT]):
    """A step function wrapped by :func:`oom_guard`: call it with a batch, get a :class:`StepResult`.

    Keeps the wrapped function's name and docstring; ``.guard`` is the :class:`OOMGuard` behind it (its plan,
    events and ``summary()``), ``.__wrapped__`` the original function.
    """

    def __init__(self, fn: Callable[[BatchT], Any], guard: OOMGuard) -> None:
        self.guard = guard
        self.__wrapped__ = fn
        functools.update_wrapper(self, fn)

    def __call__(self, batch: BatchT) -> StepResult:
        return self.guard(batch)

    def __repr__(self) -> str:
        name = getattr(self.__wrapped__, "__qualname__", repr(self.__wrapped__))
        return f"<guarded step {name}, plan: {self.guard.plan.describe()}>"


class _Decorator(Protocol[P]):
    """The two ways to call :func:`oom_guard`, each with the options of :class:`GuardOptions` as keywords."""

    @overload
    def __call__(self, fn: Callable[[BatchT], Any], /, *args: P.args, **kwargs: P.kwargs) -> GuardedStep[BatchT]: ...

    @overload
    def __call__(
        self, fn: None = None, /, *args: P.args, **kwargs: P.kwargs
    ) -> Callable[[Callable[[BatchT], Any]], GuardedStep[BatchT]]: ...


def _options_of(options: Callable[P, GuardOptions]) -> Callable[[Callable[..., Any]], _Decorator[P]]:
    """Type ``oom_guard`` with the options' own keyword parameters: they are written once, in GuardOptions."""

    def give(decorator: Callable[..., Any]) -> _Decorator[P]:
        decorator.__signature__ = with_options(decorator, leading=1)  # type: ignore[attr-defined]
        typed: _Decorator[P] = decorator  # type: ignore[assignment]
        return typed

    return give


@_options_of(GuardOptions)
def oom_guard(fn: Callable[[Any], Any] | None = None, /, **options: Any) -> Any:
    """Guard a forward-only training step against out-of-memory errors.

    The decorated function takes one batch and returns its loss (a tensor, a mapping with ``"loss"``, or an
    object with ``.loss`` such as a transformers ``ModelOutput``). The guard runs backward, gradient
    accumulation, clipping, ``optimizer.step()``, ``scheduler.step()`` and ``zero_grad``: exactly one optimizer
    step per call. On an out-of-memory error it drops everything the failed attempt held, frees the cache and
    retries the same batch one rung down the ladder (first: micro-batches with exact gradient accumulation).

    Args:
        model: the module being trained; the optimizer must hold only its parameters.
        optimizer: stepped once per call; its step is undoable, so an OOM inside it never half-steps.
        scheduler: stepped once per call, right after the optimizer.
        log_file: append every event (oom, fallback, recovered, relax, exhausted, progress) to this file as
            JSON lines.
        ladder: rung names or rung objects (see :class:`Rung`), in order; default: every built-in rung that is
            exact or says what it changes, ``["chunked_loss", "micro_batch", "amp", "checkpointing",
            "activation_offload", "optimizer_offload", "layer_offload"]``. ``amp`` (mixed precision: bf16, or fp16
            with a gradient scaler) changes the maths and comes before the exact rungs after it: leave it out of
            the ladder to keep a job's maths exact. The opt-in rungs
            (``"quantized_optimizer"``, ``"quantized_weights"``) change the maths beyond mixed precision and join
            only when listed.
        max_grad_norm: clip the gradient norm of the whole batch to this before stepping.
        count_items: how many items a batch's mean loss averages over, e.g. ``lambda b: b["mask"].sum()``.
            Micro-batch losses are weighted by their share of items. By default: counted ``labels`` tokens for
            transformers causal LMs (and ``labels`` of 2+ dims generally), samples otherwise.
        reduction: ``"mean"`` (default) if the loss averages over items, ``"sum"`` if it sums them (then
            micro-batch losses are simply added).
        max_attempts: give up on a batch after this many attempts (``RecoveryLimitExceeded``).
        max_recovery_seconds: give up on a batch after this long (``None``: no time bound).
        sinks: callables that receive every event object.
        step_journal: ``"auto"`` journals optimizer steps that may not fit (the first, and any without
            headroom) so a failure can be undone; ``"always"`` journals every step; ``"never"`` none.
        state_file: remember each batch bucket's plan in this JSON file (written atomically, under a file lock,
            on every change), so a restart starts on the plans that fitted. Missing, corrupt or foreign files are
            ignored with one warning; a file that cannot be written never fails a call (a ``state_file`` event
            says so and the save is retried). Several jobs may share one file; it keeps the most recent plans.
            It must not be the ``log_file``.
        relax_after: after this many consecutive clean steps on a degraded plan, try a plan further up once (with
            ``predictive``, the one the dry-run planner predicts fits and runs fastest for the memory free now,
            if faster than the plan; else the plan one rung up); if it runs out of memory, or no plan is predicted
            faster, go back and wait twice as long before the next try. ``None``: never.
        tune_after: once a batch bucket has run this many clean steps on the plan it fell back to after an OOM,
            search every fitting combination of the rungs on fake tensors, time the few the device model (measured
            on this device) ranks fastest on the next real steps (each a whole training step; a few warm one up
            first), and keep the fastest measured (a ``tuned`` event lists the timings; an alternative that runs
            out of memory is dropped and its step retried on the settled plan). Once per fallback, not under
            ``torch.distributed`` nor for :meth:`OOMGuard.accumulate`. ``None``: never.
        predictive: size micro-batches from the measured peaks of successful steps instead of halving blindly;
            and on the first OOM of a batch bucket that never fitted, run the dry-run planner on that batch and
            jump straight to the plan it predicts fits (one ``fallback`` event naming every rung the jump
            engaged), instead of trying the ladder rung by rung; and plan each step back up (``relax_after``).
            Not under torch.distributed.
        bucket: maps a batch to its bucket (plans are kept per bucket); default: its largest tensor's element
            count rounded up to a power of two, so a rare long batch escalates only its own bucket.
        log_every: write a ``progress`` event (loss, plan, peak, steps per rung) for each of the first this
            many steps, then every this many steps, for ``oomguard report``; ``None``: only OOM-related events.
        fix_fragmentation: when an OOM shows allocator fragmentation on CUDA, switch the allocator to
            ``expandable_segments:True`` (otherwise the event only recommends it).
        accelerator: a Hugging Face ``accelerate.Accelerator``: backward and clipping go through it (its loss
            scaling included), and its mixed precision replaces the amp rung. Pass the prepared model and
            optimizer.
        preplan: before the first step, run the dry-run planner (:func:`oomguard.plan`'s engine) on fake
            copies of the model and the first batch, and start on the fastest plan predicted to fit, so a job
            that would run out of memory starts on a fitting plan without a single OOM. Ignored when a state
            file already holds a plan, and under torch.distributed. Costs seconds, once.
        host_memory: the host RAM the guard may fill with what it offloads (optimizer state, master weights,
            offloaded layers, saved activations, the step journal), in bytes or as ``"16GiB"``. Default: what the
            OS says is available at the first call (``MemAvailable``, capped by a container's cgroup limit), less
            10 % or 1 GiB, whichever is larger; under ``SimulatedGPU(host_capacity=...)``, that limit. Read it
            back as ``guard.host_budget``. A host allocation that fails anyway raises :class:`HostMemoryError`
            (nothing committed) instead of moving down the ladder, which would offload more.
        host_step: how the optimizer steps what the offload rungs step on the host. ``"fused"`` (default): an
            exactly ``torch.optim.Adam`` or ``AdamW`` runs torch's fused CPU kernel there (one pass over memory,
            several times the loop's speed; the same maths within float rounding, not bit for bit; its state
            stays loadable by the unfused optimizer); other optimizers, and ``"exact"``, run the optimizer as
            configured (``foreach`` turned into torch's per-parameter loop on the host: the same bits, no
            model-sized temporaries). Parameters stepping on the device keep the optimizer's own kernels.

    Returns:
        A :class:`GuardedStep`: call it with a batch to get a :class:`StepResult`; ``.guard`` is the
        :class:`OOMGuard` with its plan, events and ``summary()``.

    Example::

        @oom_guard(model=model, optimizer=optimizer, log_file="oomguard.jsonl")
        def train_step(batch):
            return model(**batch).loss

        for batch in loader:
            result = train_step(batch)
            print(result.loss, result.micro_batch_size, result.rungs)
    """

    def decorate(step_fn: Callable[[Any], Any]) -> GuardedStep[Any]:
        if not callable(step_fn):
            raise TypeError(f"@oom_guard decorates a step function, got {type(step_fn).__name__}")
        return GuardedStep(step_fn, OOMGuard(step_fn, **options))

    return decorate if fn is None else decorate(fn)
