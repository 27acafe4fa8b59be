"""The ``quantized_optimizer`` rung's effect: Adam's moments in block-wise 8-bit storage.

While engaged, each of Adam's moment tensors (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) is kept as 8-bit
codes with one fp32 scale per block of 256 values (:class:`Quantized`): about 1.02 bytes per value instead of 4,
so AdamW's state takes 2 bytes per parameter instead of 8. Moments of fewer than 1,024 values (biases, norms)
stay in fp32. The codes are ``float8_e4m3fn``, scaled so that each
block's largest magnitude is the format's largest: every value keeps about 3 significant bits down to four
decades below its block's largest (what Adam needs: its update divides one moment by the other's square root,
so small moments matter as much as large ones; linear 8-bit codes would round them to zero). The second moment
is stored as its square root, which halves its dynamic range.

The user's own optimizer runs the same algorithm: its step is run in chunks of parameters, each chunk's moments
dequantized into fp32 just before, quantized again just after (so at most one chunk's fp32 state exists at a
time); hooks registered on the optimizer run once per step, and a learning-rate scheduler still sees the step.
Step counters stay as they are. ``optimizer.state_dict()`` gives the moments dequantized (fp32), and
``load_state_dict`` quantizes what it loads. Undo (relaxing, ``guard.close()``, giving up) dequantizes every
moment back into an fp32 tensor: what training continues from is the quantized value.

Only ``torch.optim.Adam`` and ``AdamW`` (not ``differentiable``) are quantized; the rung is skipped for others.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.base import Effect, EffectTarget
from oomguard._effects.hooks import step_replaced
from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import Plan

__all__ = ["BLOCK", "Quantized", "QuantizedOptimizerEffect", "can_quantize", "dequantize", "quantize"]

BLOCK = 256
_CODE = torch.float8_e4m3fn
_CODE_MAX = float(torch.finfo(_CODE).max)
_MOMENTS = {"exp_avg": False, "exp_avg_sq": True, "max_exp_avg_sq": True}  # key -> stored as its square root
_CHUNKS = 8  # a step dequantizes about 1/8 of the state at a time (at least one parameter's)
#: Moments of fewer values stay in fp32: they gain nothing (allocators round small tensors up, and codes and
#: scales are two of them) and would only lose precision.
MIN_VALUES = 1024


def can_quantize(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the rung can keep ``optimizer``'s state in 8 bits: torch's Adam and AdamW, not differentiable (also
    inside Accelerate's ``AcceleratedOptimizer``, which steps and keeps the state of the torch optimizer it wraps)."""
    inner = getattr(optimizer, "optimizer", None)
    adam = type(inner if isinstance(inner, torch.optim.Optimizer) else optimizer) in (
        torch.optim.Adam,
        torch.optim.AdamW,
    )
    return adam and not any(group.get("differentiable", False) for group in optimizer.param_groups)


@dataclass(frozen=True)
class Quantized:
    """A tensor in block-wise 8-bit storage: ``codes`` (``float8_e4m3fn``, padded to whole blocks) times one
    ``scales`` entry per block of :data:`BLOCK`; ``root``: the codes hold the square root of the values."""

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    root: bool

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What a step rewrites in place (the optimizer transaction journals these like any state tensor)."""
        return self.codes, self.scales

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def quantize(tensor: torch.Tensor, root: bool = False) -> Quantized:
    """``tensor`` (non-negative where ``root``) in block-wise 8-bit storage, on its device.

    >>> t = torch.linspace(-1, 1, 1000)
    >>> bool((dequantize(quantize(t)) - t).abs().max() < 0.07)
    True
    """
    flat = tensor.detach().reshape(-1).float()
    if root:
        flat = flat.sqrt()
    flat = torch.nn.functional.pad(flat, (0, (-flat.numel()) % BLOCK))
    blocks = flat.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / _CODE_MAX
    codes = (blocks / scales[:, None]).to(_CODE)
    return Quantized(codes, scales, tensor.shape, root)


def dequantize(quantized: Quantized) -> torch.Tensor:
    """The fp32 tensor ``quantized`` stands for, on its device."""
    flat = (quantized.codes.float() * quantized.scales[:, None]).reshape(-1)[: quantized.shape.numel()]
    return (flat.square() if quantized.root else flat).view(quantized.shape)


class QuantizedOptimizerEffect(Effect):
    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._engaged = False
        self._hooks: list[RemovableHandle] = []

    @property
    def holds(self) -> bool:
        return self._engaged

    @property
    def held(self) -> str:
        return "the optimizer state in 8 bits"

    def check(self, plan: Plan) -> None:
        if plan.quantized_optimizer and not can_quantize(self.target.optimizer):
            raise GuardConfigError(
                f"quantized_optimizer keeps only torch.optim.Adam and AdamW state in 8 bits, not "
                f"{type(self.target.optimizer).__name__}'s: leave quantized_optimizer out of the plan or ladder="
            )

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        if not plan.quantized_optimizer:
            if not self._engaged:
                return False
            self.close()
            return True
        changed = not self._engaged
        if not self._engaged:
            optimizer = self.target.torch_optimizer  # (inside Accelerate's wrapper)
            self._hooks = [
                optimizer.register_state_dict_post_hook(_dequantized_state_dict),
                optimizer.register_load_state_dict_post_hook(functools.partial(self._loaded)),
            ]
            self._engaged = True
        return self._quantize_all() or changed

    def optimizer_step(self, plan: Plan, backend: MemoryBackend) -> contextlib.AbstractContextManager[None] | None:
        return self._chunked() if plan.quantized_optimizer else None

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        return None  # (it changes only the optimizer's state, and the planner rebuilds the optimizer)

    def _quantize_all(self) -> bool:
        """Every fp32 moment to 8 bits, one at a time (each frees its fp32 tensor as it goes)."""
        changed = False
        for state in self.target.optimizer.state.values():
            changed = _quantize_moments(state) or changed
        return changed

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self._quantize_all()

    @contextlib.contextmanager
    def _chunked(self) -> Iterator[None]:
        """The optimizer's ``step`` replaced, for this step, by one that steps its parameters chunk by chunk."""
        optimizer = self.target.torch_optimizer  # (inside Accelerate's wrapper, whose step calls it)
        previous = vars(optimizer).get("step")
        raw = type(optimizer).step.__wrapped__  # type: ignore[attr-defined]  # (no hooks: the wrapper runs them once)
        stepper = torch.optim.Optimizer.profile_hook_step(functools.partial(_step_in_chunks, raw=raw))
        bound: Any = types.MethodType(stepper, optimizer)
        if previous is not None and hasattr(previous, "_wrapped_by_lr_sched"):
            bound = _tracked_by_scheduler(bound, optimizer)
        with step_replaced(optimizer, bound):
            yield

    def close(self) -> None:
        """Every moment back in fp32 (may run out of memory: then the rest stay in 8 bits, still engaged)."""
        if not self._engaged:
            return
        for state in self.target.optimizer.state.values():
            for key, value in list(state.items()):
                if isinstance(value, Quantized):
                    state[key] = dequantize(value)
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._engaged = [], False


