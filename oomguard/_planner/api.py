"""``oomguard.plan``: will a transformers model train on a device of a given size, and with which fallbacks?"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from oomguard._backends.units import parse_bytes
from oomguard._extras import require
from oomguard._ladder.rungs import Rung
from oomguard._planner.compose import uniform_blocks
from oomguard._planner.engine import dry_run
from oomguard._planner.lora import ALL_LINEAR, add_lora
from oomguard._planner.nf4 import quantize_linears
from oomguard._planner.presets import config_dtype, config_source, load_config, transformers_error
from oomguard._planner.report import PlanReport, Target
from oomguard._planner.speed import DeviceSpeed

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["BASE_DTYPES", "OPTIMIZERS", "plan"]

OptimizerName = Literal["adamw", "sgd"]
BaseDtype = Literal["fp32", "bf16", "fp16", "nf4"]
#: How a LoRA plan's frozen base can be loaded: its weights in fp32, bf16 or fp16, or its linear layers in NF4 as
#: bitsandbytes stores them (:mod:`oomguard._planner.nf4`; the rest in bf16).
BASE_DTYPES: tuple[BaseDtype, ...] = ("fp32", "bf16", "fp16", "nf4")
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "nf4": torch.bfloat16}
#: The optimizers the planner can build: AdamW, and SGD with momentum 0.9 (one state tensor per parameter).
_ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout")
_PER_LAYER = ("layer_types",)  # config fields with one entry per decoder layer
OPTIMIZERS: tuple[OptimizerName, ...] = ("adamw", "sgd")


def plan(
    model: str | Path | PretrainedConfig | dict[str, Any],
    *,
    gpu_memory: int | str,
    batch_size: int = 8,
    seq_len: int = 1024,
    optimizer: OptimizerName = "adamw",
    ladder: Iterable[str | Rung] | None = None,
    target: Target = "cuda",
    bf16: bool = True,
    max_grad_norm: float | None = None,
    speed: DeviceSpeed | None = None,
    lora_rank: int | None = None,
    lora_targets: str | Sequence[str] = ALL_LINEAR,
    host_memory: int | str | None = None,
    exact: bool = False,
    base_dtype: BaseDtype | None = None,
) -> PlanReport:
    """Plan a causal LM's training step on a device of ``gpu_memory`` bytes, without a GPU and without weights.

    One training step (forward, backward, optimizer step) runs on fake tensors for every plan along the
    ladder, until one fits. Takes seconds for a 1B-parameter model on a laptop CPU.

    Args:
        model: a preset name (see ``oomguard.planner.PRESETS``: ``"tinyllama-1.1b"``, ``"gpt2"``...), the path
            of a transformers ``config.json`` (or its folder), a config dict with ``model_type``, or a config.
        gpu_memory: the device's total memory, e.g. ``"6GiB"``.
        batch_size, seq_len: the batch, in sequences of ``seq_len`` tokens.
        optimizer: ``"adamw"`` or ``"sgd"`` (with momentum), as ``torch.optim`` runs them on CUDA (foreach).
        ladder: the guard's ladder (rung names or objects); the default ladder if None.
        target: ``"cuda"`` adds :func:`oomguard.planner.device_overhead` to every peak; ``"simulated"`` plans
            for a :class:`~oomguard.testing.SimulatedGPU` of that capacity (no overhead).
        bf16: whether the device runs bf16 (Ampere and newer); else mixed precision is fp16.
        max_grad_norm: plan with gradient clipping, as the guard's option of that name.
        speed: the device model that predicts each plan's step time (the recommendation is the fastest fitting
            plan by it); default: a 6 GB consumer GPU (see :class:`oomguard.planner.DeviceSpeed`).
        lora_rank: plan a LoRA fine-tune instead of a full one: the model frozen, rank-``lora_rank`` adapters on
            ``lora_targets`` (``"all-linear"``: every linear layer but the output head; or layer names as PEFT's
            ``target_modules``, e.g. ``["q_proj", "v_proj"]``) trained, as a PEFT LoRA job computes them
            (dropout 0.05, alpha ``2 * rank``). Its frozen weights are what ``quantized_weights`` quantizes.
        host_memory: the host memory the guard may fill (bytes or ``"16GiB"``, as the guard's ``host_memory=``;
            None: unlimited): a plan whose host bytes (offloaded state and masters, offloaded blocks, saved
            activations, the journal) are past it does not fit. ``oomguard plan`` gives this machine's.
        exact: measure every candidate with a full fake step of the model. By default a model of twelve or more
            identical blocks has each candidate composed from steps of one- and two-block copies of it (up to four
            where layers stream), and only the recommendation measured in full (:mod:`oomguard._planner.compose`):
            the same peaks within a fraction of a percent, in a fraction of the time.
        base_dtype: how a LoRA plan's frozen base is loaded: ``"fp32"``, ``"bf16"`` or ``"fp16"`` weights, or
            ``"nf4"``: every linear layer but the output head in 4 bits as bitsandbytes stores them (NF4 with nested
            statistics; the rest in bf16), a QLoRA, modelled without bitsandbytes. None: the config's
            ``torch_dtype`` (``from_pretrained`` loads that), else fp32. The report's ``model`` says which. A full
            fine-tune trains fp32 weights (mixed precision is the ``amp`` rung's): give it with ``lora_rank``.

    Raises ``ValueError`` for bad input: an argument out of range, or a config (file) transformers cannot build a
    causal LM from; the message names the file and the fix.

    >>> report = plan("gpt2", gpu_memory="6GiB", batch_size=2, seq_len=16)
    >>> report.recommended.describe(2), report.fits
    ('whole batch', True)
    """
    _check(optimizer, batch_size, seq_len, target, lora_rank, lora_targets)
    capacity = parse_bytes(gpu_memory)
    # (0, which the machine's figure can be: no host room at all; a size the user writes must be positive)
    host_budget = None if host_memory is None else 0 if host_memory == 0 else parse_bytes(host_memory)
    config = _training_config(model, seq_len, target)
    loaded = _base_dtype(model, base_dtype, lora_rank)
    label = model if isinstance(model, str) else getattr(config, "model_type", "model")
    source = config_source(model)
    with FakeTensorMode(), _quiet_transformers():
        net, opt, adapted = _trainable(config, source, optimizer, target, lora_rank, lora_targets, loaded)
        if adapted is not None:
            label = f"{label} with LoRA (rank {lora_rank} on {adapted} layers, base in {loaded})"
        ids = torch.zeros((batch_size, seq_len), dtype=torch.long)
        batch = {"input_ids": ids, "labels": torch.zeros_like(ids)}

        def shallow(blocks: int) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
            fewer, fewer_opt, _ = _trainable(
                _with_blocks(config, blocks), source, optimizer, target, lora_rank, lora_targets, loaded
            )
            return (lambda b: fewer(**b)), fewer, fewer_opt

        return dry_run(
            lambda b: net(**b), batch, model=net, optimizer=opt, capacity=capacity, target=target,
            label=str(label), ladder=ladder, max_grad_norm=max_grad_norm, bf16=bf16, seq_len=seq_len,
            optimizer_name="AdamW" if optimizer == "adamw" else "SGD (momentum 0.9)", speed=speed,
            host_budget=host_budget, shallow=None if exact or not uniform_blocks(config) else shallow, helper=True,
        )  # fmt: skip


def _trainable(
    config: PretrainedConfig,
    source: str,
    optimizer: str,
    target: str,
    lora_rank: int | None,
    lora_targets: str | Sequence[str],
    loaded: str = "fp32",
) -> tuple[torch.nn.Module, torch.optim.Optimizer, int | None]:
    """The model of ``config`` in training mode (with LoRA adapters where ``lora_rank`` is given: then also how
    many layers were adapted, over a base ``loaded`` as :data:`BASE_DTYPES` says) and its optimizer, as torch runs
    it on ``target``."""
    net = _build(config, source, None if lora_rank is None else _TORCH_DTYPES[loaded])
    adapted = None
    if lora_rank is not None:
        if loaded == "nf4":
            quantize_linears(net, _TORCH_DTYPES[loaded])
        adapted = add_lora(net, lora_rank, lora_targets)
    net.train()
    trainable = [p for p in net.parameters() if p.requires_grad]
    foreach = True if target == "cuda" else None  # torch's default on CUDA
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(trainable, lr=1e-4, foreach=foreach)
        if optimizer == "adamw"
        else torch.optim.SGD(trainable, lr=1e-3, momentum=0.9, foreach=foreach)
    )
    return net, opt, adapted


def _with_blocks(config: PretrainedConfig, blocks: int) -> PretrainedConfig:
    """A copy of ``config`` with ``blocks`` decoder layers (and per-layer settings for those only)."""
    fewer = copy.deepcopy(config)
    fewer.num_hidden_layers = blocks  # (transformers maps the name to the model's own: n_layer for GPT-2)
    for field in _PER_LAYER:
        if isinstance(getattr(fewer, field, None), list):
            setattr(fewer, field, getattr(fewer, field)[:blocks])
    return fewer


def _check(
    optimizer: str, batch_size: int, seq_len: int, target: str, lora_rank: int | None, lora_targets: object
) -> None:
    """:func:`plan`'s arguments, or the ``ValueError`` that names the one out of range."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if target not in ("cuda", "simulated"):
        raise ValueError(f"target must be 'cuda' or 'simulated', got {target!r}")
    if lora_rank is None and lora_targets != ALL_LINEAR:  # (a full fine-tune would ignore them)
        raise ValueError("lora_targets= names the layers a LoRA fine-tune adapts: give lora_rank= too")


def _base_dtype(model: object, given: object, lora_rank: int | None) -> str:
    """How the LoRA base is loaded (:data:`BASE_DTYPES`): ``given``, else the config's ``torch_dtype``, else fp32;
    fp32 for a full fine-tune. ``ValueError`` for a dtype not among them, or one given for a full fine-tune."""
    if given is not None and given not in BASE_DTYPES:
        raise ValueError(f"base_dtype must be one of {', '.join(BASE_DTYPES)}, got {given!r}")
    if lora_rank is None:
        if given is not None:
            raise ValueError(
                "base_dtype says how a LoRA fine-tune's frozen base is loaded: give lora_rank= too (a full "
                "fine-tune trains fp32 weights; the amp rung computes in bf16)"
            )
        return "fp32"
    return str(given) if given is not None else config_dtype(model) or "fp32"


def _training_config(model: str | Path | PretrainedConfig | dict[str, Any], seq_len: int, target: str) -> Any:
    """The model's config, set up as a training step on ``target`` runs it (no cache; on CUDA, no attention
    dropout mask kept)."""
    with _quiet_transformers():  # a config it cannot use is our one-line error, not its warnings and then ours
        config = load_config(model)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and seq_len > positions:
        raise ValueError(f"seq_len {seq_len} is longer than the model's {positions} positions; plan a shorter one")
    config.use_cache = False  # training keeps no key/value cache
    if target == "cuda":  # CUDA's fused attention keeps no dropout mask (it replays the RNG); the CPU's does
        for field in _ATTENTION_DROPOUT:
            if hasattr(config, field):
                setattr(config, field, 0.0)
    return config


def _build(config: PretrainedConfig, source: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The causal LM of ``config`` (on fake tensors, under the caller's mode), its weights in ``dtype`` (None: the
    config's).

    transformers accepts many configs it then cannot build a model from (an unknown activation, a rope setting
    of the wrong type...) and fails inside the model's constructor with whatever error that code meets; that is
    bad input all the same, reported as a ``ValueError`` naming the config, like every other bad input here.
    """
    from transformers import AutoModelForCausalLM  # imported when needed: `import oomguard` stays light
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"{source}: model_type {config.model_type!r} is not a causal LM transformers can build "
            f"(AutoModelForCausalLM has none for it); plan a decoder-only model such as llama, qwen2 or gpt2"
        )
    try:
        net: torch.nn.Module = AutoModelForCausalLM.from_config(config, **({} if dtype is None else {"dtype": dtype}))
    except Exception as error:  # whatever the model's constructor meets: see above
        raise ValueError(
            f"{source}: transformers cannot build a {config.model_type} model from it: {transformers_error(error)}; "
            f"fix the config's fields"
        ) from error
    return net


class _quiet_transformers:
    """Silence transformers' per-call notices (checkpointing and cache warnings) while planning."""

    def __enter__(self) -> None:
        require("transformers", extra="hf", purpose="planning a transformers model (a preset or a config)")
        from transformers.utils import logging as transformers_logging

        # transformers sets its logger's level when it first configures it, at the first import of one of its
        # modules: done here, so that a model module imported lazily inside the block does not undo the silence
        self._logger = transformers_logging.get_logger("transformers")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)
