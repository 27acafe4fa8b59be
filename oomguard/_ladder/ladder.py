"""The ladder: the rungs in the order they engage, and the only code that walks them.

Going down (:meth:`Ladder.next`), each out-of-memory error engages the first rung that can still give something,
preferring rungs that relieve the phase that failed (after an OOM in the optimizer step, halving the
micro-batches would not help). Rungs accumulate: an engaged rung stays on while the next is added.

Micro-batching is the ladder's *sizing* rung: when any other rung engages, the micro-batch size goes back to the
whole batch, since the memory the rung frees may let larger micro-batches fit again, and halving starts afresh.
So the plan the guard settles on is the one with the largest micro-batches that fits, not merely the first, and
going back up (:meth:`Ladder.relax`) grows the micro-batches first, then gives back the deepest other rung at the
micro-batches the plan has: a step back up never runs more micro-batches, or any rung deeper, than the plan it
leaves (where it can plan, the guard steps up as far as the planner predicts fits: :mod:`oomguard._guard.stepup`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from oomguard._errors import GuardConfigError
from oomguard._ladder import registry
from oomguard._ladder.plan import Plan
from oomguard._ladder.rungs import Rung, RungContext, Sizing, builtin, registered

__all__ = ["Ladder", "resolve_ladder"]


class Ladder:
    """An ordered sequence of rungs, and what walking them up and down means.

    ``rungs`` are the ones the guard escalates to, in order. ``known`` adds the built-in rungs the ladder does
    not list (a plan assigned by hand or remembered in a state file may still engage them): every rung a plan
    can hold, so that relaxing, agreeing and naming cover the whole plan.
    """

    def __init__(self, rungs: Sequence[Rung]) -> None:
        self.rungs = tuple(rungs)
        names = self.names
        self.sizing: Sizing | None = next((r for r in self.rungs if isinstance(r, Sizing)), None)
        unlisted = [type(rung)() for rung in registered() if rung.name not in names]
        # Unlisted rungs can only have been engaged before the ladder's own: they are given back last.
        self.known: tuple[Rung, ...] = (*unlisted, *self.rungs)
        self._grows = next(r for r in self.known if isinstance(r, Sizing))  # listed or not
        self._deeper = tuple(r for r in self.known if r is not self._grows)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(rung.name for rung in self.rungs)

    def next(self, plan: Plan, context: RungContext, skip: Collection[str] = ()) -> tuple[Rung, Plan] | None:
        """The rung to engage after ``plan`` failed, and the plan it gives; None when the ladder is exhausted.
        The rungs named in ``skip`` are passed over, and so is a plan the host has no room for
        (:meth:`host_refusals`)."""
        options = []
        for rung, smaller in self._escalations(plan, context):
            if rung.name not in skip and not self.past_host(smaller, context):
                options.append((rung, smaller))
        if not options:
            return None
        relieving = [(rung, smaller) for rung, smaller in options if context.phase in rung.relieves]
        rung, smaller = (relieving or options)[0]
        if self.sizing is not None and rung is not self.sizing:
            smaller = smaller.replace(micro_batch_size=None)  # a deeper rung may let larger micro-batches fit
        return rung, smaller

    def _escalations(self, plan: Plan, context: RungContext) -> list[tuple[Rung, Plan]]:
        """Each listed rung that can make ``plan`` need less memory, and the plan it makes."""
        found = [(rung, rung.escalate(plan, context)) for rung in self.rungs]
        return [(rung, smaller) for rung, smaller in found if smaller is not None and smaller != plan]

    def host_bytes(self, plan: Plan, context: RungContext) -> int:
        """The host memory ``plan``'s effects keep, as the rungs estimate it (:meth:`Rung.host_bytes`)."""
        return sum(rung.host_bytes(plan, context) for rung in self.known)

    def past_host(self, plan: Plan, context: RungContext) -> bool:
        """Whether ``plan`` keeps more on the host than ``context.host_budget`` (by :meth:`host_bytes`): the walk
        passes such a plan over, and stepping back up does not try it."""
        return context.host_budget is not None and self.host_bytes(plan, context) > context.host_budget

    def host_refusals(self, plan: Plan, context: RungContext) -> list[tuple[Rung, Plan, int]]:
        """The rungs :meth:`next` passed over after ``plan`` because the plan each makes needs more host memory
        than ``context.host_budget``: each with that plan and its estimated host bytes (what a message names)."""
        return [
            (rung, smaller, self.host_bytes(smaller, context))
            for rung, smaller in self._escalations(plan, context)
            if self.past_host(smaller, context)
        ]

    def relax(self, plan: Plan, batch_size: int) -> tuple[Rung, Plan] | None:
        """One step back up: the rung given back and the plan one rung less deep; None for a plain plan.

        Micro-batches grow first; on the whole batch, the deepest other rung is given back there. Not at the
        smallest micro-batch, where the ladder had it before that rung engaged: that needs the least memory, but
        micro-batches of 1 without checkpointing run slower than the whole batch with it, and a step back up that
        runs slower wanders (grow, give back, grow again) instead of reclaiming the memory freed. So no rung is
        deeper and no micro-batch smaller than in ``plan``; where the guard can plan, it checks the step up by the
        time model (:mod:`oomguard._guard.stepup`).

        >>> ladder = resolve_ladder(None)
        >>> [(rung.name, plan.micro_batch_size) for rung, plan in [ladder.relax(Plan(micro_batch_size=2), 8)]]
        [('micro_batch', 4)]
        >>> rung, plan = ladder.relax(Plan(precision="bf16"), 8)
        >>> rung.name, plan == Plan()
        ('amp', True)
        """
        grown = self._grows.relax(plan, batch_size)
        if grown is not None:
            return self._grows, grown
        for rung in reversed(self._deeper):
            given = rung.relax(plan, batch_size)
            if given is not None:
                return rung, given
        return None

    def beyond(self, plan: Plan, context: RungContext) -> list[str]:
        """Why this ladder could not have come to ``plan`` in ``context``, one reason per rung: a rung ``plan``
        engages that the ladder does not list, or a level a listed rung cannot reach here (:meth:`Rung.reaches`:
        too deep for the rung, or a precondition this model, optimizer or device lacks); and a plan the host has no
        room for (:meth:`host_bytes` past ``context.host_budget``). Empty when it could.

        A plan remembered in a state file is taken only then: another job on the same model and device may have
        opted in to rungs this one did not (4-bit weights), run an optimizer this one does not, or had more host
        memory than this guard's host budget.

        >>> ladder = resolve_ladder(None)
        >>> ladder.beyond(Plan(quantized_weights="4bit"), RungContext(batch_size=8, frozen_linears=True))
        ["quantized_weights is not on this guard's ladder"]
        """
        reasons, listed = [], set(self.names)
        for rung in self.known:
            if rung.at_level(plan, 0, context.batch_size) == plan:
                continue  # the plan does not engage this rung
            if rung.name not in listed:
                reasons.append(f"{rung.name} is not on this guard's ladder")
            elif not rung.reaches(plan, context):
                reasons.append(
                    f"{rung.setting(plan, context.batch_size)} is out of reach of this guard's {rung.name} rung "
                    f"(deeper than it goes, or not for this model, optimizer or device)"
                )
        known = {rung.name for rung in self.known}
        reasons += [f"{name} is not on this guard's ladder" for name, _ in plan.extras if name not in known]
        if self.past_host(plan, context):  # (a job on a machine with more host memory remembered it)
            needs, budget = self.host_bytes(plan, context), context.host_budget or 0
            reasons.append(
                f"it keeps about {needs / 2**30:.2f} GiB on the host, past this guard's host budget of "
                f"{budget / 2**30:.2f} GiB"
            )
        return reasons

    def min_micro_batch(self, batch_size: int) -> int:
        """The smallest micro-batch predictive sizing may pick: the micro-batch rung's floor, else one sample."""
        return self.sizing.floor(batch_size) if self.sizing is not None else 1

    def levels(self, plan: Plan, batch_size: int) -> list[int]:
        """What the ranks of a distributed job compare, each the larger the more conservative: the micro-batch
        size, negated (ranks' batches may differ in size, so it is compared as a size, not a level), then the
        level of every other rung a plan can hold."""
        micro = -plan.effective_micro_batch_size(batch_size)
        return [micro, *(rung.level(plan, batch_size) for rung in self._deeper)]

    def changed(self, before: Plan, after: Plan, batch_size: int) -> tuple[str, ...]:
        """The rungs whose level differs between two plans, in ladder order (what a jump from one to the other
        engaged or gave back)."""
        names = ("micro_batch", *(rung.name for rung in self._deeper))
        pairs = zip(self.levels(before, batch_size), self.levels(after, batch_size), strict=True)
        return tuple(name for name, (old, new) in zip(names, pairs, strict=True) if old != new)

    def at_levels(self, plan: Plan, levels: Sequence[int], batch_size: int) -> Plan:
        """``plan`` as :meth:`levels` describes it (on a batch of ``batch_size``: a micro-batch at least as
        large runs the batch whole)."""
        micro, *deeper = levels
        plan = plan.replace(micro_batch_size=None if -micro >= batch_size else -micro)
        for rung, level in zip(self._deeper, deeper, strict=True):
            plan = rung.at_level(plan, level, batch_size)
        return plan


