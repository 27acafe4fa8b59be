"""What the chunked loss saves and costs: one training step's peak memory and time, plain against chunked.

The issue's case by default: a Qwen2 config (vocabulary 32,000, hidden 64, 2 layers, tied embeddings), 4 ragged
samples of 256 tokens, AdamW, fp32. Each round runs one plain and one chunked step, in alternating order (so a
warming cache or a busy neighbour weighs on both alike), after one warm-up step each (AdamW's state exists: the
steady step). Memory is the step's peak under :class:`oomguard.testing.SimulatedGPU` on the CPU (every live
tensor counted; deterministic), or ``torch.cuda.max_memory_allocated`` on CUDA; time is the median wall-clock
step, measured without the simulator (its accounting would weigh on the time).

    python benchmarks/chunked_loss.py [--device cpu|cuda] [--vocab 32000] [--hidden 64] [--tokens 256]
                                      [--batch 4] [--amp] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from oomguard import OOMGuard, Plan
from oomguard.testing import SimulatedGPU


def model_and_batch(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The Qwen2 model (seeded random weights) and a right-padded batch whose samples have different lengths."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(device)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, args.vocab, (args.batch, args.tokens), generator=generator)
    lengths = [args.tokens - (i * args.tokens) // (2 * args.batch) for i in range(args.batch)]  # ragged
    mask = (torch.arange(args.tokens)[None, :] < torch.tensor(lengths)[:, None]).long()
    batch = {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return model, {key: value.to(device) for key, value in batch.items()}


def stepper(model: torch.nn.Module, batch: dict[str, torch.Tensor], amp: bool, chunked: bool) -> Callable[[], float]:
    """One training step (forward, backward, AdamW step) through a guard held on one plan (bf16 autocast where
    ``amp``, the chunked loss where ``chunked``: the same guard around both arms), returning its loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = OOMGuard(
        lambda b: model(**b), model=model, optimizer=optimizer, ladder=["chunked_loss"], predictive=False,
        tune_after=None, relax_after=None,
    )  # fmt: skip
    plan = Plan(precision="bf16" if amp else None)
    guard.plan = plan.with_level("chunked_loss", 1) if chunked else plan

    def run() -> float:
        return guard(batch).loss

    return run


def peak_bytes(run: Callable[[], float], model: torch.nn.Module, batch: dict[str, Any], device: torch.device) -> int:
    """The steady step's peak: after a warm-up step (AdamW's state made), the next step's highest allocation."""
    if device.type == "cuda":
        run()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    with SimulatedGPU("64GiB") as gpu:
        gpu.adopt(model, batch.values())
        run()
        gpu.reset_peak_memory_stats()
        run()
        return gpu.max_memory_allocated()


def seconds(run: Callable[[], float], device: torch.device) -> float:
    """One step's wall-clock seconds, synchronized on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Peaks and interleaved median step times of the plain and the chunked step."""
    device = torch.device(args.device)
    arms: dict[str, Callable[[], float]] = {}
    peaks: dict[str, int] = {}
    losses: dict[str, float] = {}
    for name in ("plain", "chunked"):
        model, batch = model_and_batch(args, device)
        run = stepper(model, batch, args.amp, chunked=name == "chunked")
        peaks[name] = peak_bytes(run, model, batch, device)  # (two steps: the timing below starts warm)
        model_again, _ = model_and_batch(args, device)  # a fresh copy for the first-step loss, same weights
        losses[name] = stepper(model_again, batch, args.amp, chunked=name == "chunked")()
        arms[name] = run
    times: dict[str, list[float]] = {name: [] for name in arms}
    for index in range(args.rounds):
        order = list(arms) if index % 2 == 0 else list(reversed(arms))  # interleaved, alternating
        for name in order:
            times[name].append(seconds(arms[name], device))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "case": {key: getattr(args, key) for key in ("device", "vocab", "hidden", "tokens", "batch", "amp", "rounds")},
        "peak_mib": {name: peaks[name] / 2**20 for name in peaks},
        "peak_ratio": peaks["chunked"] / peaks["plain"],
        "step_seconds_median": medians,
        "time_ratio": medians["chunked"] / medians["plain"],
        "first_step_loss": losses,
        "loss_relative_difference": abs(losses["chunked"] - losses["plain"]) / abs(losses["plain"]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args)
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
