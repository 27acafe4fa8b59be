"""The ``chunked_loss`` rung's mechanism: a causal LM's loss computed in chunks of tokens, no full logits.

Two patches on the transformers model, no per-architecture code, both undone exactly:

* its output head (``lm_head``, an ``nn.Linear``) returns :class:`~oomguard._effects.lazy_logits.LazyLogits`: the
  logits' shape and dtype, no storage; element-wise steps the forward applies (softcap, logit scale) are recorded;
* its ``loss_function`` (transformers has a setter for it) computes, from those, exactly transformers'
  ``ForCausalLMLoss`` (the label shift, ``ignore_index``, ``shift_labels``, ``num_items_in_batch``: sum then
  divide, else the mean over counted tokens) with :func:`~oomguard._effects.chunked_ce.chunked_cross_entropy`.

Where the logits were needed before the loss (an op that is not element-wise between head and loss, a slice),
the loss is the original one on the real logits: exact, only without the saving. A step that reads
``outputs.logits`` gets the real values, with gradient history. A forward without labels never calls the loss:
its logits are real on first use. :meth:`ChunkedLoss.applies` says which models this can be done to.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, cast

import torch
from torch._compile import _disable_dynamo
from torch.nn import functional

from oomguard._effects.chunked_ce import ChunkSpec, chunk_rows, chunked_cross_entropy, needs_of
from oomguard._effects.hooks import GuardHook
from oomguard._effects.lazy_logits import HeadCall, LazyLogits, compute_dtype
from oomguard._errors import GuardConfigError

__all__ = ["ChunkedLoss", "causal_lm"]


def _for_causal_lm_loss() -> Any:
    """transformers' own causal-LM loss (None without transformers): the only loss this rung reproduces."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    return ForCausalLMLoss


#: Models whose loss is computed from their logits by the code that calls them (the HF Trainer's label smoothing),
#: by the causal LM inside: why the chunked loss would save nothing there (see :meth:`ChunkedLoss.refuse`).
_REFUSED: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()

_SHAPE_OF: dict[type, bool] = {}  # module class -> whether its forward calls its head and then its loss


def _calls_head_then_loss(cls: type[torch.nn.Module]) -> bool:
    """Whether the class's forward calls ``self.lm_head(...)`` and then ``self.loss_function(...)``: transformers'
    ``*ForCausalLM`` shape (145 of its 176 such classes), read from the source, whatever the architecture (once
    per class: a model has many modules)."""
    if cls not in _SHAPE_OF:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):  # built in, or defined where there is no source
            source = ""
        head, loss = source.find("self.lm_head("), source.find("self.loss_function(")
        _SHAPE_OF[cls] = 0 <= head < loss
    return _SHAPE_OF[cls]


def causal_lm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose head and loss the rung patches: ``model`` or the outermost module inside it (a PEFT
    wrapper's base model) whose forward calls its head and then its loss; None if there is none."""
    return next((m for m in model.modules() if _calls_head_then_loss(type(m))), None)


def _is_trl_fused_head(forward: Any) -> bool:
    """Whether ``forward`` (set on a model instance) is TRL's fused LM head: ``add_fused_lm_head`` sets a method
    whose function is its ``_fused_forward`` (``functools.wraps`` gives it the model's own name, not its code's)."""
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)
    return code is not None and code.co_name == "_fused_forward" and "trl" in code.co_filename


def _head_refusal(head: Any) -> str | None:
    """Why the head cannot be read as ``weight`` and ``bias`` (None: it can)."""
    if type(head) is not torch.nn.Linear:  # a LoRA layer, a bitsandbytes/quantized Linear, an FSDP wrapper...
        return f"its lm_head is a {type(head).__name__}, not a plain nn.Linear (an adapter or quantized layer?)"
    if "forward" in vars(head):
        patched = isinstance(vars(head)["forward"], _LazyHead)
        return "the chunked loss is applied already" if patched else "its lm_head's forward is patched by something"
    hooks = [*head._forward_hooks.values(), *head._forward_pre_hooks.values()]
    # Code that wants to see (or change) the real logits; the guard's own hooks (the master level's autocast around
    # a module that owns a halved weight) do not look at them.
    if any(not isinstance(hook, GuardHook) for hook in hooks):
        return "its lm_head has forward hooks that would see the logits"
    for name, tensor in (("weight", head.weight), ("bias", head.bias)):
        if tensor is not None and type(tensor.detach()) not in _PLAIN:  # a DTensor (FSDP2), a quantized weight
            return f"its lm_head.{name} is a {type(tensor.detach()).__name__}, not a plain tensor (sharded/quantized?)"
    return None


