"""Small models with fixed seeds and random weights: an MLP for regression, tiny Llama and Qwen2; comparing weights."""

from __future__ import annotations

import copy

import torch

VOCAB = 64


def make_mlp(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


def make_llama(seed: int = 0, layers: int = 2, hidden: int = 32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model: torch.nn.Module = LlamaForCausalLM(config)
    return model


def make_qwen2(seed: int = 0, vocab: int = 2048, hidden: int = 32, layers: int = 2) -> torch.nn.Module:
    """A tiny Qwen2 with tied embeddings and a vocabulary larger than its hidden size by far: a model the
    chunked_loss rung applies to (its forward calls ``self.lm_head`` and then ``self.loss_function``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model: torch.nn.Module = Qwen2ForCausalLM(config)
    return model


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
