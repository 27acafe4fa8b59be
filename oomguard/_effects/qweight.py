"""The held weight's tensor: a frozen weight kept as low-bit codes (the ``quantized_weights`` rung) or in half
precision (the ``amp`` rung) that is still a valid tensor.

:class:`QuantizedWeight` is a wrapper tensor subclass (``torch.Tensor._make_wrapper_subclass``): it has its
weight's shape, dtype and device and no storage of its own; it holds the weight's
:class:`~oomguard._effects.codec.Codes` and, in host memory, its exact original. Every aten op that meets it
(``__torch_dispatch__``) dequantizes it into a plain tensor and runs on that, so any code that reaches the weight
computes with the dequantized values: ``F.linear``, ``nn.MultiheadAttention`` (which reads ``out_proj.weight``
itself), PEFT DoRA's weight norm, ``weight.norm()``, ``.item()``. What torch hands to Python and numpy from a
tensor's memory, which a subclass has none of, reads the dequantized values too: ``.numpy()``, ``np.asarray``,
``.tolist()`` (TensorBoard's and wandb's histograms), the array read-only (its values were decoded for it alone:
a write to it would reach no weight). Views (``t``, ``detach``, ``.data``, slicing) and casts to
another dtype (autocast's) give back quantized tensors that share the codes: a linear layer's backward saves
``weight.t()``, so autograd keeps the 8- or 4-bit codes between forward and backward, not a full-precision copy.
A weight held in half precision reads as :class:`~oomguard._effects.weight_store.Store` says: a cast to that
precision (autocast's) reads the held values, exactly; every other read, the exact original.

Writes and copies see the exact original:

* An in-place write (``load_state_dict``'s ``copy_``, ``nn.init``, ``weight.mul_(2)``) runs on the exact original
  brought to the device for the op; the result becomes the exact original (in host memory) and is quantized
  again. A write to a copy (a cast) makes that copy a plain tensor of its own. Ops that would change the
  weight's shape or storage in place (``resize_``, ``set_``, ``t_``) raise an error that says what to do.
* ``copy.deepcopy`` gives a plain copy of the exact original on the device, pickling (``torch.save(model)``) the
  exact original from host memory, ``state_dict()`` a host copy of it (:func:`exact_originals`).
* A weight the user unfreezes (``requires_grad_(True)``), or whose ``.data`` is assigned, is first given back
  whole by the rung's effect (``give_back``): it trains on its exact original, as the same parameter object.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils._pytree import tree_flatten, tree_map

from oomguard._backends.dispatch import written
from oomguard._backends.memory import current_backend
from oomguard._effects.codec import Codes
from oomguard._effects.weight_store import Step, Store, replay

__all__ = ["QuantizedWeight", "exact_originals", "user_attributes"]

_aten = torch.ops.aten
_ALIASES = {_aten.detach.default, _aten.alias.default}  # the same tensor again (``.data`` is a detach)
_SET_DATA = cast(Any, torch.Tensor.data).__set__  # what ``tensor.data = ...`` calls
_NO_MEMORY = {torch.Tensor.__dlpack__, torch.Tensor.share_memory_}  # what needs the tensor's own storage
_READ_OUTS = {torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.tolist}  # (torch refuses them for subclasses)
_INTERNAL = frozenset({"_qstore", "_qsteps", "_is_param"})  # this class's own attributes, not the user's


def user_attributes(tensor: torch.Tensor) -> dict[str, Any]:
    """The attributes code has set on a tensor object (PEFT's, a user's), without this class's own."""
    return {key: value for key, value in vars(tensor).items() if key not in _INTERNAL}


