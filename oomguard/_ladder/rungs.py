"""What a rung is: a policy over one part of the plan, and everything the package knows of it, declared.

A rung knows which phases of a step it relieves, how far down it a plan is (its level: 0 when it is not
engaged), how to make a plan need less memory (:meth:`Rung.escalate`) and how to give itself back one step
(:meth:`Rung.relax`). It declares its place in the default ladder (``after``), whether it is opt-in, whether its
maths is exact, how tuning may trade it, what it ends of other rungs, what it asks of the model, optimizer and
device (:meth:`Rung.facts`) and its effect (:meth:`Rung.effect`). Rungs are pure: they only compute plans. The
built-in ones live one module each in :mod:`oomguard._rungs` (where their effects may work on torch) and are
registered in :mod:`oomguard._ladder.registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from oomguard._ladder import registry
from oomguard._ladder.plan import EVERY_PHASE, Phase, Plan

__all__ = [
    "FieldRung",
    "Rung",
    "RungContext",
    "Sizing",
    "Trade",
    "builtin",
    "effect_order",
    "register",
    "registered",
    "unregister",
]

#: How tuning's search may trade a rung for speed: at every level it reaches (``"levels"``), off or at the level
#: of the plan searched around (``"off_or_level"``), or not at all (``"fixed"``: kept as that plan has it).
Trade = Literal["levels", "off_or_level", "fixed"]


@dataclass(frozen=True)
class RungContext:
    """What a rung may look at when it picks the next plan.

    The named fields are the facts of the call (batch, phase, prediction) and the preconditions of the rungs the
    package was first built with; a rung asks for its own preconditions through :meth:`Rung.facts`, which
    :func:`~oomguard._options.model_context` collects into these fields where one has the fact's name, else into
    ``facts`` (read with :meth:`fact`): a new rung needs no new field.
    """

    batch_size: int
    #: Repeated blocks found in the model (decoder layers); 0 when it has none.
    num_blocks: int = 0
    #: Whether the device runs bf16 autocast (CPU, CUDA Ampere and newer).
    bf16_supported: bool = True
    #: Where the last attempt ran out of memory: forward, backward, clip, optimizer, apply...
    phase: Phase = Phase.FORWARD
    #: Whether host memory is distinct from device memory (offloading cannot help a CPU-only run).
    can_offload: bool = True
    #: Whether the user already checkpoints every block (the checkpointing rung has nothing to add).
    checkpointed: bool = False
    #: The largest micro-batch predicted to fit on the failing configuration (predictive sizing), if known.
    max_micro_batch: int | None = None
    #: False when mixed precision is someone else's (Accelerate's): the amp rung then has nothing to give.
    amp_available: bool = True
    #: False when the optimizer cannot step on the host (its state must stay on the device: capturable Adam).
    optimizer_offloadable: bool = True
    #: Whether the ranks of a torch.distributed job train together (DDP's buckets fix the parameters' dtype).
    distributed: bool = False
    #: Whether the optimizer's state can be kept in 8 bits (torch's Adam and AdamW).
    optimizer_quantizable: bool = True
    #: Whether the model has frozen linear weights the quantized_weights rung can keep in 8 bits.
    frozen_linears: bool = False
    #: The host memory the guard may fill (its host budget); None: unlimited or unknown. A plan whose host bytes
    #: (:meth:`Rung.host_bytes`, summed) are past it is not engaged: :meth:`~oomguard._ladder.ladder.Ladder.next`
    #: passes it over.
    host_budget: int | None = None
    #: The preconditions of rungs that have no field above, by the names their :meth:`Rung.facts` give them.
    facts: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def fact(self, name: str, default: Any = None) -> Any:
        """The precondition ``name``: a field of that name, else from ``facts``, else ``default`` (a context made
        by hand, in a test, holds no facts)."""
        if name in _FIELDS:
            return getattr(self, name)
        return self.facts.get(name, default)


_FIELDS = frozenset(f.name for f in fields(RungContext)) - {"facts"}


class Rung:
    """One step down the ladder. ``name`` appears in events, in ``StepResult.rungs`` and in the report.

    Subclass it for a rung of your own: give it a ``name``, the phases it ``relieves`` and how deep it goes
    (``max_level``), and return the class of its effect from :meth:`effect` (a subclass of :class:`oomguard.Effect`,
    called with the model's :class:`oomguard.EffectTarget`). Its level lives in the plan's ``extras``; each
    out-of-memory error that it answers takes it one level down, each relaxation one level up. Pass it in
    ``ladder=``; a built-in rung is registered instead (:func:`register`) and declares
    the class attributes below.

    >>> class Quiet(Rung):
    ...     name = "quiet"
    >>> plan = Quiet().escalate(Plan(), RungContext(batch_size=8))
    >>> plan.rungs(8), Quiet().relax(plan, 8) == Plan()
    (('quiet',), True)
    """

    name: str
    #: The phases of a step whose memory this rung reduces; after an OOM in another phase, the ladder prefers
    #: rungs that relieve it.
    relieves: frozenset[Phase] = EVERY_PHASE
    #: How many levels down this rung goes (the default :meth:`deeper` stops there).
    max_level: int = 1
    #: The plan field that holds this rung's level; None keeps it in ``Plan.extras`` under the rung's name.
    field: ClassVar[str | None] = None
    #: The rung this one follows in the canonical order (the default ladder); None for the first.
    after: ClassVar[str | None] = None
    #: Whether the default ladder leaves it out (a user lists it in ``ladder=``): rungs that change the maths.
    opt_in: ClassVar[bool] = False
    #: Whether the training maths is exactly the plain step's with this rung engaged.
    exact: ClassVar[bool] = True
    #: How tuning's search may trade this rung for speed (see :data:`Trade`).
    trade: ClassVar[Trade] = "fixed"
    #: The rungs this one ends when it engages, and the level each is capped at while it is engaged: they cannot
    #: go deeper then either (applied in :func:`_settle`, and nowhere else).
    ends: ClassVar[Mapping[str, int]] = {}
    #: The rungs whose effects must come after this rung's (its saved-tensor hook must see tensors first, say).
    effect_before: ClassVar[tuple[str, ...]] = ()
    #: Whether this is the ladder's sizing rung (micro-batching; see :class:`Sizing`).
    sizing: ClassVar[bool] = False

    def level(self, plan: Plan, batch_size: int) -> int:
        """How far down this rung ``plan`` is: 0 when the rung is not engaged, deeper is larger."""
        return plan.level(self.name)

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        """``plan`` with this rung at ``level`` (what every rank of a distributed job agrees on)."""
        return plan.with_level(self.name, level)

    def escalate(self, plan: Plan, context: RungContext) -> Plan | None:
        """A plan that needs less memory than ``plan``, or None if this rung has nothing more to give: the rung's
        own step (:meth:`deeper`), with what the rungs end of each other applied."""
        deeper = self.deeper(plan, context)
        return None if deeper is None else _settle(deeper, self, context.batch_size)

    def deeper(self, plan: Plan, context: RungContext) -> Plan | None:
        """This rung's own step down from ``plan`` (one level, to ``max_level``), before what it ends is applied."""
        level = self.level(plan, context.batch_size)
        return self.at_level(plan, level + 1, context.batch_size) if level < self.max_level else None

    def relax(self, plan: Plan, batch_size: int) -> Plan | None:
        """One step back up this rung: the plan before its last escalation; None when it is not engaged."""
        level = self.level(plan, batch_size)
        return self.at_level(plan, level - 1, batch_size) if level > 0 else None

    def effect(self) -> Callable[[Any], Any] | None:
        """The class (or factory) of this rung's effect on torch state, if it has one of its own."""
        return None

    def host_bytes(self, plan: Plan, context: RungContext) -> int:
        """The host memory this rung's effect keeps at ``plan``, estimated before it engages from what the context
        knows (its :meth:`facts`); 0 for a rung that keeps nothing on the host, and by default."""
        return 0

    def facts(self, target: Any) -> Mapping[str, Any]:
        """What this rung's :meth:`escalate` needs to know of the model, optimizer and device, asked of the guard's
        :class:`~oomguard.EffectTarget` once per guard (see :meth:`RungContext.fact`)."""
        return {}

    def describe(self, plan: Plan, batch_size: int | None) -> str | None:
        """How :meth:`Plan.describe` words this rung in ``plan``; None when it is not engaged."""
        level = self.level(plan, batch_size or 0)
        return None if not level else self.name if level == 1 else f"{self.name} (level {level})"

    def reaches(self, plan: Plan, context: RungContext) -> bool:
        """Whether this rung, in ``context``, could take a plan to where ``plan`` has it: what a plan another job
        remembered must meet for this guard to take it (see :meth:`~oomguard._ladder.ladder.Ladder.beyond`).

        The default walks down as escalation does, from ``plan`` without this rung, until it meets ``plan``'s
        level (True) or can go no deeper (False). So a level deeper than the rung goes is out of reach, and so is
        one whose preconditions this model, optimizer or device lacks (bf16, an optimizer whose state can be kept
        in 8 bits, frozen weights to quantize, blocks to checkpoint...): each rung's :meth:`escalate` knows them.
        """
        size = context.batch_size
        wanted, level, current = self.level(plan, size), 0, self.at_level(plan, 0, size)
        while level < wanted:
            deeper = self.escalate(current, context)
            if deeper is None or self.level(deeper, size) <= level:
                return False  # (a rung that cannot go deeper, or would not: no walk of this ladder gets there)
            current, level = deeper, self.level(deeper, size)
        return level == wanted

    def setting(self, plan: Plan, batch_size: int) -> str:
        """How ``plan`` sets this rung, in words for a message (``offload_layers=5``)."""
        return f"{self.name} at level {self.level(plan, batch_size)}"


class Sizing(Rung):
    """The ladder's sizing rung (micro-batching): the one the ladder resets when another rung engages and grows
    first when it steps back up (see :mod:`oomguard._ladder.ladder`)."""

    sizing: ClassVar[bool] = True

    def floor(self, batch_size: int) -> int:
        """The smallest micro-batch this rung allows for a batch of ``batch_size``."""
        return 1


class FieldRung(Rung):
    """A rung whose part of the plan is one field that takes a few values, the shallowest (not engaged) first."""

    field: ClassVar[str]
    #: The field's values, level by level.
    levels: ClassVar[tuple[Any, ...]]
    #: How :meth:`Plan.describe` words each level but the first (``{}``: the field's value).
    phrases: ClassVar[tuple[str, ...]]

    def level(self, plan: Plan, batch_size: int) -> int:
        return self.levels.index(getattr(plan, self.field))

    def at_level(self, plan: Plan, level: int, batch_size: int) -> Plan:
        return plan.replace(**{self.field: self.levels[level]})

    def describe(self, plan: Plan, batch_size: int | None) -> str | None:
        level = self.level(plan, batch_size or 0)
        return self.phrases[level - 1].format(getattr(plan, self.field)) if level else None

    def setting(self, plan: Plan, batch_size: int) -> str:
        return f"{self.field}={getattr(plan, self.field)!r}"


# -- the registry's typed view -----------------------------------------------------------------------------------


def register(rung: type[Rung]) -> type[Rung]:
    """Make ``rung`` (a subclass of :class:`Rung` made without arguments) a built-in rung, placed right after the
    rung it declares it follows (``after``); returns the class. Its level, where it declares no ``field``, lives in
    ``Plan.extras`` under its name, and reads as a built-in's there (``describe()``, ``to_dict()``)."""
    made = rung()
    if not isinstance(made, Rung) or not isinstance(getattr(made, "name", None), str):
        raise TypeError(f"register() takes a subclass of oomguard.Rung with a name, got {rung!r}")
    registry.add(made)
    return rung


def unregister(name: str) -> None:
    """Take the built-in rung ``name`` off the registry (a test's own rung, once the test is over)."""
    registry.remove(name)


def registered() -> tuple[Rung, ...]:
    """Every built-in rung (its default instance), in canonical order."""
    return tuple(rung for rung in registry.entries() if isinstance(rung, Rung))


def builtin(name: str) -> Rung | None:
    """The built-in rung ``name`` (its default instance), None if none has that name."""
    return next((rung for rung in registered() if rung.name == name), None)


def effect_order() -> tuple[Rung, ...]:
    """The built-in rungs in the order their effects run (undone in the reverse): canonical, but a rung another
    declares in its ``effect_before`` waits for it (the earliest rung in canonical order that may go next goes)."""
    waiting = list(registered())
    ordered: list[Rung] = []
    while waiting:
        pending = {name for rung in waiting for name in rung.effect_before}
        ready = next((rung for rung in waiting if rung.name not in pending), None)
        if ready is None:
            raise ValueError(f"the rungs' effect_before declarations make a loop: {[r.name for r in waiting]}")
        ordered.append(ready)
        waiting.remove(ready)
    return tuple(ordered)


def _settle(plan: Plan, rung: Rung, batch_size: int) -> Plan | None:
    """``plan``, which ``rung`` just took one step down, with what the rungs' ``ends`` declare applied: the rungs
    ``rung`` ends are capped at their declared level; None where a rung engaged in ``plan`` ends ``rung`` itself
    at a level shallower than the one it took (8-bit optimizer state while the state is on the host)."""
    level = rung.level(plan, batch_size)
    for other in registered():
        cap = other.ends.get(rung.name)
        if cap is not None and other.name != rung.name and other.level(plan, batch_size) > 0 and level > cap:
            return None
    for name, cap in rung.ends.items():
        ended = builtin(name)
        if ended is not None and ended.level(plan, batch_size) > cap:
            plan = ended.at_level(plan, cap, batch_size)
    return plan
