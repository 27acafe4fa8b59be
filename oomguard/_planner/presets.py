"""Architecture presets for the planner: the configs of well-known causal LMs, without their weights.

Each preset is the architecture part of the model's published ``config.json`` (sizes, heads, vocabulary,
tying, positional encoding); nothing is downloaded. ``load_config`` also reads a ``config.json`` path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["PRESETS", "load_config"]

_LLAMA_ROPE_3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: Built-in presets: name -> the architecture fields of the model's config.json.
PRESETS: dict[str, dict[str, Any]] = {
    "tinyllama-1.1b": {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False,
    },
    "llama-3.2-1b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": _LLAMA_ROPE_3,
        "tie_word_embeddings": True,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    },
    "gpt2": {
        "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
    },
    "gpt2-medium": {
        "model_type": "gpt2", "vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_positions": 1024,
    },
}  # fmt: skip


def load_config(spec: str | Path | PretrainedConfig | dict[str, Any]) -> PretrainedConfig:
    """A transformers config from a preset name, a ``config.json`` path, a dict or a config.

    >>> load_config("gpt2").n_layer
    12
    """
    from transformers import AutoConfig, PretrainedConfig  # imported when needed: `import oomguard` stays light

    if isinstance(spec, PretrainedConfig):
        return spec
    if isinstance(spec, dict):
        fields = dict(spec)
    elif str(spec).lower() in PRESETS:
        fields = dict(PRESETS[str(spec).lower()])
    else:
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"unknown model {str(spec)!r}: give a preset ({', '.join(PRESETS)}) or the path of a "
                f"transformers config.json"
            )
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read {path} as a transformers config.json: {error}") from error
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f"the config for {str(spec)!r} has no model_type; a transformers config.json names one")
    for ignored in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        fields.pop(ignored, None)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as error:
        raise ValueError(f"transformers does not know model_type {model_type!r}: {error}") from error
