"""The built-in rungs, one module each, registered here in canonical order: a new rung is one module and one
registration line (its declared ``after`` places it; see :mod:`oomguard._ladder.registry`)."""

from oomguard._ladder.rungs import register
from oomguard._rungs.activation_offload import ActivationOffload
from oomguard._rungs.amp import Amp
from oomguard._rungs.checkpointing import Checkpointing
from oomguard._rungs.chunked_loss import ChunkedLoss
from oomguard._rungs.layer_offload import LayerOffload
from oomguard._rungs.micro_batch import MicroBatch
from oomguard._rungs.optimizer_offload import OptimizerOffload
from oomguard._rungs.quantized_optimizer import QuantizedOptimizer
from oomguard._rungs.quantized_weights import QuantizedWeights
from oomguard._rungs.tiled_mlp import TiledMLP

__all__ = [
    "ActivationOffload",
    "Amp",
    "Checkpointing",
    "ChunkedLoss",
    "LayerOffload",
    "MicroBatch",
    "OptimizerOffload",
    "QuantizedOptimizer",
    "QuantizedWeights",
    "TiledMLP",
]

register(MicroBatch)
register(Amp)
register(Checkpointing)
register(ActivationOffload)
register(OptimizerOffload)
register(LayerOffload)
register(QuantizedOptimizer)
register(QuantizedWeights)
register(TiledMLP)
register(ChunkedLoss)  # (last: it follows no rung, so it is placed first, ahead of micro_batch)
