"""Architecture presets for the planner: the configs of well-known causal LMs, without their weights.

Each preset is the architecture part of the model's published ``config.json`` (sizes, heads, vocabulary,
tying, positional encoding); nothing is downloaded. ``load_config`` also reads a ``config.json`` path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard._extras import require

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["PRESETS", "config_dtype", "config_source", "load_config", "transformers_error"]

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


#: Fields that hold a size or a count (of tokens, layers, heads, features): where present, each must be a positive
#: int (or null, which some configs use for "derive it"), checked before transformers sees them so that a bad
#: value is named as such rather than surfacing as an arithmetic error deep in a model's constructor.
_SIZES = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings",
    "n_embd", "n_layer", "n_head", "n_positions", "n_ctx", "n_inner",  # GPT-2 style names
    "d_model", "num_layers", "num_heads", "ffn_dim", "d_ff",
)  # fmt: skip

#: How a JSON value that is not an object is called, for the error that says a config.json must be one.
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false"}


def load_config(spec: str | Path | PretrainedConfig | dict[str, Any]) -> PretrainedConfig:
    """A transformers config from a preset name, a ``config.json`` path, a dict or a config.

    Raises ``ValueError``, naming the file (or dict) and the fix, for a config transformers cannot use: not a
    JSON object, a size that is not a positive int, an unknown ``model_type``, or any field transformers rejects.

    >>> load_config("gpt2").n_layer
    12
    """
    # imported when needed: `import oomguard` stays light, and needs no transformers
    transformers = require("transformers", extra="hf", purpose="planning a transformers model (a preset or a config)")
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(spec, PretrainedConfig):
        return spec
    source = config_source(spec)
    if isinstance(spec, dict):
        fields: object = dict(spec)
    elif str(spec).lower() in PRESETS:
        fields = dict(PRESETS[str(spec).lower()])
    else:
        path = Path(spec)
        if path.is_dir():
            path, source = path / "config.json", str(path / "config.json")
        if not path.is_file():
            raise ValueError(
                f"unknown model {str(spec)!r}: give a preset ({', '.join(PRESETS)}) or the path of a "
                f"transformers config.json"
            )
        fields = _read_json(path)
    if not isinstance(fields, dict):
        kind = _JSON_KINDS.get(type(fields), "null")
        raise ValueError(
            f"{source}: not a JSON object but {kind}; a transformers config.json is one object of fields such "
            f'as "model_type" and "hidden_size"'
        )
    for name in _SIZES:
        value = fields.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"{source}: {name} must be a positive int, got {json.dumps(value)}; set it to the model's real size"
            )
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f'{source}: no model_type; a transformers config.json names one, e.g. "model_type": "llama"')
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{source}: transformers {transformers.__version__} does not know model_type {model_type!r}; use the "
            f"model_type of a causal LM it knows (llama, qwen2, gpt2...), or a newer transformers for a new model"
        )
    for ignored in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        fields.pop(ignored, None)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # transformers validates fields in many ways (ValueError, TypeError, its own errors)
        raise ValueError(
            f"{source}: transformers rejects this {model_type} config: {transformers_error(error)}; fix that field"
        ) from error


#: A config's ``torch_dtype`` (or ``dtype``) as the planner names a LoRA base's dtype.
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def config_dtype(spec: str | Path | PretrainedConfig | dict[str, Any]) -> str | None:
    """The dtype a config says its weights are stored in (its ``torch_dtype``, or ``dtype``), as ``"fp32"``,
    ``"bf16"`` or ``"fp16"``: what ``from_pretrained`` loads it in; None where it says none (the presets, many
    configs). ``ValueError`` for another dtype. Read from the same source :func:`load_config` reads.

    >>> config_dtype({"model_type": "llama", "torch_dtype": "bfloat16"}), config_dtype("gpt2")
    ('bf16', None)
    """
    from transformers import PretrainedConfig

    if isinstance(spec, PretrainedConfig):
        value: object = getattr(spec, "dtype", None) or getattr(spec, "torch_dtype", None)
    elif isinstance(spec, dict):
        value = spec.get("torch_dtype") or spec.get("dtype")
    elif str(spec).lower() in PRESETS:
        return None
    else:
        path = Path(spec)
        fields = _read_json(path / "config.json" if path.is_dir() else path)
        value = fields.get("torch_dtype") or fields.get("dtype") if isinstance(fields, dict) else None
    if value is None or value == "auto":
        return None
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(
            f"{config_source(spec)}: torch_dtype {name!r} is not a dtype the planner loads a LoRA base in; give "
            f"base_dtype= (--base-dtype) fp32, bf16, fp16 or nf4"
        )
    return _DTYPES[name]


def config_source(spec: str | Path | PretrainedConfig | dict[str, Any]) -> str:
    """How an error names the config it is about: the file's path, the preset, the dict or the config object."""
    if isinstance(spec, dict):
        return "the config dict"
    if isinstance(spec, str | Path):
        return f"preset {spec!r}" if str(spec).lower() in PRESETS else str(spec)
    return f"the {type(spec).__name__} given"


def transformers_error(error: BaseException) -> str:
    """An error raised inside transformers as a short line of text for our own message: its type (a bare
    ``KeyError: 'nosuch'`` says little without it) and its text with the line breaks and the long lists of
    every supported choice cut."""
    text = f"{type(error).__name__}: {' '.join(str(error).split()).rstrip('.')}"
    return text if len(text) <= 200 else text[:197] + "..."


def _read_json(path: Path) -> object:
    """The JSON document in ``path``; ``ValueError`` naming the file if it cannot be read or is not JSON."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise ValueError(
            f"{path}: cannot read it ({error.strerror or error}); check the path and its permissions"
        ) from error
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not JSON (not UTF-8 text); give the path of a transformers config.json") from error
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than the parser goes
        detail = "nested too deep" if isinstance(error, RecursionError) else str(error)
        raise ValueError(f"{path}: not JSON ({detail}); give the path of a transformers config.json") from error
