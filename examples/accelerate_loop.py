"""A Hugging Face Accelerate loop, guarded: pass accelerator= and the prepared model and optimizer.

Run: python examples/accelerate_loop.py  (or `accelerate launch examples/accelerate_loop.py` on several GPUs).
On a CPU it runs under a simulated GPU small enough that the batch of 128 does not fit whole.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from accelerate import Accelerator

from oomguard import oom_guard
from oomguard.testing import SimulatedGPU


def main(steps: int = 5) -> float:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    # Backward and clipping go through the accelerator (its loss scaling and mixed precision included).
    @oom_guard(model=model, optimizer=optimizer, accelerator=accelerator, max_grad_norm=1.0)
    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)

    generator = torch.Generator().manual_seed(1)
    on_cpu = accelerator.device.type == "cpu"
    with SimulatedGPU("256KiB") if on_cpu else contextlib.nullcontext() as gpu:
        if gpu is not None:
            gpu.adopt(model)
        for _ in range(steps):
            x, y = torch.randn(128, 16, generator=generator), torch.randn(128, generator=generator)
            result = train_step((x.to(accelerator.device), y.to(accelerator.device)))
            accelerator.print(f"step {result.step}: loss {result.loss:.4f}, {result.plan.describe(128)}")
    accelerator.print(train_step.guard.summary())
    return result.loss


if __name__ == "__main__":
    main()
