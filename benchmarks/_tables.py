"""Markdown for ``benchmarks/RESULTS.md`` from the results dictionary that ``run.py`` also writes as JSON."""

from __future__ import annotations

from typing import Any

import ladder
import quantization

from oomguard.testing import format_bytes

__all__ = ["RESULT_COLUMNS", "markdown", "results_table"]

LABELS = {
    "reference": "unconstrained reference",
    "accelerate": "Accelerate `find_executable_batch_size`",
    "composer": "Composer auto micro-batching (re-creation)",
    "oomguard": "oomguard, default ladder",
    "oomguard_preplan": "oomguard, `preplan=True`",
}
RESULT_COLUMNS = [
    "scenario",
    "contender",
    "finished",
    "OOMs before 1st step",
    "OOMs in all",
    "time lost to failed attempts",
    "effective batch",
    "settled on",
    "step time (per sample)",
    "held-out loss (vs reference)",
]
_PEERS = ("accelerate", "composer")

_PREAMBLE = """\
Every contender trains the same small Llama (random init, byte tokens) on the same batches of the Python
standard library's source, with AdamW (lr 1e-3), on a `SimulatedGPU` (real `torch.OutOfMemoryError`s on the CPU)
whose budget is calibrated for each scenario from peaks the dry-run planner measures (see the scenario table).

- **Accelerate**: `accelerate.utils.find_executable_batch_size` as its documentation shows it: the whole
  training loop (model, optimizer and DataLoader built inside, `accelerator.free_memory()` first) is decorated;
  on an OOM it shrinks the batch size (the installed release multiplies it by 0.9) and restarts the loop from
  the first batch, fresh weights, over the same samples: it takes more, smaller steps and the effective batch
  is not kept.
- **Composer**: Composer cannot be installed beside torch 2.13 (its latest release, mosaicml 0.32.1, requires
  torch >= 2.6, < 2.7.1), so this is a **re-creation** of its documented automatic micro-batching
  rule (`benchmarks/_composer_rule.py`): start at the whole device batch; on an OOM anywhere in the step, halve
  the micro-batch size and retry the same batch with gradient accumulation (global batch kept); never grow back;
  fail when micro-batch size 1 runs out of memory. Like Composer it does not repair optimizer state that an OOM
  inside `optimizer.step()` left half-built.
- **oomguard**: `oom_guard(model=..., optimizer=...)` with its default ladder (micro_batch, amp,
  checkpointing, activation_offload, optimizer_offload, layer_offload) and options (the jump on a first OOM;
  tuning after 4 clean steps on a fallback plan), and the same with `preplan=True`.
- **reference**: a hand-written step with no budget (a 1 TiB SimulatedGPU, so its step time carries the same
  simulator overhead).

Columns: *OOMs before 1st step* counts the OOM errors before the first optimizer step succeeded; *time lost*
is the time from the start of each failed attempt to the moment its retry could start (the attempt and the
cleanup after it; for Accelerate every restarted loop, its successful steps included, as their work is thrown
away), with its share of the run's wall time; for `preplan=True` the dry run's own time follows (it is spent
once, in the first call); *settled on* is the plan of the last step (and of the long batch where it differs);
*step time* is the median over the steps after the first (per sample in brackets: Accelerate's steps are
smaller); *held-out loss* is the final weights' loss on 16 held-out sequences, and in brackets its difference
from the reference run's. Accelerate sees the same samples in more, smaller steps, so its loss differs for that
reason alone (more updates at the same learning rate); the others should match the reference to float
rounding (bf16 where `amp` engaged). The JSON also has each run's relative weight distance from the reference.

Timings are indicative only: the machine is shared with other engineers' test runs, step times include the
simulator's per-operation cost (which inflates anything that runs more small operations, such as the guard's
per-micro-batch bookkeeping, against a GPU), and one intra-op thread is used so that a busy second core cannot
stall every operation. Accelerate and oomguard each run a full `gc.collect()` after every OOM (~0.2 s in this
process); the Composer rule does not.
"""


def _finished(run: dict[str, Any]) -> str:
    return "yes" if run["finished"] else f"no: {run['failure']}"


