"""QLoRA's recipe on a tiny Llama, built offline: random weights saved to a folder and loaded back through
transformers' ``BitsAndBytesConfig`` (NF4, double quantization, bf16 compute), made ready for k-bit training and given
PEFT LoRA adapters on every linear layer but the head; and the same adapters on the Llama in fp32 (a PEFT LoRA)."""

from __future__ import annotations

import copy
import functools
import tempfile
from pathlib import Path
from typing import Any

import torch

from helpers.models import make_llama

RANK, LAYERS, HIDDEN = 4, 2, 64


def _adapters(model: torch.nn.Module, seed: int) -> Any:
    """PEFT LoRA on every linear layer but the head (QLoRA's choice), its B factors nonzero so that both factors
    train from the first step."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules="all-linear",
                             task_type="CAUSAL_LM")  # fmt: skip
    lora = peft.get_peft_model(model, config)
    for name, param in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return lora


def qlora(
    layers: int = LAYERS,
    hidden: int = HIDDEN,
    *,
    quant_storage: torch.dtype = torch.uint8,
    compute_dtype: torch.dtype = torch.bfloat16,
    tied: bool = False,
    seed: int = 0,
) -> Any:
    """A QLoRA as a user loads one: the base model's linear layers bitsandbytes ``Linear4bit`` NF4 (storing their
    codes as ``quant_storage``, computing in ``compute_dtype``: QLoRA's bf16, or bitsandbytes' default fp32), loaded
    from a folder (its other weights mapped from the file), then PEFT's adapters. ``tied``: the head shares the
    embeddings' weight."""
    import peft
    import transformers

    base = make_llama(seed, layers=layers, hidden=hidden)
    if tied:
        base.config.tie_word_embeddings = True
        base.tie_weights()
    quantized = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=quant_storage,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        base.save_pretrained(folder)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            Path(folder), quantization_config=quantized, device_map="cpu"
        )
    # (use_gradient_checkpointing=False: the checkpointing rung has its blocks to checkpoint)
    return _adapters(peft.prepare_model_for_kbit_training(loaded, use_gradient_checkpointing=False), seed)


def lora(layers: int = LAYERS, hidden: int = HIDDEN, seed: int = 0) -> Any:
    """The same adapters on the same Llama in fp32: a PEFT LoRA."""
    return _adapters(make_llama(seed, layers=layers, hidden=hidden), seed)


@functools.cache
def _template(hidden: int, compute_dtype: torch.dtype) -> Any:
    return qlora(hidden=hidden, compute_dtype=compute_dtype)


def qlora_copy(hidden: int = HIDDEN, compute_dtype: torch.dtype = torch.bfloat16) -> Any:
    """A copy of one QLoRA made once per process (a fresh load costs half a second): the same weights, adapters and
    quantization state each time, in storages of its own."""
    return copy.deepcopy(_template(hidden, compute_dtype))


def loadable(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, whose ``load_state_dict`` takes the state it saves (the fault sweep rebuilds each step's model from
    one): a 4-bit layer saves its quantization state beside its codes (``weight.absmax``, ``weight.quant_map``...) but
    loads none of it. Those entries are checked to be the model's own, bit for bit (nothing trains them), and left
    out of the load."""

    def hook(module: torch.nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        own = module.state_dict(prefix=prefix)
        held = {prefix + name for name, _ in [*module.named_parameters(), *module.named_buffers()]}
        for key in set(own) - held:
            if key in state and not torch.equal(_bytes(state.pop(key)), _bytes(own[key])):
                raise ValueError(f"{key}: a quantization state other than the model's own")

    model.register_load_state_dict_pre_hook(hook)
    return model


def four_bit(model: torch.nn.Module) -> dict[str, tuple[Any, list[torch.Tensor]]]:
    """Each 4-bit weight of ``model`` by name: the parameter object, and the bytes of its packed codes and of its
    quantization state's tensors, copied (what the guard must leave as it found them; as bytes: codes stored in
    bf16 read as floats are now and then NaN, which equals nothing)."""
    from oomguard._bitsandbytes import is_4bit, quant_state_tensors

    return {
        name: (param, [_bytes(t) for t in [param.data, *quant_state_tensors(param)]])
        for name, param in model.named_parameters()
        if is_4bit(param)
    }


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().reshape(-1).view(torch.uint8)