class QuantizedWeight(torch.Tensor):
    """A tensor whose values are a quantized weight's (or a view or cast of them); see the module docstring."""

    _qstore: Store
    _qsteps: tuple[Step, ...]

    @staticmethod
    def __new__(cls, store: Store, steps: tuple[Step, ...] = (), requires_grad: bool = False) -> QuantizedWeight:
        meta = store.meta(steps)
        made: QuantizedWeight = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=store.device,
            requires_grad=requires_grad,
            storage_size=0,
        )  # (storage_size 0: code that reaches for its storage, not its values, meets an empty one)
        made._qstore, made._qsteps = store, steps
        return made

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    @classmethod
    def weight(cls, codes: Codes, host: torch.Tensor, attributes: dict[str, Any]) -> QuantizedWeight:
        """The quantized form of a frozen weight parameter: ``codes`` on the device, its exact original ``host``
        in host memory, and the attributes set on the parameter object; it passes for a Parameter."""
        made = cls(Store(codes, (), host))
        vars(made).update(attributes)
        made._is_param = True  # isinstance(made, torch.nn.Parameter), as Parameter does for tensor subclasses
        return made

    @property
    def bits(self) -> int:
        """8 or 4; 16 in half precision; 0 for a copy that was written to (no codes any more)."""
        return 0 if self._qstore.codes is None else self._qstore.codes.bits

    def values(self) -> torch.Tensor:
        """A plain tensor with this tensor's values (the dequantized weight, viewed and cast as this one is)."""
        return replay(self._qsteps, self._qstore.values())

    def exact(self, on_host: bool = False) -> torch.Tensor:
        """The exact values, from the weight's exact original (in host memory, or a device copy of it); a copy
        that was written to has only its own values."""
        store = self._qstore
        weight, steps = (
            (store, self._qsteps) if store.host is not None else (store.source, (*store.steps, *self._qsteps))
        )
        if weight is None or weight.host is None or store.dense is not None:
            return self.values()
        return replay(steps, weight.host if on_host else current_backend(self.device).to_device(weight.host))

    # -- what user code meets --------------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _NO_MEMORY:  # (a wrapper's storage is empty: nothing would be exported or shared)
            raise RuntimeError(
                f"{func.__name__}: a weight that {_held_as(args[0])} has no memory of its own to export or share; "
                f"use weight.clone() (its values), or call guard.close() first"
            )
        if func == _SET_DATA:
            return _set_data(*args)
        if getattr(func, "__name__", None) not in ("__get__", "__set__", "requires_grad_"):
            for tensor in _quantized((args, kwargs)):  # an unfrozen weight trains whole, on its exact original
                if tensor.requires_grad:
                    _give_back(tensor)
        if func in _READ_OUTS and isinstance(args[0], QuantizedWeight):
            return _read_out(func, args[0], args[1:], kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: torch._ops.OpOverload, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.inplace_view in func.tags:  # resize_, set_, t_, as_strided_: a wrapper's shape is fixed
            raise RuntimeError(_refusal(func, args[0]))
        targets = [t for t in written(func, args, kwargs) if isinstance(t, QuantizedWeight)]
        if targets:
            return _write(func, args, kwargs, targets)
        first = args[0] if args else None
        if isinstance(first, QuantizedWeight):
            derived = first._derived(func, args[1:], kwargs)
            if derived is not None:
                return derived
        return func(*_values(args), **_values(kwargs))

    def _derived(self, func: torch._ops.OpOverload, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The quantized result of a view or cast of this tensor; None for any other op."""
        store = self._qstore
        if func in _ALIASES:
            return QuantizedWeight(store, self._qsteps)
        if func.is_view and not _quantized_or_tensors((rest, kwargs)):
            shape = func(store.meta(self._qsteps), *rest, **kwargs)
            if isinstance(shape, torch.Tensor):
                return QuantizedWeight(store, (*self._qsteps, Step(func, rest, kwargs)))
            return [QuantizedWeight(store, (*self._qsteps, Step(func, rest, kwargs, i))) for i in range(len(shape))]
        if func is _aten._to_copy.default and store.codes is not None and _is_cast(self, kwargs):
            steps = (*store.steps, *self._qsteps, Step(None, dtype=kwargs["dtype"]))
            source = store if store.host is not None else store.source
            return QuantizedWeight(Store(store.codes, steps, None, source))  # (codes never change: a write makes new)
        return None

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        """A plain tensor (a Parameter for a parameter) holding the exact values, on this tensor's device."""
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        values = self.exact()  # (a fresh tensor, but a written copy's own values: those are cloned)
        values = values.clone() if self._qstore.dense is not None else values
        made = torch.nn.Parameter(values, self.requires_grad) if isinstance(self, torch.nn.Parameter) else values
        memo[id(self)] = made
        for key, value in user_attributes(self).items():
            setattr(made, key, copy.deepcopy(value, memo))
        return made

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``) as the plain tensor or Parameter of its exact values (a weight's from host
        memory: it loads on the CPU)."""
        values = self.exact(on_host=True).detach()
        made = torch.nn.Parameter(values, self.requires_grad) if isinstance(self, torch.nn.Parameter) else values
        vars(made).update(user_attributes(self))
        return made.__reduce_ex__(protocol)  # type: ignore[no-untyped-call]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        kind = f"{self.bits}-bit codes" if self.bits else "a copy"
        return f"QuantizedWeight({kind} of {tuple(self.shape)} {self.dtype}, values:\n{self.values()!r})"

    # -- what tensor-subclass machinery reads (flattening: the accounting counts the inner tensors) -----------
    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        store = self._qstore
        names = ["_qdense"] if store.dense is not None else [f"_q{name}" for name in store.codes.tensors]  # type: ignore[union-attr]
        return names, (store, self._qsteps)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], context: Any, size: Any, stride: Any) -> QuantizedWeight:
        store, steps = context
        codes = store.codes
        if codes is not None and "_qcodes" in inner:
            codes = Codes(inner["_qcodes"], inner.get("_qscales"), inner.get("_qtable"), codes.shape, codes.dtype)
        return QuantizedWeight(Store(codes, store.steps, store.host, store.source, inner.get("_qdense")), steps)

    @property
    def _qcodes(self) -> torch.Tensor:
        return self._qstore.codes.codes  # type: ignore[union-attr]

    @property
    def _qscales(self) -> torch.Tensor | None:
        return self._qstore.codes.scales  # type: ignore[union-attr]

    @property
    def _qtable(self) -> torch.Tensor | None:
        return self._qstore.codes.table  # type: ignore[union-attr]

    @property
    def _qdense(self) -> torch.Tensor | None:
        return self._qstore.dense


def exact_originals(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
    """A state-dict hook: ``state_dict()`` (of this module or any above it) gives each held parameter's exact
    original, a host copy (``keep_vars=True`` keeps the parameter itself); once, however many of the module's
    parameters registered it. A plain function, so that a model deep-copied or pickled with the hook still
    registered carries no reference to the rung."""
    for name, param in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(param, QuantizedWeight) and isinstance(value, QuantizedWeight) and value is not param:
            state_dict[key] = param.exact(on_host=True).clone()


def _give_back(tensor: QuantizedWeight) -> bool:
    """Ask the rung to give the weight ``tensor`` back whole (only the weight itself is: not a view of it); whether
    it is a plain tensor now."""
    store = tensor._qstore
    give_back = store.give_back or (store.source.give_back if store.source is not None else None)
    if give_back is not None:
        give_back(tensor)
    return not isinstance(tensor, QuantizedWeight)


def _set_data(target: QuantizedWeight, value: torch.Tensor) -> None:
    """``target.data = value``: the weight is given back whole first, and then takes ``value`` as any parameter does."""
    if isinstance(value, QuantizedWeight) and value._qstore is target._qstore and value._qsteps is target._qsteps:
        return  # ``weight.data += delta`` (PEFT's merge): the write has landed through the alias already
    if isinstance(value, QuantizedWeight):
        value = value.exact()  # (a wrapper's data would leave the target a tensor without storage)
    if not _give_back(target):
        raise RuntimeError(
            f"a tensor derived from a weight that {_held_as(target)} cannot take .data = ...: write its values with "
            f"copy_, or call guard.close() first"
        )
    _SET_DATA(target, value)


def _read_out(func: Callable[..., Any], tensor: QuantizedWeight, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``numpy()``, ``__array__`` or ``tolist()`` of ``tensor``'s values (what computations read); an array cannot
    be written: it holds values decoded for it alone, and a write to it would reach no weight."""
    out = func(tensor.values(), *rest, **kwargs)
    if func is not torch.Tensor.tolist:
        out.flags.writeable = False  # (a write says "assignment destination is read-only"; copy_ writes the weight)
    return out


def _quantized(tree: Any) -> list[QuantizedWeight]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, QuantizedWeight)]


