"""The chunked_loss rung's mechanism: a causal LM's loss in chunks of tokens, exact, with no full logits.

Models are built here (random weights, nothing downloaded). Every exactness test also checks that the chunked path
ran (the logits the model returned were never computed), so a silent fallback to the plain loss cannot pass it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.steps import forward_backward_peak
from transformers.loss.loss_utils import ForCausalLMLoss

from oomguard import GuardConfigError
from oomguard._effects.chunked_loss import ChunkedLoss
from oomguard._effects.lazy_logits import LazyLogits
from oomguard.testing import SimulatedGPU

VOCAB = 512
SMALL_CHUNKS = 4 * VOCAB * 8  # 8 rows a chunk: every test batch takes several chunks


def _config_kwargs(hidden: int = 32) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }


def llama(bias: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_config_kwargs(), tie_word_embeddings=False))
    if bias:  # a head with a bias (the model's forward only calls self.lm_head)
        model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
        torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    return model


def qwen2(vocab: int = VOCAB, hidden: int = 32) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{**_config_kwargs(hidden), "vocab_size": vocab}, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def gemma2() -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(**_config_kwargs(), head_dim=8, final_logit_softcapping=30.0))


def gemma3() -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(**_config_kwargs(), head_dim=8, final_logit_softcapping=30.0))


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # (two forwards must compute the same)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=1, **no_dropout)
    return GPT2LMHeadModel(config)


def cohere() -> torch.nn.Module:
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    return CohereForCausalLM(CohereConfig(**_config_kwargs(), logit_scale=0.25))


def granite() -> torch.nn.Module:
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    return GraniteForCausalLM(GraniteConfig(**_config_kwargs(), logits_scaling=8.0))


def ragged(lengths: tuple[int, ...] = (24, 17, 9), seq: int = 24, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Right-padded samples of different lengths, pads masked and labelled -100, and a prompt masked too."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (len(lengths), seq), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :5] = -100  # a prompt that does not count
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": labels}


def step(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    """One forward and backward: the loss, every parameter's gradient, the outputs."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, out


