"""Client code the project did not write, as scenarios for the jump and the dry run: a GPT-2 with two parameter
groups and a warmup schedule, a PEFT LoRA Llama, a nanoGPT-style GPT with tied weights. Each scenario builds
``(model, forward, make)``: ``forward(model)`` is the step function, ``make(model)`` its optimizer and scheduler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from helpers.models import make_llama

SEQ, BATCH, STEPS = 64, 8, 3  # tokens a sequence, sequences a batch, batches a run


class NanoGPT(torch.nn.Module):
    """The shape of Karpathy's nanoGPT, written here: pre-norm blocks, causal attention, tied embeddings."""

    def __init__(self, vocab: int = 128, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(SEQ, width)
        self.blocks = torch.nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.attn(self.ln_1(x)).split(c, 2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln_2(x))


def gpt2() -> tuple[torch.nn.Module, Callable[[Any], Any], Callable[[torch.nn.Module], Any]]:
    import transformers

    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, vocab_size=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )  # (no dropout: comparable with a reference)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)

    def optimizer(m: torch.nn.Module) -> Any:
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in m.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))

    return model, lambda m: lambda b: m(input_ids=b["input_ids"], labels=b["input_ids"]).loss, optimizer


def lora() -> tuple[torch.nn.Module, Callable[[Any], Any], Callable[[torch.nn.Module], Any]]:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(make_llama(layers=2, hidden=64), config)

    def optimizer(m: torch.nn.Module) -> Any:
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3), None

    return model, lambda m: lambda b: m(input_ids=b["input_ids"], labels=b["input_ids"]).loss, optimizer


def nanogpt() -> tuple[torch.nn.Module, Callable[[Any], Any], Callable[[torch.nn.Module], Any]]:
    torch.manual_seed(0)

    def optimizer(m: torch.nn.Module) -> Any:
        return torch.optim.AdamW(m.parameters(), lr=1e-3), None

    return NanoGPT(), lambda m: lambda b: m(b["input_ids"][:, :-1], b["input_ids"][:, 1:]), optimizer


SCENARIOS = {"gpt2": gpt2, "peft-lora": lora, "nanogpt": nanogpt}


def scenario_batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 64, (BATCH, SEQ), generator=generator)} for _ in range(STEPS)]
