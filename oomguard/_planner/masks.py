"""Planning transformers models on fake tensors: the attention masks they would skip on real unpadded batches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch._subclasses.fake_tensor import is_fake

__all__ = ["unpadded_masks"]


@contextlib.contextmanager
def unpadded_masks() -> Iterator[None]:
    """Let transformers skip the attention mask on fake tensors as it does on real unpadded, unpacked batches.

    With real data, transformers checks that the attention mask pads nothing and that the position ids pack
    no second sequence, and then lets SDPA run causal without materialising a (batch, 1, seq, seq) mask. On
    fake tensors it cannot read those values and builds the full mask, which costs memory a real run would not
    spend. The planner plans full-length single sequences, so it answers both checks itself. A real batch that
    is padded or packed needs that mask on top.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    patches: dict[str, Callable[..., Any]] = {}
    skip_mask, find_packed = (
        getattr(masking_utils, name, None) for name in ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices")
    )
    if skip_mask is not None:
        patches["_ignore_causal_mask_sdpa"] = lambda padding, *args, **kwargs: skip_mask(
            None if padding is not None and is_fake(padding) else padding, *args, **kwargs
        )
    if find_packed is not None:
        patches["find_packed_sequence_indices"] = lambda ids: None if is_fake(ids) else find_packed(ids)
    originals = {name: getattr(masking_utils, name) for name in patches}
    try:
        for name, patch in patches.items():
            setattr(masking_utils, name, patch)
        yield
    finally:
        for name, original in originals.items():
            setattr(masking_utils, name, original)