def assert_close_relative(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    """``got`` within ``tolerance`` of ``want``, relative to ``want``'s largest value (float summation order)."""
    scale = want.abs().max().clamp(min=1e-30)
    assert ((got - want).abs().max() / scale).item() <= tolerance, ((got - want).abs().max() / scale).item()


def chunked(model: torch.nn.Module, chunk_bytes: int | None = SMALL_CHUNKS) -> ChunkedLoss:
    rung = ChunkedLoss(chunk_bytes=chunk_bytes)
    assert ChunkedLoss.applies(model) is None
    rung.apply(model)
    return rung


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": llama,
    "qwen2-tied": qwen2,
    "llama-bias": lambda: llama(bias=True),
    "gemma2-softcap": gemma2,
    "gemma3-softcap": gemma3,
    "gpt2-tied": gpt2,  # its lm_head is an nn.Linear (Conv1D is only inside its blocks)
    "cohere-scale": cohere,
    "granite-scale": granite,
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("items", [None, 41])
def test_fp32_loss_and_every_gradient_equal_the_models_own(name: str, items: int | None) -> None:
    model = MODELS[name]()
    batch = ragged()
    if items is not None:  # the Trainer's (and the guard's) exact accumulation: sum, then divide by this
        batch["num_items_in_batch"] = torch.tensor(items)
    want_loss, want_grads, _ = step(model, batch)
    chunked(model)
    got_loss, got_grads, out = step(model, batch)
    assert isinstance(out.logits, LazyLogits) and not out.logits.materialized  # the chunked path ran
    assert_close_relative(got_loss, want_loss, 1e-5)
    assert got_grads.keys() == want_grads.keys()
    for key, want in want_grads.items():
        assert_close_relative(got_grads[key], want, 1e-5)


def test_a_batch_with_no_counted_token_gives_the_same_loss_and_no_gradient() -> None:
    model = llama()
    batch = ragged()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    plain = model(**batch).loss  # the mean over no token: nan, as cross_entropy gives it
    summed = model(**batch, num_items_in_batch=torch.tensor(7)).loss  # summed and divided: 0
    chunked(model)
    got, got_summed = model(**batch), model(**batch, num_items_in_batch=torch.tensor(7))
    assert not got.logits.materialized
    assert got.loss.isnan() and plain.isnan()
    assert got_summed.loss.item() == summed.item() == 0.0
    got_summed.loss.backward()
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()


def test_shift_labels_given_by_the_caller_are_used_as_they_are() -> None:
    model = qwen2()
    batch = ragged()
    labels = batch.pop("labels")
    batch["shift_labels"] = torch.roll(labels, -3, dims=1)  # not the shift the loss would make itself
    batch["labels"] = labels
    want_loss, want_grads, _ = step(model, batch)
    chunked(model)
    got_loss, got_grads, out = step(model, batch)
    assert not out.logits.materialized
    assert_close_relative(got_loss, want_loss, 1e-5)
    assert_close_relative(got_grads["model.embed_tokens.weight"], want_grads["model.embed_tokens.weight"], 1e-5)


def test_bf16_autocast_is_within_amps_tolerance_and_sums_the_head_gradient_in_fp32() -> None:
    model = llama()
    batch = ragged()
    exact_loss, exact_grads, _ = step(model, batch)  # fp32: the truth both bf16 runs are measured against
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp_loss, amp_grads, amp_out = step(model, batch)
    chunked(model, chunk_bytes=4 * VOCAB)  # one row a chunk: 70 bf16 products summed into the weight gradient
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_loss, got_grads, out = step(model, batch)
    assert not out.logits.materialized and out.logits.dtype == torch.bfloat16
    assert torch.equal(out.logits, amp_out.logits)  # read after autocast ended: still autocast's values
    assert_close_relative(got_loss, amp_loss, 2e-2)
    for key, want in amp_grads.items():
        assert_close_relative(got_grads[key], want, 5e-2)
    # Summed in bf16, 70 chunks would lose far more than amp's one product; summed in fp32 they do not.
    head = "lm_head.weight"
    amp_error = (amp_grads[head] - exact_grads[head]).abs().max()
    got_error = (got_grads[head] - exact_grads[head]).abs().max()
    assert got_error <= 1.5 * amp_error, (got_error, amp_error)
    assert_close_relative(got_loss, exact_loss, 2e-2)


def test_a_step_reading_the_logits_gets_the_unchunked_values_and_their_gradient() -> None:
    model = gemma2()
    batch = ragged()
    plain = model(**batch)
    want_accuracy = (plain.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]).float().mean()
    chunked(model)
    out = model(**batch)
    assert not out.logits.materialized  # the loss was computed in chunks, before anything read the logits
    accuracy = (out.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]).float().mean()  # a token-accuracy metric
    assert accuracy.item() == want_accuracy.item()
    assert torch.equal(out.logits, plain.logits)  # the same values, bit for bit (softcap included)
    assert out.logits.shape == plain.logits.shape and out.logits.dtype == plain.logits.dtype
    # A loss built from the logits (a distillation term) trains through them as without the rung.
    model.zero_grad(set_to_none=True)
    (out.loss + out.logits.square().mean()).backward()
    reference = gemma2()  # the same weights, no rung
    ref_out = reference(**batch)
    (ref_out.loss + ref_out.logits.square().mean()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert_close_relative(p.grad, q.grad, 1e-5)


def test_logits_read_under_no_grad_first_still_train_a_loss_built_from_them_after() -> None:
    """A metric reads the logits under ``torch.no_grad()``, then the step builds a loss term from them (a z-loss):
    the term trains as without the rung. Before, the logits made without history on that first read were kept, and
    the term gave no gradient (0.0166 off after two steps)."""
    batch = ragged()

    def trained(rung: bool) -> tuple[float, list[torch.Tensor]]:
        model = qwen2()
        if rung:
            chunked(model)
        out = model(**batch)
        with torch.no_grad():
            accuracy = (out.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]).float().mean()
        z_loss = out.logits.logsumexp(-1).square().mean()
        (out.loss + 1e-2 * z_loss).backward()
        return accuracy.item(), [p.grad for p in model.parameters()]

    (accuracy, grads), (want_accuracy, want) = trained(True), trained(False)
    assert accuracy == want_accuracy
    for got, expected in zip(grads, want, strict=True):
        assert_close_relative(got, expected, 1e-5)


