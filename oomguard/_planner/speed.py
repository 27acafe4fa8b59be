"""How long a plan's step takes, predicted from what the planner's fake run counts: a small model of a device.

A step's time is modelled as its matrix FLOPs (counted during the fake run by torch's own FLOP formulas,
``torch.utils.flop_counter``, checkpointing's recompute included) at the device's throughput for the step's
precision, plus its host<->device bytes over the link, plus the optimizer's work on the host (optimizer
offload, offloaded layers), plus a fixed cost per operation and per micro-batch (launches, synchronisation). The
terms are added, but for two kinds of copies that run beside other work on a CUDA device, which cost only what that
work does not hide (the larger of the two counts):

* device to host on the copy stream during forward and backward (saved activations and gradients going down),
  beside the compute;
* the master level's stepped bf16 weights going up bucket by bucket while the host steps the next buckets
  (:mod:`oomguard._effects.ascent`), beside the host step; the last bucket's copies, with nothing left to step
  beside them, are added.

Other copies to the device are added (the compute waits for each: layer offload's blocks, level 1's weights).

The defaults describe a 6 GB consumer GPU of the RTX 2060/3060 class on PCIe 3.0; pass your own where you know
better (``oomguard plan --gpu-tflops ... --link-gbps ...``), or measure the device a job runs on with
:func:`measure_speed` (a fraction of a second: what the guard does before it times alternatives to a plan). The
model ranks plans; it does not time a job.

>>> speed = DeviceSpeed()
>>> whole = speed.seconds(flops=8e12, precision=None, transfer_bytes=0, host_params=0, micro_batches=1)
>>> split = speed.seconds(flops=8e12, precision=None, transfer_bytes=0, host_params=0, micro_batches=8)
>>> round(whole, 3), split > whole
(1.233, True)
>>> copies = dict(flops=8e12, precision=None, transfer_bytes=12 * 10**9, host_params=0, micro_batches=1)
>>> round(speed.seconds(**copies), 3), round(speed.seconds(**copies, overlapped_bytes=6 * 10**9), 3)
(2.233, 1.733)
>>> stepped = dict(copies, transfer_bytes=6 * 10**9, host_params=10**9)  # (1 s of host step, 0.5 s of copies up)
>>> round(speed.seconds(**stepped), 3), round(speed.seconds(**stepped, uploaded_beside_bytes=6 * 10**9), 3)
(2.733, 2.233)
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import flop_registry

__all__ = ["DeviceSpeed", "FlopCount", "measure_speed"]


class FlopCount(TorchDispatchMode):  # type: ignore[misc]
    """Counts the matrix FLOPs of the ops run inside it, by torch's own FLOP formulas.

    ``FlopCounterMode`` itself also tracks the module tree with hooks that keep tensors alive (checkpointed
    activations among them), which would change the very peaks the planner measures beside it.
    """

    def __init__(self, window: Callable[[], bool] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0
        self.ops = 0  # every operation dispatched, for the fixed cost of each
        self._window = window
        self.window = 0  # of ``total``, the FLOPs of ops run while ``window()`` said so (the last backward)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.note(func, args, kwargs, out)
        return out

    def note(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Count one operation dispatched, whose result is ``out``: what the mode does with each, for another mode
        that counts them beside its own work (:meth:`~oomguard._planner.reads.PlaceholderReads.counting`)."""
        self.ops += 1
        count = _formula(func._overloadpacket)
        if count is not None:
            flops = count(*args, **kwargs, out_val=out)
            self.total += flops
            if self._window is not None and self._window():
                self.window += flops


@functools.cache
def _formula(packet: Any) -> Callable[..., int] | None:
    """torch's FLOP formula for an op; an in-place op's (``addmm_``: the chunked loss's fp32 head gradient) is its
    out-of-place op's, which torch's registry alone has."""
    count = flop_registry.get(packet)
    if count is None and packet.__name__.endswith("_"):
        count = flop_registry.get(getattr(torch.ops.aten, packet.__name__[:-1], None))
    return count


