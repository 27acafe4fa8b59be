"""TRL's SFTTrainer under the guard, composed the way a user writes it: its metrics count each batch once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.trl_example import EXAMPLE, assert_same_metrics, logged, trl_sft

from oomguard.testing import SimulatedGPU

pytestmark = pytest.mark.integration  # TRL's trainers end to end

ROOMY = "256MiB"  # the whole batch fits (TRL's chunked log-prob buffer included): only injected faults strike


def test_the_example_trains_recovers_and_counts_tokens_once(tmp_path: Path) -> None:
    reference = trl_sft.build(3, str(tmp_path / "reference"))
    reference.train()
    trainer = trl_sft.main(steps=3, output_dir=str(tmp_path / "guarded"))
    assert trainer.state.global_step == 3
    summary = trainer.oomguard.summary()
    assert summary.ooms >= 1 and "micro_batch" in summary.fallbacks
    got, expected = logged(trainer), logged(reference)
    assert [e["num_tokens"] for e in got] == [e["num_tokens"] for e in expected]
    assert [e["loss"] for e in got] == pytest.approx([e["loss"] for e in expected], rel=1e-5)  # token-weighted
    assert (tmp_path / "guarded" / "oomguard.jsonl").exists()


def _faulty(phase: str, gpu_box: list[Any], base: type | None = None) -> type:
    """``base`` (GuardedSFT by default) with one injected OOM in ``phase`` of the second step."""

    class Faulty(base or trl_sft.GuardedSFT):  # type: ignore[misc,name-defined]
        armed = False

        def arm(self, *_: Any) -> None:
            if self.state.global_step == 1 and not self.armed:
                self.armed = True
                gpu_box[0].fail_allocation(1)

        def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
            if phase == "clip":
                self.arm()
            return super()._clip_grad_norm(model)

        def create_optimizer(self) -> Any:
            optimizer = super().create_optimizer()
            if phase == "optimizer":
                optimizer.register_step_pre_hook(self.arm)
            return optimizer

    return Faulty


@pytest.mark.parametrize("phase", ["forward", "backward", "clip", "optimizer"])
def test_sft_metrics_after_an_oom_equal_the_oom_free_runs(tmp_path: Path, phase: str) -> None:
    """The retried attempt runs SFTTrainer's compute_loss again; what the failed one added to ``_metrics`` and
    the token count is taken back. (The rungs here keep the maths: checkpointing recomputes the same forward, and
    layer offload moves weights, so the figures must match an OOM-free run's.)"""
    reference = trl_sft.build(3, str(tmp_path / "reference"))
    reference.train()
    gpu_box: list[Any] = []
    options = {"ladder": ["checkpointing", "layer_offload"], "step_journal": "always"}
    trainer_class = _faulty(phase, gpu_box)
    trainer = trl_sft.build(3, str(tmp_path / phase), options, trainer_class=trainer_class)
    model = trainer.model
    if phase == "forward":
        model.register_forward_pre_hook(trainer.arm)
    elif phase == "backward":  # (fires as this weight's gradient is computed, half-way through backward)
        model.model.layers[-1].mlp.down_proj.weight.register_hook(lambda grad: trainer.arm())
    with SimulatedGPU(ROOMY) as gpu:
        gpu_box.append(gpu)
        gpu.adopt(model)
        trainer.train()
    (oom,) = [e for e in trainer.oomguard.events if e.kind == "oom"]
    assert oom.error.phase == phase and oom.step == 1
    summary = trainer.oomguard.summary()
    assert (summary.steps, summary.recovered_steps) == (3, 1)
    assert_same_metrics(trainer, reference)


DPO_METRICS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
               "logps/rejected", "num_tokens")  # fmt: skip


@pytest.mark.parametrize("precompute", [False, True], ids=["reference model each step", "precomputed reference"])
def test_dpo_in_micro_batches_trains_as_on_the_whole_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precompute: bool
) -> None:
    """DPO's batch is every chosen sequence, then every rejected one, and its loss pairs row i with row n + i.
    Split along dim 0 as it was, micro-batches paired the wrong rows and trained on a wrong loss without any
    error (0.543 for 0.706 by the fourth step here); split pair by pair, the losses, rewards and weights are the
    unguarded DPOTrainer's on the whole batch. Precomputed reference log-probabilities (one row per pair) are
    split with their pairs."""
    from trl import DPOTrainer

    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    import trl_dpo

    extra: dict[str, Any] = {"precompute_ref_log_probs": True, "precompute_ref_batch_size": 1} if precompute else {}
    reference = trl_dpo.build(4, str(tmp_path / "reference"), trainer_class=DPOTrainer, **extra)
    reference.train()
    trainer = trl_dpo.build(4, str(tmp_path / "guarded"), {"ladder": ["micro_batch"]}, **extra)
    assert trainer.oomguard_pairs, "TRL's preference collator is recognised"
    assert_dpo_split_pair_by_pair(trainer, reference)