def test_a_forward_without_labels_gives_real_logits_with_gradient_history() -> None:
    model = qwen2()
    batch = ragged()
    labels = batch.pop("labels")
    want = model(**batch).logits
    chunked(model)
    logits = model(**batch).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    loss.backward()  # the user's own loss from the logits: they must carry their history
    assert model.model.embed_tokens.weight.grad is not None
    assert torch.equal(logits, want)


def test_undo_puts_the_model_back_bit_for_bit() -> None:
    model = llama(bias=True)
    batch = ragged()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    head_attributes, model_attributes = set(vars(model.lm_head)), set(vars(model))
    want = model(**batch)
    rung = chunked(model)
    assert model.loss_function is not ForCausalLMLoss and "forward" in vars(model.lm_head)
    rung.undo(model)
    assert not rung.applied
    assert set(vars(model.lm_head)) == head_attributes and set(vars(model)) == model_attributes
    assert model.loss_function is ForCausalLMLoss
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    got = model(**batch)
    assert (
        type(got.logits) is torch.Tensor and torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    )
    assert ChunkedLoss.applies(model) is None  # and it can be applied again


def test_undo_gives_back_a_loss_function_the_user_had_set() -> None:
    model = qwen2()
    model.loss_function = ForCausalLMLoss  # set on the instance: the setter keeps it in _loss_function
    rung = chunked(model)
    rung.undo()
    assert vars(model)["_loss_function"] is ForCausalLMLoss


def test_undo_leaves_what_was_replaced_since_as_it_is() -> None:
    model = llama()
    rung = chunked(model)
    new_head = torch.nn.Linear(32, VOCAB, bias=False)
    model.lm_head = new_head  # a new module: the patched one is gone with the old head

    def user_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        result: torch.Tensor = ForCausalLMLoss(*args, **kwargs)
        return result

    model.loss_function = user_loss
    rung.undo(model)
    assert model.loss_function is user_loss and "forward" not in vars(new_head)
    assert not rung.applied


def test_a_second_backward_through_the_same_graph_fails_loudly() -> None:
    model = qwen2()
    chunked(model)
    loss = model(**ragged()).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # the kept gradients were scaled in place: never used twice


def test_an_evaluation_forward_makes_no_gradients() -> None:
    model = qwen2()
    batch = ragged()
    want = model(**batch).loss
    chunked(model)
    with torch.no_grad():
        out = model(**batch)
    assert not out.loss.requires_grad and not out.logits.materialized
    assert_close_relative(out.loss, want.detach(), 1e-5)


def _refusals() -> dict[str, Callable[[], torch.nn.Module]]:
    def lora_head() -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model

        return get_peft_model(llama(), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))

    def custom_loss() -> torch.nn.Module:
        model = llama()
        model.loss_function = lambda *args, **kwargs: ForCausalLMLoss(*args, **kwargs) * 2
        return model

    def hooked_head() -> torch.nn.Module:
        model = llama()
        model.lm_head.register_forward_hook(lambda module, args, out: None)
        return model

    def trl_fused_head() -> torch.nn.Module:
        from trl.trainer.utils import add_fused_lm_head

        model = llama()
        add_fused_lm_head(model)
        return model

    def applied_already() -> torch.nn.Module:
        model = llama()
        ChunkedLoss().apply(model)
        return model

    return {
        "lora adapter on the head": lora_head,
        "a custom loss": custom_loss,
        "a hook on the head": hooked_head,
        "TRL's fused head": trl_fused_head,
        "applied already": applied_already,
        "not a causal LM": lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)),
    }


@pytest.mark.parametrize("case", list(_refusals()))
def test_models_it_cannot_be_exact_on_are_refused_with_the_reason(case: str) -> None:
    model = _refusals()[case]()
    reason = ChunkedLoss.applies(model)
    assert reason is not None
    with pytest.raises(GuardConfigError, match="cannot be applied"):
        ChunkedLoss().apply(model)


