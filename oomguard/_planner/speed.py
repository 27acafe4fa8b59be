"""How long a plan's step takes, predicted from what the planner's fake run counts: a small model of a device.

A step's time is modelled as its matrix FLOPs (counted during the fake run by torch's own FLOP formulas,
``torch.utils.flop_counter``, checkpointing's recompute included) at the device's throughput for the step's
precision, plus its host<->device bytes over the link, plus the optimizer's work on the host (optimizer
offload, offloaded layers), plus a fixed cost per micro-batch (launches, synchronisation). The terms are added,
not overlapped: an upper bound where a step overlaps copies with compute.

The defaults describe a 6 GB consumer GPU of the RTX 2060/3060 class on PCIe 3.0; pass your own where you know
better (``oomguard plan --gpu-tflops ... --link-gbps ...``). The model ranks plans; it does not time a job.

>>> speed = DeviceSpeed()
>>> whole = speed.seconds(flops=8e12, precision=None, transfer_bytes=0, host_params=0, micro_batches=1)
>>> split = speed.seconds(flops=8e12, precision=None, transfer_bytes=0, host_params=0, micro_batches=8)
>>> round(whole, 3), split > whole
(1.233, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["DeviceSpeed", "FlopCount"]


class FlopCount(TorchDispatchMode):  # type: ignore[misc]
    """Counts the matrix FLOPs of the ops run inside it, by torch's own FLOP formulas.

    ``FlopCounterMode`` itself also tracks the module tree with hooks that keep tensors alive (checkpointed
    activations among them), which would change the very peaks the planner measures beside it.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.total += count(*args, **kwargs, out_val=out)
        return out


@dataclass(frozen=True)
class DeviceSpeed:
    """Throughputs of a device, as the planner's time model uses them."""

    #: Sustained half-precision (bf16/fp16) matrix throughput, in TFLOP/s; fp32 runs at half of it.
    gpu_tflops: float = 13.0
    #: Host<->device copy bandwidth, in GB/s (PCIe 3.0 x16 sustains about 12).
    link_gbps: float = 12.0
    #: Parameters the host's optimizer (a foreach AdamW on a desktop CPU) steps per second.
    host_params_per_second: float = 1.0e9
    #: Fixed cost of one micro-batch's forward and backward (kernel launches, synchronisation), in seconds.
    micro_batch_seconds: float = 2e-3

    def __post_init__(self) -> None:
        if not (self.gpu_tflops > 0 and self.link_gbps > 0 and self.host_params_per_second > 0):
            raise ValueError(f"device throughputs must be positive, got {self}")

    def seconds(
        self, *, flops: float, precision: str | None, transfer_bytes: int, host_params: int, micro_batches: int
    ) -> float:
        """The predicted time of one optimizer step."""
        tflops = self.gpu_tflops if precision is not None else self.gpu_tflops / 2
        return (
            flops / (tflops * 1e12)
            + transfer_bytes / (self.link_gbps * 1e9)
            + host_params / self.host_params_per_second
            + micro_batches * self.micro_batch_seconds
        )