@dataclass(frozen=True)
class DeviceSpeed:
    """Throughputs of a device, as the planner's time model uses them."""

    #: Sustained half-precision (bf16/fp16) matrix throughput, in TFLOP/s.
    gpu_tflops: float = 13.0
    #: Sustained fp32 matrix throughput, in TFLOP/s; None: half of ``gpu_tflops``.
    fp32_tflops: float | None = None
    #: Host<->device copy bandwidth, in GB/s (PCIe 3.0 x16 sustains about 12).
    link_gbps: float = 12.0
    #: Parameters the host's optimizer steps per second (torch's fused CPU AdamW, the guard's host step: bound by a
    #: desktop's memory bandwidth, as it reads and writes about 28 bytes a parameter).
    host_params_per_second: float = 1.0e9
    #: Fixed cost of one micro-batch's forward and backward (kernel launches, synchronisation), in seconds.
    micro_batch_seconds: float = 2e-3
    #: Fixed cost of one operation (dispatch; on a GPU mostly hidden behind the kernels before it), in seconds.
    op_seconds: float = 0.0

    def __post_init__(self) -> None:
        rates = {"gpu_tflops": self.gpu_tflops, "fp32_tflops": self.fp32_tflops or 1.0, "link_gbps": self.link_gbps,
                 "host_params_per_second": self.host_params_per_second}  # fmt: skip
        costs = {"micro_batch_seconds": self.micro_batch_seconds, "op_seconds": self.op_seconds}
        for name, value in {**rates, **costs}.items():  # (an infinite rate would predict every plan takes no time)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if value <= 0 if name in rates else value < 0:
                raise ValueError(f"{name} must be {'positive' if name in rates else 'at least 0'}, got {value!r}")

    def seconds(
        self,
        *,
        flops: float,
        precision: str | None,
        transfer_bytes: int,
        host_params: int,
        micro_batches: int,
        ops: float = 0,
        overlapped_bytes: int = 0,
        uploaded_beside_bytes: int = 0,
        early_params: int = 0,
        early_window_flops: float = 0.0,
    ) -> float:
        """The predicted time of one optimizer step. ``overlapped_bytes`` of ``transfer_bytes`` are copies that run
        beside the compute (device to host on a side stream while forward and backward go on: saved activations,
        gradients on their way down), and ``uploaded_beside_bytes`` copies to the device that run beside the host
        step (the master level's stepped weights, bucket by bucket): each costs only what the work beside it does
        not hide. ``early_params`` of ``host_params`` step during the last micro-batch's backward
        (``early_window_flops`` of compute, :mod:`oomguard._effects.early`), journaled first (about as much host
        work again): they cost only what that backward does not hide."""
        tflops = self.gpu_tflops if precision is not None else (self.fp32_tflops or self.gpu_tflops / 2)
        compute, link = flops / (tflops * 1e12), self.link_gbps * 1e9
        early = 2 * early_params / self.host_params_per_second  # (the journal's copies, then the step)
        host = (host_params - early_params) / self.host_params_per_second
        host += max(0.0, early - early_window_flops / (tflops * 1e12))
        return (
            max(compute, overlapped_bytes / link)
            + (transfer_bytes - overlapped_bytes - uploaded_beside_bytes) / link
            + max(host, uploaded_beside_bytes / link)
            + micro_batches * self.micro_batch_seconds
            + ops * self.op_seconds
        )


def measure_speed(device: torch.device, backend: Any = None) -> DeviceSpeed:
    """The device model of ``device``, measured in a fraction of a second: fp32 and bf16 matrix throughput, the
    cost of one small operation, host<->device copies (through ``backend``, a memory backend, where given) and
    a host AdamW step.

    On the CPU (and a :class:`~oomguard.testing.SimulatedGPU`, whose device is the CPU) the tensors are host
    memory, measured outside every dispatch mode, so measuring allocates nothing a simulated budget counts; on
    CUDA they are small device tensors (a few MiB).

    >>> speed = measure_speed(torch.device("cpu"))
    >>> speed.gpu_tflops > 0 and speed.fp32_tflops > 0 and speed.op_seconds > 0
    True
    """
    if device.type != "cuda":
        with _disable_current_modes():  # (a simulator's accounting would count the tensors made here)
            return _measured(device, None)
    return _measured(device, backend)


def _measured(device: torch.device, backend: Any) -> DeviceSpeed:
    cuda = device.type == "cuda"
    size = 2048 if cuda else 256

    def drawn(*shape: int, on: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # A generator of its own, seeded: the same numbers each measure, and the job's random streams (dropout,
        # shuffling, on the host and the device) left where they were
        return torch.randn(*shape, generator=torch.Generator(on).manual_seed(0), device=on, dtype=dtype)

    def tensor(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if cuda:
            return drawn(*shape, on=device, dtype=dtype)
        made = drawn(*shape)
        return (made if backend is None else backend.to_host(made)).to(dtype)  # (what ops on it make: host too)

    def best(run: Callable[[], Any], repeats: int = 3) -> float:
        run()  # warm up (kernels, caches)
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            run()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        return max(min(times), 1e-9)

    flops = 2 * size**3
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = tensor(size, size, dtype=dtype), tensor(size, size, dtype=dtype)
        rates[dtype] = flops / best(functools.partial(torch.matmul, a, b)) / 1e12
    one = tensor(1)
    op_seconds = best(lambda: [one.add(1) for _ in range(100)]) / 100
    moved = tensor(1 << 20 if cuda else 1 << 16)  # 4 MiB on CUDA, 256 KiB on the host
    if cuda:
        host = torch.empty(moved.shape, dtype=moved.dtype, pin_memory=True)
        copy_seconds = best(lambda: host.copy_(moved))
    else:
        copy_seconds = best(lambda: moved.clone())
    params = [torch.nn.Parameter(drawn(1 << 16) if cuda else tensor(1 << 16))]  # (the host optimizer: host tensors)
    params[0].grad = torch.ones_like(params[0])
    adam = torch.optim.AdamW(params, foreach=True)
    adam_seconds = best(adam.step)
    return DeviceSpeed(
        gpu_tflops=rates[torch.bfloat16], fp32_tflops=rates[torch.float32],
        link_gbps=moved.numel() * moved.element_size() / copy_seconds / 1e9,
        host_params_per_second=params[0].numel() / adam_seconds, micro_batch_seconds=0.0, op_seconds=op_seconds,
    )  # fmt: skip