def test_a_lora_model_without_an_adapter_on_the_head_is_patched_through_its_wrapper() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(), LoraConfig(r=2, target_modules=["q_proj"]))
    batch = ragged()
    want_loss, _, _ = step(model, batch)
    rung = chunked(model)
    got_loss, _, out = step(model, batch)
    assert not out.logits.materialized
    assert_close_relative(got_loss, want_loss, 1e-5)
    rung.undo(model)


def test_a_model_whose_forward_accelerate_wraps_is_patched_and_exact() -> None:
    from accelerate.utils import convert_outputs_to_fp32

    model = llama()
    model.forward = convert_outputs_to_fp32(model.forward)  # what Accelerate's prepare() does under bf16
    batch = ragged()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, want_grads, want = step(model, batch)
    chunked(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_loss, got_grads, got = step(model, batch)
    for key, grad in want_grads.items():
        assert_close_relative(got_grads[key], grad, 5e-2)
    assert isinstance(got.logits, LazyLogits) and not got.logits.materialized  # its .float() was recorded
    assert got.logits.dtype == torch.float32 and torch.equal(got.logits, want.logits)
    assert_close_relative(got_loss, want_loss, 2e-2)


def _peak(model: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int = 2) -> int:
    """The steady (last) step's peak under a simulated GPU: forward, backward and AdamW's step, fp32."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with SimulatedGPU("8GiB") as gpu:
        gpu.adopt(model, batch.values())
        for _ in range(steps):
            gpu.reset_peak_memory_stats()
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return gpu.max_memory_allocated()


def test_the_steady_peak_is_at_most_four_tenths_of_the_plain_one() -> None:
    # The issue's case: Qwen2 config, vocabulary 32,000, hidden 64, 2 layers, tied, 4 x 256 tokens, fp32, AdamW.
    batch = ragged(lengths=(256, 200, 256, 130), seq=256, vocab=32_000)
    plain = _peak(qwen2(vocab=32_000, hidden=64), batch)
    model = qwen2(vocab=32_000, hidden=64)
    chunked(model, chunk_bytes=None)  # the default chunk size
    assert _peak(model, batch) <= 0.4 * plain


def test_it_runs_on_fake_tensors_as_the_planner_does() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        model = qwen2()  # parameters made as fakes
        chunked(model)
        batch = {"input_ids": torch.zeros(2, 16, dtype=torch.long), "labels": torch.zeros(2, 16, dtype=torch.long)}
        out = model(**batch)
        out.loss.backward()
        assert isinstance(out.loss, FakeTensor) and not out.logits.materialized
        assert isinstance(model.model.embed_tokens.weight.grad, FakeTensor)


def test_the_planners_fake_run_sees_every_allocation_the_simulator_counts() -> None:
    from oomguard._backends.accounting import AccountedDevice
    from oomguard._planner.fakes import _faked

    batch = ragged(lengths=(64, 40), seq=64, vocab=8192)
    model = qwen2(vocab=8192, hidden=32)
    chunked(model, chunk_bytes=4 * 8192 * 16)  # 16 rows a chunk: 8 chunks
    with SimulatedGPU("8GiB") as gpu:
        real = forward_backward_peak(gpu, model, batch)
    model = qwen2(vocab=8192, hidden=32)
    chunked(model, chunk_bytes=4 * 8192 * 16)
    faked = _faked(model, torch.optim.AdamW(model.parameters()), batch, cuda=False)
    with faked as (_, fake_batch), AccountedDevice(2**62, name="planner") as probe:  # the planner's accounting
        fake = forward_backward_peak(probe, model, fake_batch)
    assert fake == real  # the chunks' logits and softmax are ordinary ops: priced as they are allocated


def _fake_step_counts(elide: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int, int, int, int]:
    """The planner's fake forward and backward of an 8-chunk loss (16 rows a chunk, the last one shorter): its
    peak, the FLOPs and operations counted, the operations dispatched and the chunks run; with repetitions elided
    or not."""
    from oomguard._backends.accounting import AccountedDevice
    from oomguard._effects import chunked_ce
    from oomguard._effects.elision import eliding
    from oomguard._planner.bench import _repeating
    from oomguard._planner.fakes import _faked
    from oomguard._planner.speed import FlopCount

    chunks: list[int] = []
    one_chunk = chunked_ce._chunk
    monkeypatch.setattr(chunked_ce, "_chunk", lambda *args: chunks.append(1) or one_chunk(*args))
    model = qwen2(vocab=8192, hidden=32)
    chunked(model, chunk_bytes=4 * 8192 * 16)
    faked = _faked(model, torch.optim.AdamW(model.parameters()), ragged(lengths=(64, 40), seq=64, vocab=8192), False)
    counted, dispatched = FlopCount(), FlopCount()  # (the second entered first: it sees what is dispatched)
    repeats = eliding(_repeating(counted)) if elide else contextlib.nullcontext()
    with faked as (_, batch), AccountedDevice(2**62, name="planner") as probe, dispatched, counted, repeats:
        peak = forward_backward_peak(probe, model, batch)
    return peak, counted.total, counted.ops, dispatched.ops, len(chunks)


def test_a_dry_run_runs_three_chunks_for_many_and_measures_what_every_chunk_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the planner elides repetitions, the loss on fake tensors runs its first chunk, its second (counted for
    every chunk up to the last) and its last: the same peak as every chunk run (and as the simulator's, the test
    above), the same FLOPs and operations counted, far fewer operations dispatched (a fake step's cost)."""
    peak, flops, ops, dispatched, chunks = _fake_step_counts(True, monkeypatch)
    every = _fake_step_counts(False, monkeypatch)
    assert (peak, flops, ops) == every[:3]
    assert (chunks, every[4]) == (3, 8)
    assert every[3] == every[2] and dispatched < every[3]


def test_an_oom_at_any_allocation_of_the_chunked_loss_leaves_nothing_behind() -> None:
    # The chunked loss allocates only in the forward (its backward scales the gradients it kept, in place): a
    # sweep of the forward's allocations fails each of its chunks' in turn.
    model = qwen2()
    batch = ragged()
    want_loss, want_grads, _ = step(model, batch)
    chunked(model, chunk_bytes=4 * VOCAB * 32)  # 3 chunks of 32 rows (72 in all): the last one shorter
    model.zero_grad(set_to_none=True)
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model, batch.values())
        base, before = gpu.memory_allocated(), gpu.allocations
        model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        backbone = gpu.allocations - before  # the layers' allocations come first: the sweep starts after them
        before = gpu.allocations
        model(**batch)
        count = gpu.allocations - before  # every allocation of one forward, the loss's chunks included
        assert count > backbone + 3 * 5  # 3 chunks, several allocations each
        for n in range(backbone + 1, count + 1):
            gpu.fail_allocation(n)
            failed = False
            try:
                model(**batch).loss.backward()
            except torch.OutOfMemoryError:
                failed = True
            assert failed and not gpu.fault_pending, n
            assert gpu.memory_allocated() == base, n  # the lazy logits and the kept gradients are gone
            assert all(p.grad is None for p in model.parameters()), n  # the forward failed: no gradient made
        got_loss, got_grads, _ = step(model, batch)
    assert_close_relative(got_loss, want_loss, 1e-5)
    for key, want in want_grads.items():
        assert_close_relative(got_grads[key], want, 1e-5)