def _lost(run: dict[str, Any]) -> str:
    share = 100 * run["wasted_s"] / run["wall_s"] if run["wall_s"] else 0.0
    text = f"{run['wasted_s']:.2f} s ({share:.0f} %)"
    if run["planning_s"] is not None:
        text += f"; dry run {run['planning_s']:.2f} s"
    return text


def _batch(run: dict[str, Any], batch_size: int) -> str:
    final = run["final_batch_size"]
    if final == batch_size:
        return f"kept ({batch_size})"
    return f"no: {batch_size} → {final}" if final else f"no: {batch_size} → gave up"


def _step_time(run: dict[str, Any]) -> str:
    if run["step_s"] is None:
        return "n/a (no step)"
    return f"{run['step_s'] * 1e3:.0f} ms ({run['step_s'] / run['final_batch_size'] * 1e3:.1f} ms)"


def _loss(run: dict[str, Any]) -> str:
    if run["eval_loss"] is None:
        return "n/a (did not finish)"
    if run["contender"] == "reference":
        return f"{run['eval_loss']:.4f}"
    return f"{run['eval_loss']:.4f} ({run['eval_loss_delta']:+.4f})"


def _first(run: dict[str, Any]) -> str:
    return "n/a (no step)" if run["ooms_before_first_step"] is None else str(run["ooms_before_first_step"])