def _quantized_or_tensors(tree: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(tree)[0])


def _values(tree: Any) -> Any:
    return tree_map(lambda leaf: leaf.values() if isinstance(leaf, QuantizedWeight) else leaf, tree)


def _is_cast(tensor: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether ``_to_copy`` with ``kwargs`` only casts ``tensor`` to another floating dtype on its device."""
    dtype = kwargs.get("dtype")
    device = kwargs.get("device")
    if dtype is None or dtype == tensor.dtype or not dtype.is_floating_point or kwargs.get("pin_memory"):
        return False
    same_place = device is None or torch.device(device) == tensor.device
    layout = kwargs.get("layout") in (None, torch.strided)
    return same_place and layout and kwargs.get("memory_format") in (None, torch.preserve_format)


def _write(func: torch._ops.OpOverload, args: Any, kwargs: Any, targets: list[QuantizedWeight]) -> Any:
    """Run an op that writes into quantized tensors on dense stand-ins (see :meth:`Store.writable`), then keep
    what it wrote; the op's outputs that are stand-ins are given back as the quantized tensors."""
    roots: dict[int, tuple[Store, torch.Tensor]] = {}
    stand_ins: dict[int, torch.Tensor] = {}
    for target in targets:
        store = target._qstore
        if id(store) not in roots:
            roots[id(store)] = (store, store.writable())
        stand_ins[id(target)] = replay(target._qsteps, roots[id(store)][1])

    def dense(leaf: Any) -> Any:
        if isinstance(leaf, QuantizedWeight):
            return stand_ins[id(leaf)] if id(leaf) in stand_ins else leaf.values()
        return leaf

    out = func(*tree_map(dense, args), **tree_map(dense, kwargs))
    if any(stand_ins[id(t)].shape != t.shape for t in targets):  # (an ``out=`` of another shape resized it)
        raise RuntimeError(_refusal(func, targets[0]))
    for store, root in roots.values():
        store.commit(root)
    back = {id(stand_ins[id(t)]): t for t in targets}
    return tree_map(lambda leaf: back.get(id(leaf), leaf) if isinstance(leaf, torch.Tensor) else leaf, out)


def _refusal(func: torch._ops.OpOverload, tensor: Any) -> str:
    return (
        f"{func.__name__} would change the shape or storage of a weight that {_held_as(tensor)} (it has no "
        f"storage of its own while the rung is engaged). Call guard.close() first, which puts the exact original "
        f"back, or write its values with copy_"
    )


def _held_as(tensor: Any) -> str:
    """Which rung holds ``tensor`` (a held weight, or a view or copy of one) and how, for a message."""
    store = tensor._qstore if isinstance(tensor, QuantizedWeight) else None
    codes = None if store is None else store.codes or (store.source.codes if store.source is not None else None)
    half = None if codes is None else codes.half
    return "the quantized_weights rung holds in low bits" if half is None else f"the amp rung holds in {half}"