class _Adopted(Rung):
    """A rung given as any object with a ``name`` and an ``escalate(plan, context)`` method."""

    def __init__(self, rung: object) -> None:
        self.rung = rung
        self.name = str(getattr(rung, "name"))  # noqa: B009
        self.relieves = getattr(rung, "relieves", self.relieves)

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        smaller: Plan | None = getattr(self.rung, "escalate")(plan, context)  # noqa: B009
        return smaller


def resolve_ladder(spec: Iterable[str | Rung] | None) -> Ladder:
    """Build a ladder from rung names and rung objects; ``None`` gives the default order.

    >>> resolve_ladder(None).names
    ('chunked_loss', 'micro_batch', 'amp', 'checkpointing', 'activation_offload', 'optimizer_offload', 'layer_offload')
    """
    if spec is None:
        spec = registry.default_ladder()
    if isinstance(spec, str):
        raise GuardConfigError(f"ladder= takes a list of rung names, not a string: write ladder=[{spec!r}]")
    rungs: list[Rung] = []
    for item in spec:
        if isinstance(item, str):
            known = builtin(item)
            if known is None:
                raise GuardConfigError(
                    f"unknown rung {item!r} in ladder=; the rungs are: {', '.join(registry.BUILTIN_RUNGS)} "
                    f"(or pass a rung object: a subclass of oomguard.Rung)"
                )
            rungs.append(type(known)())
        elif isinstance(item, Rung):
            rungs.append(item)
        elif isinstance(getattr(item, "name", None), str) and callable(getattr(item, "escalate", None)):
            rungs.append(_Adopted(item))
        else:
            raise GuardConfigError(
                f"ladder= entries must be rung names or rung objects (subclasses of oomguard.Rung), got "
                f"{type(item).__name__}: {item!r}"
            )
    for rung in rungs:
        own = builtin(rung.name)
        if own is not None and not isinstance(rung, type(own)):
            raise GuardConfigError(
                f"ladder= has a rung named {rung.name!r} that is not oomguard.{type(own).__name__}: that name is "
                f"the built-in rung's (its level is the plan's, by that name); give your rung a name of its own"
            )
    names = [rung.name for rung in rungs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise GuardConfigError(f"ladder= names the rung(s) {duplicates} more than once; list each rung once")
    return Ladder(rungs)
