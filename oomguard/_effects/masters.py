"""optimizer_offload's ``"master"`` level: fp32 master weights on the host, bf16 copies of them on the device.

Each trainable fp32 parameter on the device becomes a bf16 copy of its fp32 master, kept on the host: weights take
half the device memory, and the user's optimizer steps the masters there (:mod:`oomguard._effects.optimizer`).

Each bf16 gradient goes down as backward finishes it and is summed in fp32 on the host (:mod:`.descent`): the device
never holds them all, no sum loses precision (summed in bf16, 256 micro-batches of one sample landed an SGD step 6.8
times amp's distance from fp32). From the last backward to the end of the optimizer step each halved parameter *is*
its master on the host, its gradient the fp32 sum, so that clipping (the guard's or a Trainer's) and the step see
fp32; the stepped masters go up rounded to bf16 as the host step goes on (:mod:`.ascent`: 2 bytes a parameter up, 2
down per micro-batch). A failed attempt drops its sums.

Between steps the device copy is the truth: a write to it that bypasses the parameter's version counter
(``p.data.clamp_()``, ``p.data.copy_(ema)``, ``p.data = ...``, ``vector_to_parameters``) is found by a checksum made
on the device after each upload and compared before the step (:mod:`.fingerprint`: 8 bytes per 65,521 weights come
down each time), and then the master takes the written elements; the others keep their fp32 bits. Comparing every
weight with its master instead would copy 2 bytes a parameter down every step. Reading the weights (``state_dict()``,
a copy of the model) sees the writes without committing them; the step, ``load_state_dict`` and the end of the level
commit them. A forward outside the guard's step runs under bf16 autocast, as the step's own does (the weights are
bf16: ``p.dtype`` says so), and a copy of the model (``copy.deepcopy``, ``torch.save``) holds the fp32 weights and
nothing of the guard (:mod:`.hooks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils.hooks import RemovableHandle

from oomguard._backends.memory import MemoryBackend
from oomguard._effects import copies
from oomguard._effects.ascent import Ascent
from oomguard._effects.base import EffectTarget
from oomguard._effects.descent import Descent
from oomguard._effects.early import EarlyStep, SpoiledEarlyStep, recomputes_forward
from oomguard._effects.fingerprint import Fingerprints
from oomguard._effects.hooks import Autocasting, GuardHook, aside
from oomguard._effects.hoststep import HostStep

__all__ = ["MasterWeights"]

_BF16 = torch.bfloat16


@dataclass(eq=False)
class _Weight:
    """One halved parameter."""

    param: torch.nn.Parameter
    master: torch.Tensor  # fp32, host: the weight
    image: torch.Tensor  # bf16, host: what the device copy holds as last uploaded (or written and committed)
    layout: tuple[Any, ...]  # the device copy's storage (weakly) and its dtype, shape, strides and offset
    device: torch.Tensor | None = None  # the device copy, held while the parameter is its master
    grad: torch.Tensor | None = None  # fp32, host: this attempt's micro-batch gradients summed
    staging: torch.Tensor | None = None  # host: a device tensor's values on their way down
    summed: bool = False  # whether ``grad`` holds this attempt's gradients


class MasterWeights:
    """The master level of one model and optimizer (see the module)."""

    def __init__(self, target: EffectTarget) -> None:
        self.target = target
        self._weights: dict[torch.nn.Parameter, _Weight] = {}
        self._prints = Fingerprints()
        self._backend: MemoryBackend | None = None
        self._swapped = False  # whether each parameter is its master (from the last backward to the step's end)
        self._hooks: list[RemovableHandle] = []
        self._loaded: list[_Weight] = []  # the weights a model's load_state_dict() under way writes
        self._descent = Descent()  # the gradients on their way down in this backward
        self.ascent = Ascent()  # the stepped weights on their way up (the planner reads what overlapped the step)
        self.early = EarlyStep()  # buckets stepped during the last backward (the planner reads how many elements)
        self._autocast = Autocasting(target.device_type)  # (a forward outside the step: bf16, as the step's own)
        self._versions: list[int] | None = None  # as an armed early step's forward began (None: not yet)

    def __contains__(self, param: object) -> bool:
        return param in self._weights

    @property
    def engaged(self) -> bool:
        return bool(self._weights)

    @property
    def masters(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        return {param: weight.master for param, weight in self._weights.items()}

    def _devices(self) -> list[torch.Tensor]:
        return [w.device if w.device is not None else w.param.data for w in self._weights.values()]

    # -- halving and restoring ------------------------------------------------------------------------
    def halve(self, params: list[torch.nn.Parameter], backend: MemoryBackend) -> bool:
        """Each of ``params`` (trainable fp32 parameters on the device): its master to the host, a bf16 copy in
        its place, a parameter at a time, so that applying the level holds one bf16 copy beside the fp32 weights,
        not all of them (6 bytes a parameter at once: a plan that fits ran out of memory as it was applied). An
        OOM part-way leaves the level whole over the parameters halved so far: the next apply halves the rest, or
        restores them."""
        params = [p for p in params if p not in self._weights]
        if not params:
            return False
        self._backend = backend
        halved: list[RemovableHandle] = []
        try:
            for param in params:
                half = param.detach().to(_BF16, memory_format=torch.contiguous_format)  # (may run out)
                weight = _Weight(param, backend.to_host(param.detach()), backend.to_host(half), copies.layout(half))
                if param.grad is not None:  # (accumulated so far: kept, as the sum on the host)
                    weight.grad, weight.summed = backend.to_host(param.grad), True
                backend.synchronize()  # (the copies have read the fp32 weight: its memory is free for the next)
                param.data, param.grad = half, None
                self._weights[param] = weight
                # (the parameter stays while its data is halved: one hook each, removed by restore)
                halved.append(param.register_post_accumulate_grad_hook(GuardHook(self._grad_ready)))  # type: ignore
        finally:
            if halved:  # (the host copies are complete: their checksums are taken on the host)
                self._prints.record_host([w.image for w in self._weights.values()])
                if not self._hooks:
                    self._hook()
                self._hooks.extend(halved)
        return True

    def restore(self, backend: MemoryBackend) -> None:
        """Each master back on the device in fp32, with what was written on the device since (may run out of
        memory: then the rest stay halved); a gradient summed and not stepped comes back too."""
        grads = {p: w.grad for p, w in self._weights.items() if w.summed}
        self.prepare()  # (each parameter its device copy again)
        self.sync()
        for param in list(self._weights):
            weight = self._weights[param]
            param.data = backend.to_device(weight.master)
            summed = grads.get(param)
            param.grad = None if summed is None else backend.to_device(summed)
            del self._weights[param]
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._prints = [], Fingerprints()
        self.early.close()

    # -- around backward and the step ------------------------------------------------------------------
    def prepare(self) -> None:
        """An attempt begins: each parameter its device copy again (after a backward without a step, the
        Trainer's replay), no gradient summed, and no autocast left entered by a forward that was interrupted."""
        if self.early.armed:  # (steps begun in a backward that failed: put back first)
            self.early.undo()
        self._back_to_device()
        self._prints.release()
        self._descent.drop()  # (a failed attempt's gradients are dropped, summed or not)
        for weight in self._weights.values():
            weight.summed = False
        self._autocast.unwind()

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Backward has accumulated ``param``'s gradient (a halved one): on its way down, the device copy let go."""
        weight, backend = self._weights.get(param), self._backend  # type: ignore[call-overload]
        if weight is None or backend is None or self._swapped or param.grad is None:
            return  # (not halved, not engaged, or lent as its master: the step's gradient stays)
        if self.early.taken(weight):  # (a second gradient for a weight whose bucket stepped: see SpoiledEarlyStep)
            raise SpoiledEarlyStep(f"a second gradient for a parameter of shape {tuple(param.shape)}")
        self._descent.send(weight, param.grad, backend)
        param.grad = None  # (the device memory lives until the copy has read it)
        self.early.ready(weight, self._descent)

    def step_early(self, host_step: HostStep, budget: int | None) -> bool:
        """The last backward of an attempt whose step nothing else looks at first is next: each bucket of weights
        may step as backward completes it (:mod:`.early`, which says when writes on the device are taken in)."""
        weights, optimizer, backend = list(self._weights.values()), self.target.torch_optimizer, self._backend
        groups = None if backend is None or self._swapped else self.early.groups(weights, optimizer)
        if not groups or backend is None:
            return False
        self._versions = None
        return self.early.arm(groups, optimizer, host_step, backend, self.ascent, budget)

    def _commit_writes(self) -> None:
        """An armed step's forward begins (the model's first forward pre-hook; else once it is done): the writes on
        the device since the last commit taken in, and the version counters noted (see :mod:`.early`)."""
        self.sync()
        self._versions = [w.param._version for w in self._weights.values()]

    def early_backward(self, loss: torch.Tensor) -> bool:
        """The armed step's last forward is done (see :mod:`.early`): what it wrote, told by version counters,
        taken in; disarmed beside a reentrant checkpoint or a replaced device copy (taken in after backward)."""
        if not self.early.armed:
            return False
        if self._versions is None:  # (no forward hook of ours ran)
            self._commit_writes()
        weights = list(self._weights.values())
        if any(not copies.ours(w, w.param.data) for w in weights) or recomputes_forward(loss):
            self.early.disarm()
            return False
        self.sync(only=[w for w, seen in zip(weights, self._versions or [], strict=True) if w.param._version != seen])
        return True

    def after_micro_batch(self) -> None:
        """Each halved weight's gradient of this micro-batch added to its fp32 sum on the host (sent down first
        where backward has not: one set outside backward)."""
        for weight in self._weights.values():
            self._grad_ready(weight.param)
        if self._backend is not None and not self._swapped:
            self._descent.land(self._backend)

    def lend_masters(self) -> None:
        """Clipping and the optimizer step see each halved parameter as its fp32 master on the host, with its
        fp32 gradient; first the masters take what was written on the device since they last matched it."""
        if self._swapped or not self._weights:
            return
        self.early.wait()
        if not self.early.armed:  # (else committed before the last backward, whose steps wrote the device)
            self.sync()
        for weight in self._weights.values():
            weight.device = weight.param.data
            weight.param.data = weight.master
            early = id(weight) in self.early.stepped  # (stepped: the step after backward skips it)
            weight.param.grad = weight.grad if weight.summed and not early else None
        self._swapped = True

    def ready_for_step(self) -> None:
        """The optimizer step is next: the masters lent (see :meth:`lend_masters`), and the device buffers for the
        checksums after it made now (may run out of memory), as nothing may fail once the step is committed."""
        self.lend_masters()
        if not self.early.armed:  # (else what the last backward sent is sent)
            self.ascent.begin()
        if self._weights:
            self._prints.prepare(self._devices())

    def host_stepped(self, params: list[torch.Tensor]) -> None:
        """The step under way has stepped ``params`` (a bucket of the host step): each halved one goes up now."""
        if self._swapped and self._backend is not None:
            self.ascent.send([self._weights[p] for p in params if p in self._weights], self._backend)  # type: ignore

    def stepped(self) -> None:
        """The masters were stepped (committed): each not sent up during the step goes up rounded to bf16 into its
        device copy, which the parameter is again. Raises nothing for want of memory (see Fingerprints.record)."""
        if not self._swapped or self._backend is None:
            return
        self.ascent.finish(self._weights.values(), self._backend)
        self.early.disarm()
        self._unswap()
        self._prints.record(self._devices(), self._backend)

    def _back_to_device(self) -> None:
        """Each parameter its device copy again without a step, the copy taking its master where the master
        changed meanwhile (a journal's undo puts back what it was; a step run outside the guard's changes it)."""
        if not self._swapped or self._backend is None:
            return
        uploaded = False
        for weight in self._weights.values():
            assert weight.device is not None
            if is_fake(weight.master):
                continue
            rounded = weight.master.to(_BF16)
            if not torch.equal(rounded.view(torch.int16), weight.image.view(torch.int16)):
                weight.image.copy_(rounded)
                self._backend.upload(weight.device, weight.image)
                uploaded = True
        self._unswap()
        if uploaded:  # (a rare path: the next check compares these weights in full)
            self._prints.forget()

    def _unswap(self) -> None:
        for weight in self._weights.values():
            assert weight.device is not None  # (held from lend_masters to here)
            weight.param.data, weight.param.grad = weight.device, None
            weight.device, weight.summed = None, False
        self._swapped = False

    # -- writes on the device ---------------------------------------------------------------------------
    def _written(self, only: list[_Weight] | None = None) -> dict[_Weight, torch.Tensor]:
        """Each weight whose device copy was written (or replaced) since it matched its master: the copy's values,
        on the host. ``only``: the weights known to be written (by their version counters), without checksums."""
        backend = self._backend
        if self._swapped or backend is None or not self._weights:
            return {}
        weights = list(self._weights.values()) if only is None else only
        datas = [w.param.data for w in weights]
        if only is None:
            flags = self._prints.changed(
                [d if copies.ours(w, d) else None for w, d in zip(weights, datas, strict=True)], backend
            )
        else:
            flags = [True] * len(weights)
        found = {}
        for weight, data, changed in zip(weights, datas, flags, strict=True):
            if changed:
                weight.staging = found[weight] = backend.to_host(data, weight.staging)
        if found:
            backend.synchronize()
        return found

    def truth(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each halved parameter's value: its master, merged with what was written on the device since (nothing
        is committed: a write undone before the next step leaves every fp32 bit of the master as it was)."""
        written = self._written()
        return {w.param: copies.merged(w, written[w]) if w in written else w.master for w in self._weights.values()}

    def sync(self, only: list[_Weight] | None = None) -> None:
        """Commit what was written on the device: the masters take the written elements, and a replaced device
        copy (``p.data = ...``) becomes a bf16 copy on the device again. ``only``: just these weights, found written
        by their version counters (no checksum; the next comparison finds them changed, and takes nothing more)."""
        written = self._written(only)
        for weight, values in written.items():
            merged = copies.merged(weight, values)
            if merged.shape == weight.master.shape:
                weight.master.copy_(merged)
                weight.image.copy_(merged)
            else:
                weight.master, weight.image, weight.grad = merged, merged.to(_BF16), None
            data = weight.param.data
            if not copies.ours(weight, data):
                self._adopt(weight, data)
        if written and only is None and self._backend is not None:  # (on the device, the host far slower; may OOM)
            self._prints.record(self._devices(), self._backend)

    def _adopt(self, weight: _Weight, data: torch.Tensor) -> None:
        """A replacement of the device copy: kept where it is a bf16 one on the device (``vector_to_parameters``
        of a bf16 vector: its views), else replaced by one made from the image."""
        assert self._backend is not None
        mine = data.dtype == _BF16 and data.is_contiguous() and self._backend.is_device(data)
        half = data if mine and data.shape == weight.master.shape else self._backend.to_device(weight.image)
        weight.param.data, weight.layout = half, copies.layout(half)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """For the planner's dry run: the model's hooks aside, each halved parameter its fp32 master (no copy)."""
        halves = {} if self._swapped else {w.param: w.param.data for w in self._weights.values()}
        with aside(self._hooks):
            try:
                for param in halves:
                    param.data = self._weights[param].master
                yield
            finally:
                for param, half in halves.items():
                    param.data = half

    # -- the model's hooks ------------------------------------------------------------------------------
    def _hook(self) -> None:
        """state_dict/load_state_dict hooks on the model, and autocast hooks on it and on every module that owns
        a halved parameter (a layer called on its own); all copied as nothing (see :mod:`.hooks`)."""
        model, halved = self.target.model, {id(p) for p in self._weights}
        self._hooks = [
            model.register_state_dict_post_hook(GuardHook(self._saving, copying=self)),  # type: ignore[no-untyped-call]
            model.register_load_state_dict_pre_hook(GuardHook(self._loading)),  # type: ignore[no-untyped-call]
            model.register_load_state_dict_post_hook(GuardHook(self._loaded_all)),  # type: ignore[no-untyped-call]
        ]
        owners = [m for m in model.modules() if any(id(p) in halved for p in m._parameters.values())]
        for module in dict.fromkeys([model, *owners]):
            self._hooks.append(module.register_forward_pre_hook(GuardHook(self._forward_begins)))
            self._hooks.append(module.register_forward_hook(GuardHook(self._autocast.exit), always_call=True))

    def _saving(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
        """``state_dict()`` gives each halved parameter as fp32: its master with what was written since (copies)."""
        truth = self.truth()
        for name, param in module.named_parameters(remove_duplicate=False):
            if param in truth and prefix + name in state_dict:
                state_dict[prefix + name] = truth[param].clone()

    def _loading(self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """``load_state_dict()`` writes each halved parameter's master exactly (torch writes the bf16 copy, and
        the post-hook puts the master's rounding there); what was written on the device before is committed
        first, as the load replaces only what it names."""
        self.sync()
        self._loaded = []
        for name, param in module.named_parameters(remove_duplicate=False):
            weight, value = self._weights.get(param), state_dict.get(prefix + name)
            if weight is not None and isinstance(value, torch.Tensor) and value.shape == weight.master.shape:
                with torch.no_grad():
                    weight.master.copy_(value.detach())  # (across devices: no host temporary)
                self._loaded.append(weight)

    def _loaded_all(self, module: torch.nn.Module, incompatible: Any) -> None:
        loaded, self._loaded = self._loaded, []
        if self._swapped or self._backend is None or not loaded:
            return  # (while each parameter is its master, torch wrote the masters themselves)
        for weight in loaded:
            weight.image.copy_(weight.master)
            self._backend.upload(weight.param.data, weight.image)
        self._prints.record_host([w.image for w in self._weights.values()])

    def _forward_begins(self, module: torch.nn.Module, args: Any) -> None:
        """A forward of the model or of a module owning a halved weight: under bf16 autocast where none is on (see
        :class:`.hooks.Autocasting`); the first of an armed early step's takes in what was written first."""
        if self._versions is None and self.early.armed:
            self._commit_writes()
        self._autocast.enter(module)

    # -- copies of the model ----------------------------------------------------------------------------
    def deepcopied(self, memo: dict[Any, Any]) -> None:
        """``copy.deepcopy(model)``: each halved parameter's copy is an fp32 parameter holding its value, on its
        device (see :func:`.copies.deep_copies`)."""
        places = {p: w.device.device if w.device is not None else p.device for p, w in self._weights.items()}
        copies.deep_copies(memo, ("oomguard.masters", id(self)), self.truth, places)

    def pickled(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """``torch.save(model)``: the loaded copy's halved parameters become their fp32 values (the file holds the
        bf16 copies and the fp32 values: 6 bytes a parameter)."""
        return copies.mended, (list(self.truth().items()),)
