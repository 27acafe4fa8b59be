"""The ``oomguard`` command (also ``python -m oomguard``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from oomguard._cli.errors import bad_input

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from oomguard import __version__

    parser = argparse.ArgumentParser(
        prog="oomguard", description="Keep PyTorch training alive when the GPU runs out of memory."
    )
    parser.add_argument("--version", action="version", version=f"oomguard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small Llama under a memory budget its batch does not fit, and recover",
        description="Train a small Llama (random init) on the standard library's source under a memory budget "
        "its starting batch does not fit; the guard recovers and reports which fallbacks it needed.",
    )
    from oomguard._cli import demo as _demo

    _demo.add_arguments(demo)
    demo.set_defaults(run=_demo.run)
    report = commands.add_parser(
        "report",
        help="summarise an event log: a table per rung, and optionally a plot of memory over steps",
        description="Summarise an oomguard event log (JSON lines): per rung, times engaged, steps on it and time "
        "lost to OOMs; --plot draws memory over steps with rung changes marked (needs matplotlib).",
    )
    report.add_argument("log", help="the event log written with log_file=")
    report.add_argument("--plot", metavar="FILE.png", help="also draw memory over steps to this PNG")
    report.set_defaults(run=_run_report)
    _add_plan(commands)
    return parser


def _add_plan(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``oomguard plan`` and its options."""
    plan = commands.add_parser(
        "plan",
        help="will this model train on a GPU of this size, and with which fallbacks? (a dry run, no GPU needed)",
        description="Run one training step of a causal LM on fake tensors (no weights, no GPU, no memory) for "
        "each plan along the ladder, and recommend the fastest plan predicted to fit the GPU.",
    )
    plan.add_argument("--model", required=True, help="a preset (" + ", ".join(_presets()) + ") or a config.json")
    plan.add_argument(
        "--gpu-memory",
        default="6GiB",
        help="the GPU's total memory, with its unit: 6GiB (6 x 2**30 bytes, a '6 GB' card) or 6GB (6 x 10**9 bytes) "
        "(default: 6GiB)",
    )
    plan.add_argument(
        "--host-memory",
        default=None,
        help="the host memory (RAM) the guard may fill with what it offloads, e.g. 16GiB (default: this machine's "
        "RAM less 10%% or 1 GiB, whichever is larger)",
    )
    plan.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step (default: 8)")
    plan.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default: 1024)")
    plan.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="default: adamw")
    plan.add_argument("--max-grad-norm", type=float, default=None, help="plan with gradient clipping")
    plan.add_argument(
        "--target",
        choices=("cuda", "simulated"),
        default="cuda",
        help="cuda adds the device overhead (context, workspaces, allocator) to each peak; simulated plans for "
        "oomguard.testing.SimulatedGPU (default: cuda)",
    )
    plan.add_argument("--no-bf16", dest="bf16", action="store_false", help="the GPU has no bf16 (before Ampere)")
    plan.add_argument("--gpu-tflops", type=float, default=None, help="half-precision TFLOP/s (default 13)")
    plan.add_argument("--link-gbps", type=float, default=None, help="host<->device GB/s (default 12)")
    plan.add_argument(
        "--ladder",
        default=None,
        help="the guard's rungs, comma-separated, in order (default: the default ladder; add the opt-in "
        "quantized_optimizer or quantized_weights to plan with them)",
    )
    _add_lora(plan)
    plan.add_argument(
        "--exact",
        action="store_true",
        help="measure every candidate with a full fake step (slower; by default a deep model's candidates are "
        "composed from steps of 1- to 4-block copies of it, and the recommendation measured in full where it comes "
        "within 3%% of the GPU or the host memory)",
    )
    plan.add_argument(
        "--json", action="store_true", help="print the answer as strict JSON (a non-finite number is null)"
    )
    plan.add_argument("--table", action="store_true", help="after the answer, the table of every plan measured")
    plan.set_defaults(run=_run_plan)