def results_table(results: dict[str, Any]) -> str:
    """One row per scenario and contender (the reference first), every cell filled."""
    lines = ["| " + " | ".join(RESULT_COLUMNS) + " |", "|" + "---|" * len(RESULT_COLUMNS)]
    for entry in results["scenarios"]:
        scenario = entry["scenario"]
        size = scenario["batch_size"]
        for run in entry["runs"]:
            cells = [
                scenario["title"], LABELS[run["contender"]], _finished(run), _first(run), str(run["ooms_total"]),
                _lost(run), _batch(run, size), run["settled"], _step_time(run), _loss(run),
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _scenario_table(results: dict[str, Any]) -> str:
    lines = ["| scenario | setup | parameters | budget | how the budget was set |", "|---|---|---|---|---|"]
    for entry in results["scenarios"]:
        s = entry["scenario"]
        lines.append(
            f"| {s['title']} | {s['setup']} | {s['parameters'] / 1e6:.2f} M | {format_bytes(s['capacity_bytes'])} | "
            f"{s['rule']} |"
        )
    return "\n".join(lines)


def _peer_wins(results: dict[str, Any]) -> list[str]:
    """Every figure on which a peer did better than oomguard's default ladder, scenario by scenario."""
    wins = []
    for entry in results["scenarios"]:
        runs = {run["contender"]: run for run in entry["runs"]}
        ours, title = runs["oomguard"], entry["scenario"]["title"]
        for peer in _PEERS:
            theirs = runs[peer]
            if not theirs["finished"]:
                continue
            wins += [f"{title}: {LABELS[peer]} {text}" for text in _compare(theirs, ours)]
    return wins


def _compare(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    found = []
    if (theirs["ooms_before_first_step"] or 0) < (ours["ooms_before_first_step"] or 0):
        found.append(f"needed fewer OOMs before its first step ({theirs['ooms_before_first_step']} vs "
                     f"{ours['ooms_before_first_step']})")  # fmt: skip
    if theirs["ooms_total"] < ours["ooms_total"]:
        found.append(f"met fewer OOMs in all ({theirs['ooms_total']} vs {ours['ooms_total']})")
    if theirs["wasted_s"] < ours["wasted_s"]:
        found.append(f"lost less time to failed attempts ({theirs['wasted_s']:.2f} s vs {ours['wasted_s']:.2f} s)")
    if theirs["step_s"] and ours["step_s"]:
        their_step = theirs["step_s"] / theirs["final_batch_size"]
        our_step = ours["step_s"] / ours["final_batch_size"]
        if their_step < our_step:
            found.append(f"ran faster per sample on its settled plan ({their_step * 1e3:.1f} ms vs "
                         f"{our_step * 1e3:.1f} ms)")  # fmt: skip
    if ours["eval_loss"] is not None and theirs["eval_loss"] < ours["eval_loss"]:
        found.append(f"ended with a lower held-out loss ({theirs['eval_loss']:.4f} vs {ours['eval_loss']:.4f})")
    return found


def _overhead(results: dict[str, Any]) -> str:
    o = results["overhead"]
    return "\n".join(
        [
            "| model | batch | rounds x steps | hand-written step | guarded step | median ratio (target <= 1.02) |",
            "|---|---|---|---|---|---|",
            f"| {o['model']} | {o['batch']} | {o['rounds']} x {o['steps_per_round']} | "
            f"{o['median_hand_step_s'] * 1e3:.1f} ms | {o['median_guarded_step_s'] * 1e3:.1f} ms | "
            f"**{o['median_ratio']:.3f}** |",
            "",
            f"Plain CPU training, no memory pressure; identical final weights: {o['identical_weights']}.",
        ]
    )


def _largest(results: dict[str, Any]) -> str:
    lines = [
        "| contender | largest model that trains in 6 GiB | parameters | plan | predicted tensor peak | planned |",
        "|---|---|---|---|---|---|",
    ]
    for contender, found in results["largest"].items():
        planned = ", ".join(
            f"{p['model']}: {'fits' if p['fits'] else 'no'} ({p['seconds']:.0f} s)" for p in found["planned"]
        )
        best = found["largest"]
        if best is None:
            lines.append(f"| {LABELS[contender]} | none of the family | n/a | n/a | n/a | {planned} |")
            continue
        lines.append(
            f"| {LABELS[contender]} | {best['model']} | {best['parameters'] / 1e6:.0f} M | {best['plan']} | "
            f"{format_bytes(best['predicted_peak_bytes'])} | {planned} |"
        )
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    """The whole RESULTS.md."""
    meta = results["meta"]
    wins = _peer_wins(results) or ["none in this run"]
    parts = [
        "# oomguard against the peers users would pick instead",
        "",
        f"Generated by `python benchmarks/run.py{' --quick' if meta['quick'] else ''}` on {meta['date']}; "
        f"machine: {meta['machine']}, {meta['cores']} cores ({meta['threads']} intra-op thread(s) used), "
        f"torch {meta['torch']}, transformers {meta['transformers']}, accelerate {meta['accelerate']}, Python "
        f"{meta['python']}. The whole run took {meta['seconds']:.0f} s.",
        "",
        _PREAMBLE,
        "## Scenarios",
        "",
        _scenario_table(results),
        "",
        "## Results",
        "",
        results_table(results),
        "",
        "### Where a peer did better than oomguard's default ladder in this run",
        "",
        *[f"- {win}" for win in wins],
        "",
        "## Happy-path overhead (`benchmarks/overhead.py`)",
        "",
        _overhead(results),
        "",
        "## The plan the guard runs on against the fastest plan that fits (`benchmarks/ladder.py`)",
        "",
        ladder.render(results["ladder"]) if results.get("ladder") else "Not run with `--quick`.",
        "",
        "## The quantization rungs against the exact rungs they compete with (`benchmarks/quantization.py`)",
        "",
        quantization.render(results["quantization"]) if results.get("quantization") else "Not run with `--quick`.",
        "",
        "## Largest Llama-style model that trains under a 6 GiB budget",
        "",
        'From the dry-run planner (`oomguard.plan`, fake tensors, `target="cuda"` with its device overhead), '
        "batches of 8 x 1024 tokens, AdamW: oomguard with its whole ladder (`preplan=True` plans the same way); "
        'Composer\'s rule with micro-batching only (`ladder=["micro_batch"]`); Accelerate with nothing but a '
        "smaller batch, at its floor of one sequence (`ladder=[]`, `batch_size=1`). Each contender's largest "
        "model is found by bisection over the family; *planned* lists the planner's answers that took.",
        "",
        _largest(results),
        "",
        "## On a real GPU",
        "",
        "`benchmarks/gpu_6gib.py` trains a TinyLlama-1.1B-architecture model on a CUDA GPU capped at 6 GiB "
        "(`torch.cuda.set_per_process_memory_fraction`) from batches of 8 x 1024 tokens, and compares the guard "
        "with the planner's hand-picked plan (tokens/s, measured against predicted peak). It has not been run for "
        "these results: no GPU was available. On a CUDA machine: "
        "`python benchmarks/gpu_6gib.py --json benchmarks/out/gpu_6gib.json` (under 8 minutes on an H200).",
        "",
    ]
    return "\n".join(parts)
