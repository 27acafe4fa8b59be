"""``oomguard demo``: train a small Llama on real text under a memory budget its starting batch does not fit.

On the CPU the budget is a :class:`~oomguard.testing.SimulatedGPU`; with ``--device cuda`` the real GPU is capped
with ``torch.cuda.set_per_process_memory_fraction``. Either way the guard meets real out-of-memory errors and
recovers from them; the event log and the closing summary say which fallbacks were needed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from oomguard._backends.accounting import AccountedDevice
from oomguard._backends.memory import current_backend
from oomguard._backends.units import format_bytes, parse_bytes
from oomguard._cli.data import VOCAB_SIZE, stdlib_text, text_batches
from oomguard._cli.errors import bad_input
from oomguard._decorator import oom_guard
from oomguard._extras import require
from oomguard._guard.results import StepResult

__all__ = ["DemoConfig", "add_arguments", "demo_model", "run"]


@dataclass(frozen=True)
class DemoConfig:
    """The demo's model and job sizes (:func:`demo_model` reads ``hidden_size``, ``layers``, ``heads``, ``seq_len``
    and ``seed``; the rest size the job). The CPU defaults take about 20 s on two cores: the batch fits the
    6 MiB budget only in micro-batches (of 8, with the chunked loss, activation checkpointing and offload), and the
    rare long batch in micro-batches of 3."""

    steps: int = 24
    batch_size: int = 16
    seq_len: int = 64
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    gpu_memory: str = "6MiB"
    lr: float = 1e-3
    seed: int = 0


LONG_FACTOR = 2  # the rare long batches are this many times longer
_FULL = {"steps": 40, "seq_len": 256, "hidden_size": 128, "layers": 4, "gpu_memory": "64MiB"}  # --full, on the CPU
_CUDA_DEFAULTS = {
    "batch_size": 64,
    "seq_len": 1024,
    "hidden_size": 1024,
    "layers": 8,
    "heads": 16,
    "gpu_memory": "6GiB",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line flags."""
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps to run (default 24)")
    parser.add_argument("--full", action="store_true", help="the full-size CPU job: 0.84M parameters, 10-16 min")
    parser.add_argument("--log-file", default="oomguard-demo.jsonl", help="event log, JSON lines (rewritten)")
    parser.add_argument("--state-file", default="oomguard-demo-plans.json", help="learned plans (rewritten)")
    parser.add_argument("--long-every", type=int, default=8, help=f"every Nth batch is {LONG_FACTOR}x longer (0: none)")
    parser.add_argument("--restart-steps", type=int, default=8, help="steps of the restarted job (0: no restart)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu simulates the GPU")
    parser.add_argument("--gpu-memory", default=None, help="the memory budget, e.g. 64MiB (cpu) or 6GiB (cuda)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per optimizer step")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens (bytes) per sample")
    parser.add_argument("--hidden-size", type=int, default=None, help="the model's width")
    parser.add_argument("--layers", type=int, default=None, help="the model's depth")
    parser.add_argument("--seed", type=int, default=0, help="random seed for weights and data")
    parser.add_argument("--plot", default="oomguard-demo-memory.png", help="the memory plot it draws (PNG)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _config(args: argparse.Namespace) -> DemoConfig:
    values: dict[str, Any] = dict(_CUDA_DEFAULTS) if args.device == "cuda" else dict(_FULL) if args.full else {}
    for name in ("steps", "batch_size", "seq_len", "hidden_size", "layers", "gpu_memory", "seed"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    config = DemoConfig(**values)
    if config.steps < 1 or config.batch_size < 1 or config.seq_len < 2:
        bad_input("demo", "--steps and --batch-size must be at least 1, --seq-len at least 2")
    try:
        parse_bytes(config.gpu_memory)
    except ValueError as error:
        bad_input("demo", f"--gpu-memory: {error}")
    return config


def demo_model(config: DemoConfig) -> torch.nn.Module:
    """The demo's model: a Llama-architecture causal LM of ``config``'s size, with random weights seeded by
    ``config.seed`` (nothing is downloaded), over byte tokens (a vocabulary of 256, as :func:`stdlib_text` gives).

    >>> model = demo_model(DemoConfig(hidden_size=32, layers=1))
    >>> type(model).__name__, model.config.vocab_size, sum(p.numel() for p in model.parameters())
    ('LlamaForCausalLM', 256, 28256)
    """
    require("transformers", extra="hf", purpose="the demo's Llama model")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(config.seed)
    llama = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=config.hidden_size,
        intermediate_size=config.hidden_size * 8 // 3 // 8 * 8,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.heads,
        max_position_embeddings=LONG_FACTOR * config.seq_len,
        tie_word_embeddings=False,
    )
    model: torch.nn.Module = LlamaForCausalLM(llama)
    return model


class _Progress:
    """A one-line progress bar on a terminal; a line every tenth of the run elsewhere."""

    def __init__(self, total: int, stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.tty = stream.isatty()
        self.started = time.perf_counter()

    def update(self, result: StepResult, memory: str) -> None:
        if not self.enabled:
            return
        done = result.step + 1
        width = 20
        filled = width * done // self.total
        rungs = ",".join(result.rungs) or "-"
        line = (
            f"step {done:>4}/{self.total} [{'#' * filled}{'.' * (width - filled)}] loss {result.loss:6.3f} | "
            f"micro-batch {result.micro_batch_size} x{result.micro_batches} | rungs {rungs} | mem {memory} | "
            f"{time.perf_counter() - self.started:5.1f}s"
        )
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if done == self.total:
                self.stream.write("\n")
        elif done == 1 or done == self.total or done % max(1, self.total // 10) == 0:
            self.stream.write(line + "\n")
        self.stream.flush()


class _LineHandler(logging.Handler):
    """Writes the guard's event lines above the progress bar."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(logging.INFO)
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        prefix = "\r\033[K" if self.stream.isatty() else ""
        self.stream.write(f"{prefix}[oomguard] {record.getMessage()}\n")
        self.stream.flush()


@contextlib.contextmanager
def _device_budget(config: DemoConfig, device: str) -> Iterator[AccountedDevice | None]:
    if device == "cpu":
        with AccountedDevice(config.gpu_memory) as gpu:
            yield gpu
        return
    if not torch.cuda.is_available():
        raise SystemExit("oomguard demo: --device cuda needs a CUDA GPU; use --device cpu to simulate one")
    cap = parse_bytes(config.gpu_memory)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    try:
        yield None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run the demo job; returns the exit status."""
    config = _config(args)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    handler = _LineHandler(err)
    guard_logger = logging.getLogger("oomguard")
    guard_logger.addHandler(handler)
    guard_logger.setLevel(logging.INFO)
    try:
        return _train(config, device, args, out, err)
    finally:
        guard_logger.removeHandler(handler)


def _stream(config: DemoConfig, long_every: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of ``seq_len`` tokens, with a rare batch of longer sequences every ``long_every`` steps.

    The text is read here, before the memory budget starts: it is host memory, not the device's.
    """
    text = stdlib_text()
    short = text_batches(text, config.batch_size, config.seq_len, seed=config.seed)
    long = text_batches(text, config.batch_size, LONG_FACTOR * config.seq_len, seed=config.seed + 1)
    return (next(long) if long_every and step % long_every == 0 else next(short) for step in itertools.count(1))


def _job(
    config: DemoConfig, device: torch.device, args: argparse.Namespace, steps: int, err: TextIO
) -> tuple[Any, list[StepResult]]:
    """Build the model (same seed every time), train ``steps`` steps under the budget; the guard and results."""
    model = demo_model(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))

    # Forward only: the guard owns backward, accumulation, clipping, the step and zero_grad. The state file
    # remembers each batch bucket's plan; log_every=1 logs every step's peak for `oomguard report --plot`.
    @oom_guard(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        log_file=args.log_file,
        state_file=args.state_file,
        max_grad_norm=1.0,
        log_every=1,
    )
    def train_step(batch: dict[str, torch.Tensor]) -> Any:
        return model(**{name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()})

    batches = _stream(config, args.long_every)
    progress = _Progress(steps, err, enabled=not args.quiet)
    results = []
    with _device_budget(config, device.type) as gpu:
        if gpu is not None:
            gpu.adopt(model)  # the weights are already on the (simulated) device, as after model.to("cuda")
        backend = current_backend(device)
        for _ in range(steps):
            results.append(train_step(next(batches)))
            peak = f"{format_bytes(backend.max_memory_allocated())} of {format_bytes(backend.total_memory())}"
            progress.update(results[-1], peak)
    return train_step.guard, results


def _train(config: DemoConfig, device: torch.device, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    started = time.perf_counter()
    for stale in (args.log_file, args.state_file):  # each demo starts from scratch
        Path(stale).unlink(missing_ok=True)
    n_params = sum(p.numel() for p in demo_model(config).parameters())
    out.write(
        f"oomguard demo: Llama with {n_params / 1e6:.2f}M parameters, batches of {config.batch_size} x "
        f"{config.seq_len} tokens of the standard library's source (every {args.long_every}th batch "
        f"{LONG_FACTOR}x longer), {config.steps} steps, on "
        f"{'a simulated GPU' if device.type == 'cpu' else 'CUDA'} capped at {config.gpu_memory}.\n"
        f"Events go to {args.log_file}, learned plans to {args.state_file}.\n\n"
    )
    out.flush()
    guard, results = _job(config, device, args, config.steps, err)
    summary = guard.summary()
    out.write(f"\nLoss {results[0].loss:.3f} -> {results[-1].loss:.3f} over {config.steps} steps.\n{summary}\n")
    if summary.fallbacks:
        amp = " (in bf16 mixed precision where amp engaged)" if "amp" in summary.fallbacks else ""
        out.write(
            f"The batches never changed: every step trained on all {config.batch_size} samples, split into "
            f"micro-batches with exact gradient accumulation{amp}. Plans per batch bucket: {_plans(guard, config)}.\n"
        )
    if args.restart_steps:
        out.write(f"\nRestarting from {args.state_file}, as a job would after a crash or a preemption...\n")
        out.flush()
        _, again = _job(config, device, args, args.restart_steps, err)
        ooms = sum(r.ooms for r in again)
        out.write(
            f"Restart: {len(again)} steps (long batches included) with {ooms} out-of-memory error(s): every bucket "
            f"started on the plan it had learned.\n"
        )
    _report(args, out)
    out.write(f"\nDemo finished in {time.perf_counter() - started:.1f} s.\n")
    return 0


def _report(args: argparse.Namespace, out: TextIO) -> None:
    """What ``oomguard report LOG --plot PNG`` prints, for the log just written."""
    from oomguard._cli.report import plot, read_log, table, tallied

    events = read_log(args.log_file).events
    out.write(f"\n$ oomguard report {args.log_file} --plot {args.plot}\n{table(tallied(events))}\n")
    try:
        plot(events, args.plot, title="oomguard demo")
    except SystemExit as missing:  # (no matplotlib: the table stands alone)
        out.write(f"\n{missing}\n")
    else:
        out.write(f"\nMemory plot written to {Path(args.plot).resolve()}.\n")


def _plans(guard: Any, config: DemoConfig) -> str:
    """The learned plan of each bucket, named by sequence length."""
    names = []
    for bucket, plan in sorted(guard.plans.items()):
        seq = bucket // config.batch_size
        names.append(f"{seq}-token batches: {plan.describe(config.batch_size)}")
    return "; ".join(names)