def assert_dpo_split_pair_by_pair(trainer: Any, reference: Any) -> None:
    """``trainer`` trained in micro-batches under a simulated GPU where 8 pairs do not fit: its losses, rewards and
    weights are ``reference``'s (the unguarded DPOTrainer, already trained on the whole batch)."""
    with SimulatedGPU("60MiB") as gpu:  # 8 pairs do not fit, 4 do
        gpu.adopt(trainer.model)
        gpu.adopt(trainer.ref_model)
        trainer.train()
    assert trainer.oomguard.plan.micro_batch_size in (1, 2, 4) and trainer.oomguard.summary().ooms >= 1
    for step, (got, expected) in enumerate(zip(trainer.state.log_history, reference.state.log_history, strict=True)):
        keys = [key for key in DPO_METRICS if key in expected]
        assert {k: got[k] for k in keys} == pytest.approx({k: expected[k] for k in keys}, rel=1e-4, abs=1e-5), step
    for p, q in zip(trainer.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_dpo_with_a_subclass_of_trls_collator_is_split_pair_by_pair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collator of the user's own that extends TRL's preference collator lays pairs out as TRL's does. The guard
    recognised TRL's collator by its class name, not by inheritance: a subclass's batches were split along dim 0
    and paired the wrong rows, silently (step 2's loss 0.7399 for 0.7449, weights 4e-3 off)."""
    from trl import DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    import trl_dpo

    class CountingCollator(DataCollatorForPreference):  # type: ignore[misc]
        """TRL's collator, counting the batches it makes (a subclass that leaves the batches as they are)."""

        batches = 0

        def torch_call(self, examples: list[Any]) -> dict[str, Any]:
            type(self).batches += 1
            batch: dict[str, Any] = super().torch_call(examples)
            return batch

    class WithCountingCollator(trl_dpo.GuardedDPO):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            collator = CountingCollator(pad_token_id=0, max_length=96)  # (the byte tokenizer's <pad>)
            super().__init__(*args, data_collator=collator, **kwargs)

    reference = trl_dpo.build(4, str(tmp_path / "reference"), trainer_class=DPOTrainer)  # TRL's own collator
    reference.train()
    trainer = trl_dpo.build(4, str(tmp_path / "guarded"), {"ladder": ["micro_batch"]}, WithCountingCollator)
    assert trainer.oomguard_pairs, "a subclass of TRL's preference collator is recognised"
    assert_dpo_split_pair_by_pair(trainer, reference)
    assert CountingCollator.batches >= 4, "the batches were the subclass's"


def test_trls_preference_collators_are_told_by_inheritance_not_by_name() -> None:
    """TRL's preference collators and subclasses of them lay pairs out as chosen rows, then rejected rows; a class
    that only shares the name (even one claiming TRL's module) is some other collator, left unsplit by pairs."""
    from trl.trainer import dpo_trainer, reward_trainer

    from oomguard.integrations._pairs import collates_pairs

    class Extended(reward_trainer.DataCollatorForPreference):  # type: ignore[misc]
        pass

    class DataCollatorForPreference:  # a namesake: its own layout
        pass

    class Impostor:  # a namesake that claims TRL's module too
        pass

    Impostor.__name__, Impostor.__module__ = "DataCollatorForPreference", dpo_trainer.__name__
    assert collates_pairs(dpo_trainer.DataCollatorForPreference(pad_token_id=0))
    assert collates_pairs(reward_trainer.DataCollatorForPreference(pad_token_id=0))
    assert collates_pairs(Extended(pad_token_id=0)), "a subclass keeps TRL's layout"
    assert not collates_pairs(DataCollatorForPreference())
    assert not collates_pairs(Impostor()), "named and placed as TRL's, but not TRL's class"


def test_a_batch_not_laid_out_in_pairs_is_refused_with_the_way_out() -> None:
    from oomguard._errors import BatchSplitError
    from oomguard.integrations._pairs import pair_major

    with pytest.raises(BatchSplitError, match=r"2 rows per pair .* set trainer.oomguard_pairs = False"):
        pair_major({"input_ids": torch.zeros(8, 4), "pixel_values": torch.zeros(3, 4)})


def test_a_reward_model_in_micro_batches_trains_as_on_the_whole_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's RewardTrainer collates pairs as DPO does (chosen rows, then rejected): split pair by pair, micro-batches
    of one pair train as the whole batch. Split along dim 0 (the old bug), they paired the wrong rows: the mean loss
    0.6786 for 0.6866, the weights up to 1.9e-4 off after 3 steps of SGD (4.0e-3 with AdamW); pair by pair, the losses
    are equal and the weights within 7.5e-9 (float summation order), well inside the 1e-6 tolerance.

    Plain SGD, because weights after AdamW are no measure of exact pairing: its first step moves a weight by
    about ``lr * g / (|g| + eps)``, so a gradient within ``eps`` of zero (-1.7e-8 here) that summation order turns
    into -1.9e-8 moves its weight 2.5e-5 differently (the one weight in 10240 that failed a 1e-5 tolerance with
    AdamW, while every step's loss was equal and its gradients 1e-6 apart in norm). SGD moves weights by
    ``lr * g``: a difference in them is one in the gradients, not rounding made ten thousand times larger."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    import trl_dpo

    class GuardedReward(trl_dpo.OOMGuardTrainer, RewardTrainer):  # type: ignore[misc]
        pass

    def build(trainer_class: type[RewardTrainer], name: str, **guarded: Any) -> RewardTrainer:
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                             pad_token_id=0, bos_token_id=1, eos_token_id=1, num_labels=1)  # fmt: skip
        args = RewardConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=8, max_steps=3,
                            max_length=96, learning_rate=1e-3, optim="sgd", bf16=False, use_cpu=True,
                            report_to=[], save_strategy="no", disable_tqdm=True, seed=0)  # fmt: skip
        pairs = trl_dpo.preference_pairs().map(
            lambda e: {"chosen": e["prompt"] + e["chosen"], "rejected": e["prompt"] + e["rejected"]}
        ).remove_columns("prompt")  # fmt: skip
        return trainer_class(model=LlamaForSequenceClassification(config), args=args, train_dataset=pairs,
                             processing_class=trl_sft.byte_tokenizer(), **guarded)  # fmt: skip

    reference = build(RewardTrainer, "reference")
    reference.train()
    trainer = build(GuardedReward, "guarded", oomguard={"ladder": ["micro_batch"]})
    assert trainer.oomguard_pairs
    with SimulatedGPU("3MiB") as gpu:
        gpu.adopt(trainer.model)
        trainer.train()
    assert trainer.oomguard.plan.micro_batch_size == 1
    (got,), (expected,) = (
        [e["train_loss"] for e in t.state.log_history if "train_loss" in e] for t in (trainer, reference)
    )
    assert got == pytest.approx(expected, rel=1e-6), "the mean loss of the 3 steps"
    for p, q in zip(trainer.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("phase", ["backward", "optimizer"])
def test_dpo_metrics_after_an_oom_equal_the_oom_free_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    """DPOTrainer's compute_loss appends its rewards and log-probabilities to ``_metrics`` and counts tokens: what a
    failed attempt added is taken back before the retry, as for SFT."""
    from trl import DPOTrainer

    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    import trl_dpo

    reference = trl_dpo.build(3, str(tmp_path / "reference"), trainer_class=DPOTrainer)
    reference.train()
    gpu_box: list[Any] = []
    options = {"ladder": ["checkpointing", "layer_offload"], "step_journal": "always"}
    trainer = trl_dpo.build(
        3, str(tmp_path / phase), options, trainer_class=_faulty(phase, gpu_box, trl_dpo.GuardedDPO)
    )
    if phase == "backward":  # (after compute_loss appended the step's metrics)
        trainer.model.model.layers[-1].mlp.down_proj.weight.register_hook(lambda grad: trainer.arm())
    with SimulatedGPU("1GiB") as gpu:
        gpu_box.append(gpu)
        gpu.adopt(trainer.model)
        gpu.adopt(trainer.ref_model)
        trainer.train()
    (oom,) = [e for e in trainer.oomguard.events if e.kind == "oom"]
    assert oom.error.phase == phase and oom.step == 1
    for step, (got, expected) in enumerate(zip(trainer.state.log_history, reference.state.log_history, strict=True)):
        keys = [key for key in DPO_METRICS if key in expected]
        assert {k: got[k] for k in keys} == pytest.approx({k: expected[k] for k in keys}, rel=1e-5, abs=1e-6), step


GRPO_METRICS = ("loss", "grad_norm", "reward", "reward_std", "num_tokens", "entropy")


def _grpo(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    import trl_grpo

    return trl_grpo


def assert_same_grpo_run(trainer: Any, reference: Any) -> None:
    for step, (got, expected) in enumerate(zip(trainer.state.log_history, reference.state.log_history, strict=True)):
        keys = [key for key in GRPO_METRICS if key in expected]
        assert {k: got.get(k) for k in keys} == pytest.approx({k: expected[k] for k in keys}, rel=1e-5, abs=1e-6), step
    for p, q in zip(trainer.model.parameters(), reference.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo"])
def test_grpo_in_micro_batches_trains_as_on_the_whole_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loss_type: str
) -> None:
    """GRPO's default loss ("dapo") divides by a token count of the whole batch that the batch carries: each
    micro-batch's loss is a share of the sum. Averaged like a mean loss, a step in 4 micro-batches trained on a
    quarter of its gradient (grad norm 0.195 for 0.779), silently; the shares are now added. Plain SGD, so a
    scaled gradient shows in the weights."""
    from trl import GRPOTrainer

    trl_grpo = _grpo(monkeypatch)
    reference = trl_grpo.build(3, str(tmp_path / "reference"), trainer_class=GRPOTrainer, loss_type=loss_type)
    reference.train()
    trainer = trl_grpo.build(3, str(tmp_path / "guarded"), {"ladder": ["micro_batch"]}, loss_type=loss_type)
    with SimulatedGPU("20MiB") as gpu:  # 8 completions do not fit at once, 2 do
        gpu.adopt(trainer.model)
        trainer.train()
    assert trainer.oomguard.plan.micro_batch_size in (1, 2, 4)
    assert_same_grpo_run(trainer, reference)


@pytest.mark.parametrize("phase", ["backward", "optimizer"])
def test_grpo_after_an_oom_keeps_its_rewards_and_its_completions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    """GRPOTrainer generates and scores completions in ``_prepare_inputs``, before the guarded forward and backward.
    An OOM in backward used to take back the rewards it had recorded (the step's log had none); one in the
    optimizer step replayed the step through ``_prepare_inputs``, which generated again from the prepared batch and
    failed (TypeError). Now the rewards stay and the replay reuses the step's completions: the run is the
    OOM-free one's."""
    from trl import GRPOTrainer

    trl_grpo = _grpo(monkeypatch)
    reference = trl_grpo.build(3, str(tmp_path / "reference"), trainer_class=GRPOTrainer, optim="adamw_torch")
    reference.train()
    gpu_box: list[Any] = []
    options = {"ladder": ["checkpointing", "layer_offload"], "step_journal": "always"}
    trainer = trl_grpo.build(3, str(tmp_path / phase), options, trainer_class=_faulty(phase, gpu_box,
                             trl_grpo.GuardedGRPO), optim="adamw_torch")  # fmt: skip
    if phase == "backward":
        trainer.model.model.layers[-1].mlp.down_proj.weight.register_hook(lambda grad: trainer.arm())
    with SimulatedGPU("1GiB") as gpu:
        gpu_box.append(gpu)
        gpu.adopt(trainer.model)
        trainer.train()
    (oom,) = [e for e in trainer.oomguard.events if e.kind == "oom"]
    assert oom.error.phase == phase and oom.step == 1
    assert_same_grpo_run(trainer, reference)


def test_a_grpo_loss_type_oomguard_does_not_know_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oomguard._errors import GuardConfigError
    from oomguard.integrations._losses import weighting

    trainer = _grpo(monkeypatch).build(1, str(tmp_path / "guarded"))
    assert weighting(trainer) == "sum", "dapo, GRPO's default"
    trainer.loss_type = "next_year"
    with pytest.raises(GuardConfigError, match="GRPO loss_type 'next_year' is new to oomguard"):
        weighting(trainer)


def test_kto_in_micro_batches_says_once_that_its_kl_term_is_no_longer_the_batchs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """KTO estimates its KL term as a mean over the batch: no split can keep it, so the guard says so."""
    import copy
    import logging

    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import KTOConfig, KTOTrainer

    from oomguard.integrations._losses import batch_coupled
    from oomguard.integrations.transformers import OOMGuardTrainer

    class GuardedKTO(OOMGuardTrainer, KTOTrainer):  # type: ignore[misc]
        pass

    lines = trl_sft.stdlib_lines(128)["text"]
    data = Dataset.from_dict({"prompt": lines[0::2][:32], "completion": lines[1::2][:32],
                              "label": [i % 2 == 0 for i in range(32)]})  # fmt: skip
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, pad_token_id=0,
                         bos_token_id=1, eos_token_id=1)  # fmt: skip
    model = LlamaForCausalLM(config)
    args = KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2, max_length=96,
                     optim="adamw_torch", bf16=False, use_cpu=True, report_to=[], save_strategy="no",
                     disable_tqdm=True, seed=0, train_sampling_strategy="sequential")  # fmt: skip
    trainer = GuardedKTO(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
                         processing_class=trl_sft.byte_tokenizer(), oomguard={"ladder": ["micro_batch"]})  # fmt: skip
    assert batch_coupled(trainer) is not None
    with SimulatedGPU("30MiB") as gpu, caplog.at_level(logging.WARNING, logger="oomguard"):
        gpu.adopt(trainer.model)
        gpu.adopt(trainer.ref_model)
        trainer.train()
    assert trainer.oomguard.plan.micro_batch_size in (1, 2, 4)
    said = [r.getMessage() for r in caplog.records if "KL term" in r.getMessage()]
    assert len(said) == 1 and "MicroBatch(min_size=" in said[0]