def _add_lora(plan: argparse.ArgumentParser) -> None:
    """``oomguard plan``'s options of a LoRA fine-tune."""
    plan.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="plan a LoRA fine-tune: the model frozen, rank-R adapters trained (what quantized_weights relieves)",
    )
    plan.add_argument(
        "--lora-targets",
        default=None,
        help="with --lora-rank, the layers LoRA adapts: all-linear (every linear layer but the output head; "
        "default) or names, comma-separated, e.g. q_proj,v_proj",
    )
    plan.add_argument(
        "--base-dtype",
        choices=("fp32", "bf16", "fp16", "nf4"),
        default=None,
        help="with --lora-rank, how the frozen base is loaded: fp32, bf16 or fp16 weights, or nf4 (its linear layers "
        "in 4 bits as bitsandbytes stores them; no bitsandbytes needed to plan) (default: the config's torch_dtype, "
        "else fp32; the answer's model line says which)",
    )


def _presets() -> list[str]:
    from oomguard._planner.presets import PRESETS

    return list(PRESETS)


def _run_plan(args: argparse.Namespace) -> int:
    import json

    from oomguard._cli import planning
    from oomguard._events import strict_json
    from oomguard._planner.api import plan
    from oomguard._planner.lora import ALL_LINEAR
    from oomguard._planner.report import size_in_gib
    from oomguard._planner.speed import DeviceSpeed

    given = {"gpu_tflops": args.gpu_tflops, "link_gbps": args.link_gbps}
    ladder = None if args.ladder is None else _names(args.ladder)
    if args.lora_targets is not None and args.lora_rank is None:  # (planned as a full fine-tune, it would be ignored)
        bad_input("plan", "--lora-targets names the layers a LoRA fine-tune adapts: give --lora-rank R too")
    if args.base_dtype is not None and args.lora_rank is None:  # (a full fine-tune trains fp32 weights)
        bad_input("plan", "--base-dtype says how a LoRA fine-tune's frozen base is loaded: give --lora-rank R too")
    targets = args.lora_targets or ALL_LINEAR
    targets = targets if targets == ALL_LINEAR else _names(targets)
    planning.check_shape(args.batch_size, args.seq_len)
    planning.check_model(args.model, _presets())
    gpu_memory, said = planning.memory_size("--gpu-memory", args.gpu_memory)
    host_memory, host = planning.host_memory(args.host_memory)
    what = f"{args.model}, {args.batch_size} x {args.seq_len} tokens, a {size_in_gib(gpu_memory)} GPU"
    try:
        speed = DeviceSpeed(**{name: value for name, value in given.items() if value is not None})
        with planning.progress(what):
            report = plan(
                args.model, gpu_memory=gpu_memory, batch_size=args.batch_size, seq_len=args.seq_len,
                optimizer=args.optimizer, target=args.target, bf16=args.bf16, max_grad_norm=args.max_grad_norm,
                speed=speed, ladder=ladder, lora_rank=args.lora_rank, lora_targets=targets, host_memory=host_memory,
                exact=args.exact, base_dtype=args.base_dtype,
            )  # fmt: skip
    except ValueError as error:  # bad input: a model, a config.json or an argument the planner cannot use
        bad_input("plan", error)
    except ImportError as error:  # an extra not installed: its message names the `pip install` that fixes it
        bad_input("plan", error)
    if args.json:  # strict JSON (what jq reads): a predicted time past the float range is null, named in non_finite
        print(json.dumps(strict_json(report.to_dict()), indent=2, allow_nan=False))
    else:
        print("\n".join(filter(None, (report.answer(host), said, "\n" + report.table() if args.table else None))))
    return 0 if report.fits else 1


def _names(text: str) -> list[str]:
    """A comma-separated list of names (rungs, layers), spaces and empty entries dropped."""
    return [name.strip() for name in text.split(",") if name.strip()]


def _run_report(args: argparse.Namespace) -> int:
    from oomguard._cli.report import plot, read_log, table, tallied

    try:
        log = read_log(args.log)
    except OSError as error:
        bad_input("report", f"cannot read {args.log}: {error.strerror or error}")
    if log.skipped and not log.events:  # (an empty log is a job that logged nothing yet: its table says so)
        bad_input("report", f"{args.log} is not an oomguard event log ({log.skipped_line()}): give a job's log_file=")
    print(table(tallied(log.events)))
    try:
        if args.plot:
            plot(log.events, args.plot, title=args.log)
            print(f"\nPlot written to {args.plot}.")
    finally:  # last, even when there is nothing to plot: skipped progress lines may be why
        skipped = log.skipped_line()
        if skipped:
            print(f"\n{skipped}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv`` and run the command; returns the exit status."""
    args = _parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
