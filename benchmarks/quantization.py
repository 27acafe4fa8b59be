"""What the quantization rungs cost and save against the exact rungs they compete with.

Two jobs on the ladder benchmark's model (a Llama, hidden 128 x 4 layers, batches of 8 x 256 tokens of the
standard library's source, AdamW, CPU, SimulatedGPU): a full fine-tune, where ``quantized_optimizer`` competes
with ``optimizer_offload``, and a PEFT LoRA fine-tune (rank 8 on every projection), where ``quantized_weights``
in 8 and 4 bits competes with ``layer_offload``. For each plan: the device memory held between steps and the
step's peak (each plan alone in its own simulator), the median step time (the plans interleaved round by round
in one), and the loss on a held-out batch after the rounds, against the plain step's. On this CPU host<->device
copies are memcpy: the offload rungs' times are far lower here than over a PCIe link.

    python benchmarks/quantization.py [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from ladder import CONFIG

from oomguard import OOMGuard, Plan
from oomguard.testing import SimulatedGPU, demo_model, format_bytes, stdlib_text, text_batches

Job = Callable[[], torch.nn.Module]
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def full_model() -> torch.nn.Module:
    return demo_model(CONFIG)


def lora_model() -> torch.nn.Module:
    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, lora_dropout=0.0, task_type="CAUSAL_LM")
    model: torch.nn.Module = peft.get_peft_model(demo_model(CONFIG), config)
    return model


JOBS: dict[str, tuple[Job, list[tuple[str, Plan]]]] = {
    "full fine-tune": (
        full_model,
        [
            ("plain step", Plan()),
            ("quantized_optimizer", Plan(quantized_optimizer=True)),
            ("optimizer_offload", Plan(optimizer_offload=True)),
        ],
    ),
    "LoRA (rank 8, every projection)": (
        lora_model,
        [
            ("plain step", Plan()),
            ("quantized_weights (8 bits)", Plan(quantized_weights=True)),
            ("quantized_weights (4 bits)", Plan(quantized_weights="4bit")),
            (f"layer_offload (all {CONFIG.layers} layers)", Plan(offload_layers=CONFIG.layers)),
        ],
    ),
}


def _guard(job: Job, plan: Plan) -> tuple[torch.nn.Module, OOMGuard]:
    model = job()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    guard = OOMGuard(lambda batch: model(**batch), model=model, optimizer=optimizer, ladder=[], tune_after=None)
    guard.plan = plan
    return model, guard


def _memory(job: Job, plan: Plan, batches: list[dict[str, torch.Tensor]]) -> tuple[int, int]:
    """Device bytes held between steps and the peak of a steady step, the plan alone on the device."""
    model, guard = _guard(job, plan)
    with SimulatedGPU("4GiB") as gpu:
        gpu.adopt(model)
        guard(batches[0])  # (Adam builds its state)
        gpu.reset_peak_memory_stats()
        guard(batches[1])
        return gpu.memory_allocated(), gpu.max_memory_allocated()


def measure(job: Job, plans: list[tuple[str, Plan]], rounds: int) -> list[dict[str, Any]]:
    batches = text_batches(stdlib_text(), CONFIG.batch_size, CONFIG.seq_len, seed=3)
    held_out = next(text_batches(stdlib_text(), CONFIG.batch_size, CONFIG.seq_len, seed=99))
    first = [next(batches), next(batches)]
    memory = [_memory(job, plan, first) for _, plan in plans]
    runs = [_guard(job, plan) for _, plan in plans]
    times: list[list[float]] = [[] for _ in runs]
    losses = []
    with SimulatedGPU("4GiB") as gpu:
        for model, _ in runs:
            gpu.adopt(model)
        for round_index in range(rounds + 1):  # round 0 warms up (Adam's state, the plans' first steps)
            batch = next(batches)
            order = list(enumerate(runs)) if round_index % 2 == 0 else list(enumerate(runs))[::-1]
            for index, (_, guard) in order:
                started = time.perf_counter()
                guard(batch)
                if round_index:
                    times[index].append(time.perf_counter() - started)
        with torch.no_grad():
            losses = [float(model(**held_out).loss) for model, _ in runs]
        for _, guard in runs:
            guard.close()
    return [
        {
            "name": name,
            "plan": plan.to_dict(),
            "resident_bytes": resident,
            "peak_bytes": peak,
            "step_s": statistics.median(times[index]),
            "loss": losses[index],
        }
        for index, ((name, plan), (resident, peak)) in enumerate(zip(plans, memory, strict=True))
    ]


def run(rounds: int) -> dict[str, Any]:
    """Every measurement of this benchmark, as JSON-ready data."""
    meta = {
        "model": f"Llama hidden {CONFIG.hidden_size} x {CONFIG.layers} layers, AdamW lr 1e-3",
        "batch": f"{CONFIG.batch_size} x {CONFIG.seq_len} tokens",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "rounds": rounds,
    }
    return {"meta": meta, "jobs": {name: measure(job, plans, rounds) for name, (job, plans) in JOBS.items()}}


def render(data: dict[str, Any]) -> str:
    """The measurements as Markdown, a table per job, each plan against the plain step."""
    meta = data["meta"]
    lines = [
        f"{meta['model']}, batches of {meta['batch']}, {meta['machine']}, {meta['date']}; step times are medians of "
        f"{meta['rounds']} interleaved rounds, the loss is on a held-out batch after them.",
    ]
    for job, rows in data["jobs"].items():
        plain = rows[0]
        lines += [
            "",
            f"**{job}**",
            "",
            "| plan | held between steps | peak | step time | vs plain | held-out loss | vs plain |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            lines.append(
                f"| {row['name']} | {format_bytes(row['resident_bytes'])} | {format_bytes(row['peak_bytes'])} | "
                f"{row['step_s'] * 1e3:.0f} ms | {row['step_s'] / plain['step_s']:.2f}x | {row['loss']:.4f} | "
                f"{row['loss'] - plain['loss']:+.4f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", help="also write the measurements to this file")
    args = parser.parse_args(argv)
    data = run(args.rounds)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=2)
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