def _quantize_moments(state: dict[str, Any], into: dict[str, Any] | None = None) -> bool:
    """Every fp32 moment of ``state`` to 8 bits: into the 8-bit storage it was dequantized from (``into``, the
    state before the step), in place, where there is one. In place, the step needs no second copy of the codes
    while an undoable step's journal holds the old ones, and the journal can put them back."""
    changed = False
    for key, root in _MOMENTS.items():
        value = state.get(key)
        if isinstance(value, torch.Tensor) and value.numel() >= MIN_VALUES:
            before = (into or {}).get(key)
            if isinstance(before, Quantized) and before.shape == value.shape and before.root == root:
                fresh = quantize(value, root)
                before.codes.copy_(fresh.codes)
                before.scales.copy_(fresh.scales)
                state[key] = before
            else:
                state[key] = quantize(value, root)
            changed = True
    return changed


def _step_in_chunks(optimizer: torch.optim.Optimizer, *args: Any, raw: Any, **kwargs: Any) -> Any:
    """``raw`` (the optimizer's own step, without hooks) over a few parameters at a time, their moments in fp32
    only while it runs. On an error, moments not yet quantized again are put back as they were."""
    groups = optimizer.param_groups
    everything = [list(group["params"]) for group in groups]
    sizes = [p.numel() for params in everything for p in params if p.grad is not None]
    limit = max([*sizes, sum(sizes) // _CHUNKS, 1])
    chunks: list[list[set[int]]] = [[set() for _ in groups]]
    filled = 0
    for index, params in enumerate(everything):
        for param in params:
            if param.grad is None:
                continue
            if filled and filled + param.numel() > limit:
                chunks.append([set() for _ in groups])
                filled = 0
            chunks[-1][index].add(id(param))
            filled += param.numel()
    result = None
    try:
        for chunk in chunks:
            stepped = [p for index, params in enumerate(everything) for p in params if id(p) in chunk[index]]
            saved = {p: dict(optimizer.state[p]) for p in stepped if p in optimizer.state}
            for index, group in enumerate(groups):
                group["params"] = [p for p in everything[index] if id(p) in chunk[index]]
            try:
                for param, state in saved.items():
                    for key, value in state.items():
                        if isinstance(value, Quantized):
                            optimizer.state[param][key] = dequantize(value)
                result = raw(optimizer, *args, **kwargs)
            except BaseException:
                for param, state in saved.items():
                    optimizer.state[param].update(state)
                raise
            for param in stepped:
                _quantize_moments(optimizer.state[param], into=saved.get(param))
    finally:
        for group, params in zip(groups, everything, strict=True):
            group["params"] = params
    return result


def _tracked_by_scheduler(step: Any, optimizer: torch.optim.Optimizer) -> Any:
    """``step`` marked as a learning-rate scheduler's wrapper marks it: the scheduler sees the step happen."""

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return tracked


def _dequantized_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every 8-bit moment dequantized (fp32), in new dicts: the live state is not
    touched."""
    state_dict["state"] = {
        index: {key: dequantize(v) if isinstance(v, Quantized) else v for key, v in state.items()}
        for index, state in state_dict["state"].items()
    }
    return state_dict
