"""How fast an Adam step runs on the host: torch's three CPU paths, DeepSpeed's CPU Adam, and the guard's host step.

Where optimizer offload (and layer offload) step the optimizer on the host, that step's speed is the rung's cost:
the CPU makes one pass over the parameters, their gradients and both moments per pass of the kernel. This times one
AdamW step over ``--params`` fp32 parameters (1024 x 1024 matrices) for each contender, interleaved (each round runs
every contender once, in a rotated order, so that drifts in machine load hit all alike), and gives the median over
rounds as parameters per second (higher is better), with one thread and with all of them:

* ``loop``: ``AdamW(foreach=False)``, torch's per-parameter loop (what torch picks for CPU tensors by default);
* ``foreach``: ``AdamW(foreach=True)``, the multi-tensor path;
* ``fused``: ``AdamW(fused=True)``, torch's fused CPU kernel;
* ``deepspeed``: DeepSpeed's ``DeepSpeedCPUAdam`` (AdamW mode), where it imports and builds (else the reason);
* ``guard fused`` / ``guard exact``: the optimizer step inside a guard on ``Plan(optimizer_offload=True)`` under a
  SimulatedGPU, with ``host_step="fused"`` (the default) and ``"exact"``: the user's unfused ``AdamW`` stepping the
  host copies, timed alone (from the optimizer's step pre-hook to its post-hook: the copies down and up are not in
  it). ``guard ... call`` is the whole guarded call (a forward and backward of batch 1 on the same model, the copies,
  the step), for scale.

Memory: about 100 bytes a parameter (four optimizers' moments over one set of weights, two guards' models with
their host copies and state): 5 GB at the default 50 M.

    python benchmarks/host_step.py [--params 20e6 50e6] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from oomguard import OOMGuard, Plan
from oomguard.testing import SimulatedGPU

WIDTH = 1024  # each parameter a WIDTH x WIDTH matrix: a hidden layer's size in a small LM
LR = 1e-4
HostStep = Literal["fused", "exact"]  # (the guard's host_step= option)
HOST_STEPS: tuple[HostStep, ...] = ("fused", "exact")


def _matrices(params: float) -> list[torch.nn.Parameter]:
    """fp32 parameters of about ``params`` elements, each with a gradient."""
    generator = torch.Generator().manual_seed(0)
    count = max(1, round(params / (WIDTH * WIDTH)))
    tensors = [torch.nn.Parameter(torch.randn(WIDTH, WIDTH, generator=generator) * 0.02) for _ in range(count)]
    for tensor in tensors:
        tensor.grad = torch.randn(WIDTH, WIDTH, generator=generator) * 1e-3
    return tensors


def _deepspeed(params: list[torch.nn.Parameter]) -> tuple[Callable[[], object] | None, str]:
    """DeepSpeed's CPU Adam over ``params`` (its op built on first use), or None and why not."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        optimizer = DeepSpeedCPUAdam(params, lr=LR, adamw_mode=True)
    except Exception as exc:  # (not installed, or its C++ op does not build here: the table says which)
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return optimizer.step, "DeepSpeedCPUAdam(adamw_mode=True)"


class _GuardedStep:
    """A guard on ``Plan(optimizer_offload=True)`` training a stack of the matrices, its optimizer step timed alone
    by the optimizer's own step hooks (inside the guard's host context: the host copies are in)."""

    def __init__(self, params: float, host_step: HostStep, gpu: SimulatedGPU) -> None:
        count = max(1, round(params / (WIDTH * WIDTH)))
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(count)])
        gpu.adopt(self.model)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.guard = OOMGuard(self._loss, model=self.model, optimizer=optimizer, ladder=[], tune_after=None,
                              predictive=False, log_every=None, host_step=host_step)  # fmt: skip
        self.guard.plan = Plan(optimizer_offload=True)
        self.batch = torch.randn(1, WIDTH)
        self.step_seconds = 0.0
        self.calls: list[float] = []  # each guarded call's whole time
        started: list[float] = []
        optimizer.register_step_pre_hook(lambda *_: started.append(time.perf_counter()))
        optimizer.register_step_post_hook(lambda *_: self._stepped(started.pop()))

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.model(batch).square().mean()
        return loss

    def _stepped(self, started: float) -> None:
        self.step_seconds = time.perf_counter() - started

    def timed_step(self) -> float:
        """One guarded call: the seconds of its optimizer step (the whole call's go to ``calls``)."""
        started = time.perf_counter()
        self.guard(self.batch)
        self.calls.append(time.perf_counter() - started)
        return self.step_seconds


def _rounds(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The median seconds of each contender over ``rounds`` interleaved rounds (after one warm-up round)."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds + 1):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:  # (a rotated order: no contender always runs first)
            seconds = contenders[name]()
            if index:
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def _timer(step: Callable[[], object]) -> Callable[[], float]:
    def timed() -> float:
        started = time.perf_counter()
        step()
        return time.perf_counter() - started

    return timed


def measure(params: float, rounds: int, threads: int) -> dict[str, Any]:
    """Parameters per second of each contender's step over ``params`` parameters, on ``threads`` threads."""
    torch.set_num_threads(threads)
    contenders: dict[str, Callable[[], float]] = {}
    notes: dict[str, str] = {}
    tensors = _matrices(params)  # (shared: each optimizer keeps its own moments; the weights' drift costs nothing)
    count = sum(t.numel() for t in tensors)
    for name, foreach, fused in (("loop", False, None), ("foreach", True, None), ("fused", None, True)):
        contenders[name] = _timer(torch.optim.AdamW(tensors, lr=LR, foreach=foreach, fused=fused).step)
    ds_step, notes["deepspeed"] = _deepspeed(tensors)
    if ds_step is not None:
        contenders["deepspeed"] = _timer(ds_step)
    with SimulatedGPU("1TiB") as gpu:
        guards = {host_step: _GuardedStep(params, host_step, gpu) for host_step in HOST_STEPS}
        for host_step, guarded in guards.items():
            contenders[f"guard {host_step}"] = guarded.timed_step
        seconds = _rounds(contenders, rounds)
        for host_step, guarded in guards.items():
            seconds[f"guard {host_step} call"] = statistics.median(guarded.calls[1:])  # (the warm-up round left out)
            guarded.guard.close()
    per_second = {name: count / value for name, value in seconds.items()}
    return {"parameters": count, "threads": threads, "seconds": seconds, "parameters_per_s": per_second,
            "notes": notes}  # fmt: skip


def _table(results: list[dict[str, Any]]) -> str:
    names = list(results[0]["parameters_per_s"])
    lines = ["| parameters | threads | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for result in results:
        rates = [f"{result['parameters_per_s'][name] / 1e6:.0f} M/s" for name in names]
        lines.append(f"| {result['parameters'] / 1e6:.0f} M | {result['threads']} | " + " | ".join(rates) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, nargs="+", default=[20e6, 50e6])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    cores = torch.get_num_threads()
    results = []
    for params in args.params:
        for threads in sorted({1, cores}):
            results.append(measure(params, args.rounds, threads))
            gc.collect()  # (the guards' hooks hold cycles: the next size must not find this one's tensors alive)
            print(_table(results[-1:]), flush=True)
    print(_table(results))
    for note, text in results[0]["notes"].items():
        print(f"{note}: {text}")
    if args.json is not None:
        meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "cores": cores}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
