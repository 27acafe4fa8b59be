"""Test doubles for training without a GPU, shipped with the library for users' tests and ours.

:class:`SimulatedGPU` runs real PyTorch training on the CPU under a device-memory budget, with real
``torch.OutOfMemoryError``\\ s, so OOM recovery can be tested anywhere::

    from oomguard.testing import SimulatedGPU

    with SimulatedGPU("64MiB") as gpu:
        gpu.adopt(model)                    # the weights are already "on the device"
        result = train_step(batch)          # OOMs happen, and are recovered from, for real
        print(gpu.max_memory_allocated())

Real training data and a model that need no download, for tests, examples and benchmarks::

    from oomguard.testing import DemoConfig, demo_model, stdlib_text, text_batches

    model = demo_model(DemoConfig(hidden_size=64, layers=2))        # a small Llama over byte tokens
    batches = text_batches(stdlib_text(), batch_size=8, seq_len=64)  # the standard library's source as text
"""

# (the data and the demo's model live with the CLI's demo, which may not import this package: only re-exported here)
from oomguard._backends.units import format_bytes, parse_bytes
from oomguard._cli.data import stdlib_text, text_batches
from oomguard._cli.demo import DemoConfig, demo_model
from oomguard.testing._simulated import SimulatedGPU

__all__ = ["DemoConfig", "SimulatedGPU", "demo_model", "format_bytes", "parse_bytes", "stdlib_text", "text_batches"]