def test_saved_tensor_hooks_around_the_forward_never_see_a_chunks_logits() -> None:
    # The activation offload rung packs what a forward saves; each chunk's softmax is freed with its chunk and
    # must not travel to the host and back.
    model = llama(bias=True)
    chunked(model)
    packed: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(**ragged())
    out.loss.backward()
    assert not out.logits.materialized and packed  # the layers' saved tensors went through the hooks
    assert not [shape for shape in packed if len(shape) == 2 and shape[-1] == VOCAB], packed


def test_a_deep_copy_of_a_patched_model_computes_with_its_own_weights() -> None:
    import copy

    model = qwen2()
    batch = ragged()
    chunked(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(0.5)  # tied: the embeddings too
    reference = qwen2()
    with torch.no_grad():
        reference.lm_head.weight.mul_(0.5)
    got, want = twin(**batch), reference(**batch)
    assert not got.logits.materialized
    assert_close_relative(got.loss, want.loss, 1e-5)


def test_generation_with_the_rung_on_gives_the_same_tokens() -> None:
    model = llama()
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    want = model.generate(prompt, **options)
    chunked(model)
    assert torch.equal(model.generate(prompt, **options), want)


# -- the rung: the guard engages it, trains exactly on it, and undoes it ---------------------------------------------


def _guarded_run(
    ladder: list[str] | None, capacity: int | None, batches: list[dict[str, torch.Tensor]], default: bool = False
) -> Any:
    """Three AdamW steps of the issue's Qwen2 under a simulated GPU of ``capacity`` (None: unguarded, roomy),
    guarded with ``ladder`` (or the default ladder, ``default=True``), unguarded if neither."""
    from oomguard import oom_guard

    model = qwen2(vocab=32_000, hidden=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, results = [], []
    with SimulatedGPU(capacity or "8GiB") as gpu:
        gpu.adopt(model)
        if ladder is None and not default:
            for batch in batches:
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
        else:
            train = oom_guard(model=model, optimizer=optimizer, ladder=ladder, tune_after=None)(
                lambda batch: model(**batch)
            )
            for batch in batches:
                gpu.reset_peak_memory_stats()  # (the last step's peak is the steady one)
                results.append(train(batch))
                losses.append(results[-1].loss)
            train.guard.close()
        peak = gpu.max_memory_allocated()
    return model, losses, results, peak


def test_the_rung_trains_the_issues_qwen2_exactly_under_half_its_plain_peak() -> None:
    """Issue 25's case: vocabulary 32,000, hidden 64, 2 layers, tied, 4 x 256 ragged tokens, AdamW, fp32, a budget
    of half the plain peak: one OOM, then every step on the chunked loss, as the unguarded run trains."""
    batches = [ragged(lengths=(256, 200, 256, 130), seq=256, vocab=32_000) for _ in range(3)]
    reference, want, _, _ = _guarded_run(None, None, batches)
    plain = _peak(qwen2(vocab=32_000, hidden=64), batches[0])
    model, got, results, peak = _guarded_run(["chunked_loss"], plain // 2, batches)
    assert [r.ooms for r in results] == [1, 0, 0]
    assert all(r.rungs == ("chunked_loss",) for r in results), [r.rungs for r in results]
    assert "chunked loss" in results[-1].plan.describe(4)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    assert peak <= 0.4 * plain, f"the steady step peaked at {peak / plain:.2f}x the plain step"
    assert ChunkedLoss.applies(model) is None, "closing the guard took the patches off"


def test_the_default_ladder_settles_the_issues_qwen2_on_the_chunked_loss_without_offloading() -> None:
    """Issue 25's case with the default ladder: at most two OOMs, then a plan with the chunked loss and neither
    optimizer nor layer offload, training as the unguarded run does."""
    batches = [ragged(lengths=(256, 200, 256, 130), seq=256, vocab=32_000) for _ in range(3)]
    reference, want, _, _ = _guarded_run(None, None, batches)
    plain = _peak(qwen2(vocab=32_000, hidden=64), batches[0])
    model, got, results, _ = _guarded_run(ladder=None, capacity=plain // 2, batches=batches, default=True)
    assert sum(r.ooms for r in results) <= 2 and results[-1].ooms == 0, [r.ooms for r in results]
    settled = results[-1].plan
    assert settled.level("chunked_loss") == 1, settled.describe(4)
    assert not settled.optimizer_offload and not settled.offload_layers, settled.describe(4)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_the_rung_never_engages_where_it_would_not_be_exact() -> None:
    """A custom loss (not transformers' ForCausalLMLoss): the rung is skipped and the ladder has nothing else."""
    from oomguard import LadderExhausted, oom_guard

    model = qwen2(vocab=32_000, hidden=64)
    model.loss_function = lambda logits, labels, **kwargs: logits.float().logsumexp(-1).mean()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = ragged(lengths=(256, 200, 256, 130), seq=256, vocab=32_000)
    train = oom_guard(model=model, optimizer=optimizer, ladder=["chunked_loss"], tune_after=None, predictive=False)(
        lambda batch: model(**batch)
    )
    with SimulatedGPU(_peak(qwen2(vocab=32_000, hidden=64), batch) // 2) as gpu:
        gpu.adopt(model)
        with pytest.raises(LadderExhausted):
            train(batch)
    assert "forward" not in vars(model.lm_head), "the head was never patched"


# -- torch.compile: the lazy head is a graph break, the loss's chunks run eagerly between compiled graphs ---------


class TinyCausalLM(torch.nn.Module):
    """The shape of transformers' ``*ForCausalLM`` in a few lines (its forward calls ``self.lm_head`` and then
    ``self.loss_function``, which has a setter), small enough for dynamo to compile in seconds on a CPU: the test
    is about what torch.compile does with the rung's head and loss, not about the layers in between."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.vocab = vocab

    @property
    def loss_function(self) -> Any:
        return vars(self).get("_loss_function", ForCausalLMLoss)

    @loss_function.setter
    def loss_function(self, value: Any) -> None:
        self._loss_function = value

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> dict[str, torch.Tensor]:
        logits = self.lm_head(torch.tanh(self.embed(input_ids)))
        loss = self.loss_function(logits, labels, vocab_size=self.vocab, **kwargs)
        return {"loss": loss, "logits": logits}


def test_a_step_calling_a_compiled_model_trains_on_the_models_own_loss() -> None:
    """``torch.compile`` (backend "eager": dynamo's tracing, no code generation) compiles the model's code and
    leaves the lazy head and the chunked loss to run eagerly, as they say (no warning from dynamo that asks the
    user to file an issue); the losses are the uncompiled model's own. (Not under the simulated GPU: its dispatch
    mode makes dynamo skip every frame.)"""
    import warnings

    from torch._dynamo.utils import counters

    from oomguard import OOMGuard, Plan

    batch = ragged()
    batch.pop("attention_mask")
    reference = TinyCausalLM()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    want = []
    for _ in range(2):
        loss = reference(**batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        want.append(loss.item())
    torch._dynamo.reset()
    counters.clear()
    model = TinyCausalLM()
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outputs: list[dict[str, torch.Tensor]] = []
    guard = OOMGuard(lambda b: outputs.append(compiled(**b)) or outputs[-1]["loss"], model=model, optimizer=optimizer)
    guard.plan = Plan().with_level("chunked_loss", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [guard(batch).loss for _ in range(2)]
    guard.close()
    assert counters["stats"]["unique_graphs"] > 0, "dynamo compiled the model's code"
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message)[:200] for w in caught]
    assert all(isinstance(o["logits"], LazyLogits) and not o["logits"].materialized for o in outputs)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


# -- with quantized_weights: the head is the chunked loss's, and stays whole ----------------------------------------


def _frozen_head_llama() -> torch.nn.Module:
    """A LoRA-like job's base: the head and the attention projections frozen (8-bit candidates), the rest trains."""
    model = llama()
    for name, param in model.named_parameters():
        if name == "lm_head.weight" or name.endswith(("q_proj.weight", "o_proj.weight")):
            param.requires_grad_(False)
    return model


def test_a_plan_with_quantized_weights_and_the_chunked_loss_keeps_the_head_whole_and_the_models_own_loss() -> None:
    """quantized_weights quantizes the frozen head on its own; on a plan that has chunked_loss too it gives the
    head back whole first (the chunked loss reads its weight per chunk) and the loss is the model's own on those
    weights, as the planner's dry run computes it with the rung set aside."""
    from oomguard import OOMGuard, Plan
    from oomguard._effects.qweight import QuantizedWeight
    from oomguard._rungs.chunked_loss import ChunkedLossEffect

    model = _frozen_head_llama()
    batch = ragged()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)  # (weights stay)
    outputs: list[Any] = []
    guard = OOMGuard(lambda b: outputs.append(model(**b)) or outputs[-1], model=model, optimizer=optimizer, ladder=[])
    with SimulatedGPU("1GiB") as gpu:
        gpu.adopt(model)
        guard.plan = Plan(quantized_weights=True)
        guard(batch)
        assert isinstance(model.lm_head.weight, QuantizedWeight), "alone, the rung quantizes the frozen head"
        guard.plan = Plan(quantized_weights=True).with_level("chunked_loss", 1)
        got = guard(batch).loss
        assert type(model.lm_head.weight) is torch.nn.Parameter, "the head is whole again"
        assert isinstance(model.model.layers[0].self_attn.q_proj.weight, QuantizedWeight), "the others are not"
        assert isinstance(outputs[-1].logits, LazyLogits) and not outputs[-1].logits.materialized
        (chunking,) = [e for e in guard.effects._effects if isinstance(e, ChunkedLossEffect)]
        aside = chunking.suspended()
        assert aside is not None
        with aside, torch.no_grad():  # the model's own loss, the quantized weights as they are
            want = model(**batch).loss
        assert "forward" in vars(model.lm_head), "patched again after"
    guard.close()
    assert_close_relative(torch.tensor(got), want, 1e-5)


def test_quantized_weights_has_nothing_to_give_on_a_chunked_plan_where_only_the_head_is_frozen() -> None:
    from oomguard import Plan
    from oomguard._effects.base import EffectTarget
    from oomguard._ladder.rungs import RungContext
    from oomguard._rungs.quantized_weights import QuantizedWeights

    model = llama()
    model.lm_head.weight.requires_grad_(False)
    rung = QuantizedWeights()
    facts = dict(rung.facts(EffectTarget(model, torch.optim.AdamW(model.parameters()), [])))
    context = RungContext(batch_size=3, frozen_linears=facts.pop("frozen_linears"), facts=facts)
    assert rung.deeper(Plan(), context) == Plan(quantized_weights=True)  # the head alone is worth quantizing
    assert rung.deeper(Plan().with_level("chunked_loss", 1), context) is None  # not while it is the chunked loss's


def test_the_chunked_loss_engages_on_a_plan_that_keeps_master_weights() -> None:
    """The master level puts the guard's own autocast hooks on every module owning a halved weight, the head
    among them: they are not hooks that would see the logits, so the chunked loss still engages after it (as a
    recovery from the master level does) and trains within amp's tolerance of the same plan unchunked."""
    from oomguard import OOMGuard, Plan

    master = Plan(precision="bf16", optimizer_offload="master")
    batches = [ragged() for _ in range(3)]
    losses: dict[bool, list[float]] = {}
    for chunk in (False, True):
        torch.manual_seed(0)
        model = llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with SimulatedGPU("1GiB") as gpu:
            gpu.adopt(model)
            guard = OOMGuard(lambda batch, model=model: model(**batch), model=model, optimizer=optimizer, ladder=[])
            guard.plan = master
            losses[chunk] = [guard(batches[0]).loss]
            guard.plan = master.with_level("chunked_loss", 1) if chunk else master
            losses[chunk] += [guard(batch).loss for batch in batches[1:]]
            assert ChunkedLoss.applies(model) == ("the chunked loss is applied already" if chunk else None)
            guard.close()
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-2, atol=0)


def test_the_planner_counts_the_fp32_chunked_loss_at_the_flops_of_the_loss_it_replaces() -> None:
    """In fp32 the chunked loss adds each chunk's head gradient in place (``addmm_``), which torch's FLOP registry
    has no formula for: counted by ``addmm``'s, the step's FLOPs are the unchunked step's (the same three matmuls of
    the head per token); without it, 69 % of them, and a chunked plan was predicted faster than it runs."""
    from oomguard._planner.speed import FlopCount

    ids = torch.randint(1, 8192, (2, 64), generator=torch.Generator().manual_seed(0))
    counted = []
    for chunk in (False, True):
        model = qwen2(vocab=8192, hidden=32)
        if chunk:
            chunked(model)
        with FlopCount() as flops:
            model(input_ids=ids, labels=ids).loss.backward()
        counted.append(flops.total)
    assert counted[1] == counted[0] > 0
