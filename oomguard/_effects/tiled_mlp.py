"""The tiled_mlp rung's mechanism: each block's MLP run over chunks (shards) of tokens, so that its whole-sequence
intermediates (3 x tokens x intermediate for a gated MLP) never exist at once.

Forward runs the MLP chunk by chunk under ``no_grad`` and keeps only its input (through the saved-tensor hooks,
so activation offload and checkpointing see it as any saved tensor). Backward recomputes each chunk and
back-propagates it alone; the weight gradients are summed over the chunks in fp32 and handed to autograd once
(so DDP's reducer and every gradient hook fire once per parameter, as without tiling). Dropout inside the MLP
replays its random draws: the recompute starts from the generators' state the forward started from, chunk after
chunk in the same order (a tiled step draws other masks than an untiled one, as a split batch does).

The MLP is found by structure, not by model type: each repeated block's ``mlp`` or ``feed_forward`` child, made
only of position-wise parts (linear layers, norms, dropout and parameterless activations) and checked by a probe
that runs it on a few random tokens whole and split. MoE blocks (routers, experts) and anything that mixes tokens
are refused (:func:`why_not_tiled`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from oomguard._backends.memory import MemoryBackend
from oomguard._effects.base import Effect, EffectTarget
from oomguard._effects.sharding import is_fsdp
from oomguard._errors import GuardConfigError
from oomguard._ladder.plan import Plan

__all__ = ["TiledMLPEffect", "find_mlp", "shards_at", "tile", "why_not_tiled"]

NAME = "tiled_mlp"
#: The names a decoder layer gives its MLP (Llama, Qwen, Mistral, Gemma, GPT-2...: ``mlp``; Llama 4: ``feed_forward``).
MLP_NAMES = ("mlp", "feed_forward")
_PROBE_TOKENS = 4
_MISSING = object()


def shards_at(level: int) -> int:
    """The number of chunks of tokens the rung's ``level`` runs each MLP in: 2, 4, 8 ... (a doubling walk)."""
    return int(2**level)


def find_mlp(block: torch.nn.Module) -> torch.nn.Module | None:
    """The block's MLP: its child named ``mlp`` or ``feed_forward``, if it has one."""
    for name in MLP_NAMES:
        child = getattr(block, name, None)
        if isinstance(child, torch.nn.Module):
            return child
    return None