def _plain_types() -> tuple[type, ...]:
    """Tensor types the head's weight may have: plain, or the planner's fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensor

    return (torch.Tensor, FakeTensor)


_PLAIN = _plain_types()


class ChunkedLoss:
    """Makes a causal LM's loss computed in chunks of tokens, and undoes it exactly.

    Args:
        chunk_bytes: how much one chunk's fp32 logits may take; default the larger of 8 MiB and the hidden
            states' size (see :func:`~oomguard._effects.chunked_ce.chunk_rows`).
    """

    def __init__(self, chunk_bytes: int | None = None) -> None:
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes
        self._patched: torch.nn.Module | None = None  # the causal LM patched now
        self._head: torch.nn.Linear | None = None  # its head, as it was patched
        self._had_loss: tuple[bool, Any] = (False, None)  # whether the instance had set a loss_function, and which

    @staticmethod
    def applies(model: torch.nn.Module) -> str | None:
        """None if the chunked loss can be applied to ``model`` exactly, else why not (for a "skipped" event).

        Checked: a transformers causal LM whose forward calls ``self.lm_head`` then ``self.loss_function``;
        the loss is transformers' ``ForCausalLMLoss`` (no custom loss); the head a plain ``nn.Linear`` with plain
        tensors (no adapter, quantized layer, FSDP shard or hook); no TRL fused LM head (it computes its loss in
        chunks already; patching under it would be a second, unused patch). Another wrapper of the model's forward
        (Accelerate's fp32 outputs, say) is fine: whatever it does with the logits either is an element-wise step
        or gets the real ones. Not visible here: a loss the caller computes from ``outputs.logits`` (the HF
        Trainer's label smoothing); exact under the rung, but nothing saved, so the caller says so
        (:meth:`refuse`).
        """
        target = causal_lm(model)
        if target is None:
            return "it has no forward that calls self.lm_head(...) and then self.loss_function(...)"
        if target in _REFUSED:
            return _REFUSED[target]
        if _is_trl_fused_head(vars(target).get("forward")):
            return "it carries TRL's fused LM head (trl add_fused_lm_head), which computes its loss in chunks already"
        reason = _head_refusal(getattr(target, "lm_head", None))
        if reason is not None:
            return reason
        loss = getattr(target, "loss_function", None)
        expected = _for_causal_lm_loss()
        if expected is None or loss is not expected:
            return f"its loss_function is {getattr(loss, '__qualname__', loss)!r}, not transformers' ForCausalLMLoss"
        return None

    @staticmethod
    def refuse(model: torch.nn.Module, reason: str | None) -> None:
        """Make :meth:`applies` refuse ``model`` with ``reason`` until it is called again with None: for the code
        that calls the model and knows what the model cannot, that it computes the loss from the logits itself
        (the HF Trainer's ``LabelSmoother`` or ``compute_loss_func``: the model is called without labels, so the
        logits would be computed in full on first read and the rung would save nothing)."""
        target = causal_lm(model)
        if target is None:  # (a model the rung cannot apply to anyway needs no word)
            return
        if reason is None:
            _REFUSED.pop(target, None)
        else:
            _REFUSED[target] = reason

    @property
    def applied(self) -> bool:
        """Whether a model is patched by this object now."""
        return self._patched is not None

    def apply(self, model: torch.nn.Module) -> None:
        """Patch ``model``'s head and loss; raises :class:`~oomguard.GuardConfigError` with the reason where
        :meth:`applies` refuses."""
        reason = self.applies(model)
        if reason is not None:
            raise GuardConfigError(f"the chunked loss cannot be applied to {type(model).__name__}: {reason}")
        if self._patched is not None:
            raise GuardConfigError("this ChunkedLoss holds another model already: undo it first, or make another one")
        target = causal_lm(model)
        assert target is not None  # applies() found it
        head, original_loss = cast(torch.nn.Linear, target.lm_head), target.loss_function
        self._had_loss = ("_loss_function" in vars(target), vars(target).get("_loss_function"))
        cast(Any, head).forward = _LazyHead(head)  # on the instance: nn.Module.__call__ finds it before the class's
        cast(Any, target).loss_function = _ChunkedLossFunction(original_loss, self.chunk_bytes)  # (its setter)
        self._patched, self._head = target, head

    def undo(self, model: torch.nn.Module | None = None) -> None:
        """Put the model back exactly as it was (nothing if nothing is applied). A patch something replaced since
        (a new ``lm_head`` module, a loss the user set) is left as that made it: only this object's own go."""
        target, head = self._patched, self._head
        if target is None or head is None:
            return
        if model is not None and causal_lm(model) is not target:
            raise GuardConfigError("undo() was given another model than the one this ChunkedLoss was applied to")
        if isinstance(vars(head).get("forward"), _LazyHead):
            del cast(Any, head).forward  # the class's forward again
        if isinstance(vars(target).get("_loss_function"), _ChunkedLossFunction):
            had, value = self._had_loss
            if had:
                cast(Any, target).loss_function = value
            else:
                del cast(Any, target)._loss_function  # the property's lookup by loss_type again
        self._patched, self._head, self._had_loss = None, None, (False, None)


class _LazyHead:
    """The head's forward under the rung (set on the head instance): a promise of the logits, or the real head
    where autocast and the operands' dtypes leave nothing exact to promise.

    An object, not a closure, so that ``copy.deepcopy`` of the model gives the copy a forward over the copy's head
    (a closure would keep computing with the original's weights) and ``torch.save(model)`` can pickle it."""

    def __init__(self, head: torch.nn.Linear) -> None:
        self.head = head

    # Run eagerly under torch.compile: dynamo cannot trace the making of a wrapper subclass and would break its
    # graph here anyway, with a warning that asks the user to file an issue; this says it is meant. The layers
    # before the head and the code after the loss still compile. (torch's own lazy form of torch.compiler.disable:
    # the decorator imports torch._dynamo, and torch's FSDP through it, about a second of every `import oomguard`;
    # this one imports it at the first call, where a process that compiles has it already.)
    @_disable_dynamo
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head
        dtype = compute_dtype(hidden, head.weight)  # read now: the planner swaps fakes in for the parameters
        if dtype is None or hidden.dim() < 2:
            return torch.nn.Linear.forward(head, hidden)
        return LazyLogits(HeadCall(hidden, head.weight, head.bias, dtype))


class _ChunkedLossFunction:
    """The model's ``loss_function`` under the rung: ``original`` (transformers' ``ForCausalLMLoss``), computed in
    chunks from lazy logits; ``original`` itself on real ones. An object, for ``deepcopy`` and pickling."""

    def __init__(self, original: Any, chunk_bytes: int | None) -> None:
        self.original, self.chunk_bytes = original, chunk_bytes

    # Eager under torch.compile, as the head is: the chunks' local autograd (``torch.autograd.grad`` under saved
    # tensor hooks) is not traceable, and its allocations stay ordinary ops the simulator and the planner count.
    @_disable_dynamo
    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(logits, LazyLogits) or logits.materialized or logits.shape[-1] != vocab_size:
            return self._original(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, kwargs)
        if shift_labels is None:  # as ForCausalLMLoss: tokens < n predict n, the last one predicts nothing
            shift_labels = functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        head = logits.head
        x = head.hidden.reshape(-1, head.hidden.shape[-1])
        target = shift_labels.reshape(-1).to(x.device)
        if target.shape[0] != x.shape[0]:  # labels that do not match the logits: the original raises its own error
            return self._original(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, kwargs)
        rows = chunk_rows(x.shape[0], vocab_size, x.nelement() * x.element_size(), self.chunk_bytes)
        spec = ChunkSpec(head.dtype, logits.steps, ignore_index, rows, needs_of(x, head.weight, head.bias))
        total = chunked_cross_entropy(x, head.weight, head.bias, target, spec)
        if num_items_in_batch is None:  # cross_entropy's "mean": over the tokens that count (0/0 is nan, as there)
            return total / (target != ignore_index).sum()
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch

    def _original(self, *args: Any) -> torch.Tensor:
        """The original loss on the real logits (``args``: its arguments in order, then its other keywords)."""
        *positional, kwargs = args
        result: torch.Tensor = self.original(*positional, **kwargs)
        return result