def why_not_tiled(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> str | None:
    """Why the MLPs of ``blocks`` cannot be tiled exactly, in words for a message; None where they can."""
    if not blocks:
        return f"{type(model).__name__} has no repeated blocks (decoder layers) whose MLP could be tiled"
    probed: set[type] = set()
    for index, block in enumerate(blocks):
        mlp = find_mlp(block)
        if mlp is None:
            children = ", ".join(name for name, _ in block.named_children())
            return (
                f"block {index} ({type(block).__name__}) has no child named {' or '.join(MLP_NAMES)} (it has: "
                f"{children}); a mixture of experts or another feed-forward layout is not tiled"
            )
        reason = _structure(mlp)
        if reason is None and type(mlp) not in probed:
            reason = _probe(mlp, _width(model, mlp))
            probed.add(type(mlp))
        if reason is not None:
            return f"the MLP of block {index} ({type(mlp).__name__}) {reason}"
    return None


def _structure(mlp: torch.nn.Module) -> str | None:
    """Why ``mlp`` is not made of position-wise parts only, if it is not."""
    for name, module in mlp.named_modules():
        words = f"{name.rsplit('.', 1)[-1]} {type(module).__name__}".lower()
        if any(word in words for word in ("expert", "router", "moe")) or isinstance(module, torch.nn.ModuleList):
            return f"routes tokens to experts ({name or 'itself'}: {type(module).__name__}): a mixture of experts"
        if any(True for _ in module.children()):
            continue
        if not _position_wise(module):
            return f"holds {name} ({type(module).__name__}), which is not known to act on each token alone"
    return None


def _position_wise(leaf: torch.nn.Module) -> bool:
    if isinstance(leaf, (torch.nn.Linear, torch.nn.Dropout, torch.nn.Identity, torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return True
    kind = type(leaf).__name__
    if kind == "Conv1D" or kind.endswith(("RMSNorm", "LayerNorm")):  # (transformers' GPT-2 linear; its norms)
        return True
    # Parameterless modules (activations): what they do to values is the probe's to check.
    return not any(True for _ in leaf.parameters(recurse=False)) and not any(True for _ in leaf.buffers(False))


def _width(model: torch.nn.Module, mlp: torch.nn.Module) -> int | None:
    """The width of the MLP's input: the model config's ``hidden_size``, else its first linear layer's input."""
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    if isinstance(size, int):
        return size
    for module in mlp.modules():
        if isinstance(module, torch.nn.Linear):
            return module.in_features
        weight = getattr(module, "weight", None)
        if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):
            return int(weight.shape[0])
    return None


def _probe(mlp: torch.nn.Module, width: int | None) -> str | None:
    """Why ``mlp`` is not position-wise on a few random tokens (whole, then split), if it is not.

    Runs outside any dispatch mode (a simulated device's, the planner's fakes), without gradients and with dropout
    off (each flag put back), on random values from its own generator (the job's are not drawn from). On
    parameters with no values (meta or fake: the planner's model), the structure above is all that is checked.
    """
    params = list(mlp.parameters())
    if not params:
        return None
    first = params[0]
    if width is None:
        return "has no linear layer to read the width of its input from"
    if first.is_meta or type(first).__name__ == "FakeTensor" or not isinstance(first, torch.Tensor):
        return None
    modes = {module: module.training for module in mlp.modules()}
    try:
        with _disable_current_modes(), torch.no_grad():
            mlp.eval()
            values = torch.randn(1, _PROBE_TOKENS, width, generator=torch.Generator().manual_seed(0))
            tokens = values.to(first.device, _float_dtype(params))
            whole = mlp(tokens)
            if not isinstance(whole, torch.Tensor) or whole.shape[:-1] != tokens.shape[:-1]:
                return f"returns {type(whole).__name__}, not one tensor with a row per token: it is not tiled"
            split = torch.cat([mlp(tokens[:, :1]), mlp(tokens[:, 1:3]), mlp(tokens[:, 3:])], dim=1)
    except Exception as error:  # (a forward that wants more than the hidden states: not one that can be tiled)
        return f"could not be run on {_PROBE_TOKENS} tokens of width {width} alone ({type(error).__name__}: {error})"
    finally:
        for module, training in modes.items():
            module.training = training
    tolerance = 1e-4 if whole.dtype == torch.float32 else 2e-2
    if not torch.allclose(split.float(), whole.float(), rtol=tolerance, atol=tolerance):
        return "mixes tokens: its output for some tokens changes when the other tokens are left out"
    return None


def _float_dtype(params: list[torch.nn.Parameter]) -> torch.dtype:
    return next((p.dtype for p in params if p.is_floating_point()), torch.float32)


# -- the tiled MLP ------------------------------------------------------------------------------------------------


def tile(blocks: list[torch.nn.Module], shards: int) -> Callable[[], None]:
    """Run the MLP of each of ``blocks`` in ``shards`` chunks of tokens; returns the function that puts each MLP's
    ``forward`` back as it was (an instance attribute the user had set included)."""
    mlps = [mlp for mlp in map(find_mlp, blocks) if mlp is not None]
    previous = [vars(mlp).get("forward", _MISSING) for mlp in mlps]
    for mlp in mlps:
        mlp.forward = _tiled(mlp, mlp.forward, shards)  # type: ignore[method-assign]

    def undo() -> None:
        for mlp, forward in zip(mlps, previous, strict=True):
            if forward is _MISSING:
                vars(mlp).pop("forward", None)
            else:
                mlp.forward = forward  # type: ignore[method-assign]

    return undo


def _tiled(mlp: torch.nn.Module, original: Callable[..., Any], shards: int) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            raise GuardConfigError(
                f"the tiled_mlp rung runs {type(mlp).__name__}.forward on its hidden states alone, but it was called "
                f"with {len(args)} positional and {sorted(kwargs)} keyword argument(s): leave tiled_mlp out of the "
                f"ladder for this model"
            )
        hidden = args[0]
        if not torch.is_grad_enabled():  # (evaluation: chunk by chunk, nothing kept)
            return _chunked(original, hidden.reshape(-1, hidden.shape[-1]), shards).view(*hidden.shape[:-1], -1)
        params = [p for p in mlp.parameters() if p.requires_grad]
        out: torch.Tensor = _TiledMLP.apply(original, shards, hidden, *params)  # type: ignore[no-untyped-call]
        return out

    return forward


def _bounds(tokens: int, shards: int) -> list[tuple[int, int]]:
    size = max(1, math.ceil(tokens / shards))
    return [(start, min(start + size, tokens)) for start in range(0, tokens, size)]


def _chunked(fn: Callable[..., Any], rows: torch.Tensor, shards: int) -> torch.Tensor:
    """``fn`` of ``rows`` (tokens x width), computed chunk by chunk into one output: no chunk list beside it."""
    if rows.shape[0] == 0:
        return fn(rows.unsqueeze(0)).squeeze(0)  # type: ignore[no-any-return]
    out: torch.Tensor | None = None
    for start, end in _bounds(rows.shape[0], shards):
        part = fn(rows[start:end].unsqueeze(0)).squeeze(0)  # (a batch of one: the rank the forward was written for)
        if out is None:
            out = part.new_empty((rows.shape[0], *part.shape[1:]))
        out[start:end] = part
        del part
    assert out is not None  # (at least one chunk: its tokens are not none)
    return out


class _TiledMLP(torch.autograd.Function):
    """An MLP over chunks of tokens: keeps its input alone; backward recomputes and back-propagates chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], shards: int, hidden: torch.Tensor, *params: torch.Tensor) -> Any:
        ctx.fn, ctx.shards, ctx.params, ctx.shape = fn, shards, params, hidden.shape
        ctx.rng = _RandomState(hidden.device)
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.save_for_backward(hidden)
        rows = hidden.detach().reshape(-1, hidden.shape[-1])
        with torch.no_grad():
            out = _chunked(fn, rows, shards)
        return out.view(*hidden.shape[:-1], *out.shape[1:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (hidden,) = ctx.saved_tensors
        rows = hidden.detach().reshape(-1, hidden.shape[-1])
        grad_rows = grad.reshape(rows.shape[0], -1)
        wants_input = ctx.needs_input_grad[2]
        grad_input = torch.empty_like(rows) if wants_input else None
        sums: list[torch.Tensor | None] = [None] * len(ctx.params)  # (each weight's gradient, summed in fp32)
        with ctx.rng.replayed(), torch.enable_grad(), _autocast(ctx.autocast):
            for start, end in _bounds(rows.shape[0], ctx.shards):
                part = rows[start:end].detach().requires_grad_(wants_input)
                out = ctx.fn(part.unsqueeze(0)).squeeze(0)
                leaves = ([part] if wants_input else []) + list(ctx.params)
                grads = torch.autograd.grad(out, leaves, grad_rows[start:end], allow_unused=True)
                del out
                if grad_input is not None:
                    grad_input[start:end] = grads[0]
                for index, got in enumerate(grads[1:] if wants_input else grads):
                    if got is not None:
                        sums[index] = got.float() if sums[index] is None else sums[index].add_(got)  # type: ignore[union-attr]
                del grads
        weights = [s if s is None else s.to(p.dtype) for s, p in zip(sums, ctx.params, strict=True)]
        shaped = None if grad_input is None else grad_input.view(ctx.shape)
        return (None, None, shaped, *weights)


class _RandomState:
    """The generators' state as a forward began, for its recompute to draw the same dropout masks; only the CPU's
    and the device's default generators (what dropout draws from)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def _autocast_state(device_type: str) -> dict[str, Any] | None:
    if not torch.is_autocast_enabled(device_type):
        return None
    return {"device_type": device_type, "dtype": torch.get_autocast_dtype(device_type)}


def _autocast(state: dict[str, Any] | None) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if state is None else torch.autocast(**state)


class TiledMLPEffect(Effect):
    """Tiles each block's MLP at the plan's shard count while the plan has the rung; undone exactly."""

    def __init__(self, target: EffectTarget) -> None:
        super().__init__(target)
        self._shards = 0
        self._undo: Callable[[], None] | None = None

    def check(self, plan: Plan) -> None:
        if plan.level(NAME) and not self._shards:
            reason = why_not_tiled(self.target.model, self.target.blocks)
            if is_fsdp(self.target.model):
                reason = "the model is sharded by FSDP2, which frees each block's weights that every chunk reads again"
            if reason is not None:
                raise GuardConfigError(f"the plan has tiled_mlp, but {reason}: leave tiled_mlp out of the plan")

    def apply(self, plan: Plan, backend: MemoryBackend) -> bool:
        level = plan.level(NAME)
        shards = shards_at(level) if level else 0
        if shards == self._shards:
            return False
        self.close()
        if shards:
            self._undo, self._shards = tile(self.target.blocks, shards), shards
        return True

    @property
    def holds(self) -> bool:
        return self._undo is not None

    @property
    def held(self) -> str:
        return f"the MLPs tiled in {self._shards} chunks of tokens"

    def suspended(self) -> contextlib.AbstractContextManager[None] | None:
        return self._aside(self._shards) if self._undo is not None else None

    @contextlib.contextmanager
    def _aside(self, shards: int) -> Iterator[None]:
        """The MLPs as the user made them for the planner's dry run (which tiles them itself where a plan it
        measures has the rung), tiled again after."""
        self.close()
        try:
            yield
        finally:
            self._undo, self._shards = tile(self.target.blocks, shards), shards

    def close(self) -> None:
        if self._undo is not None:
            self._undo()
        self._undo, self._shards = None, 0
