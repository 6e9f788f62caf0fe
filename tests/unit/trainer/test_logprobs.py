"""The one log-prob function of both backends (trainer/logprobs.py): chunking changes memory,
never numbers. Chunked or not, log-probs and entropies are the whole pass's bit for bit, their
gradients agree to float32 rounding, and — the point of chunking — autograd never keeps a
float32 [tokens, vocab] tensor, only the logits the model made (in their own dtype)."""
from __future__ import annotations

import pytest
import torch

from tandem.trainer.logprobs import token_logprobs


def _case(n: int = 23, vocab: int = 37, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(n, vocab, generator=gen)).to(dtype).requires_grad_(True)
    ids = torch.randint(0, vocab, (n,), generator=gen)
    cu = torch.tensor([0, 5, 6, 15, n], dtype=torch.int32)
    return logits, ids, cu


def test_whole_pass_is_log_softmax_of_the_next_token_at_its_own_position():
    logits, ids, cu = _case()
    with torch.no_grad():
        out = token_logprobs(logits, ids, cu, 0.7, True)
    logp_all = torch.log_softmax(logits.detach() / 0.7, dim=-1)
    for i in range(1, len(ids)):
        want = 0.0 if i in cu.tolist() else float(logp_all[i - 1, ids[i]])
        assert float(out.logp[i]) == pytest.approx(want, abs=1e-6), i
    assert out.logp[0] == 0 and out.entropy[cu[:-1].long()].eq(0).all()
    assert float(out.entropy[3]) == pytest.approx(float(-(logp_all[2].exp() * logp_all[2]).sum()), abs=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 7, 23, 100])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunks_equal_the_whole_pass_with_gradients(chunk, entropy_grad):
    logits, ids, cu = _case()
    ref = token_logprobs(logits, ids, cu, 0.7, True, entropy_grad, chunk=0)
    got = token_logprobs(logits, ids, cu, 0.7, True, entropy_grad, chunk=chunk)
    torch.testing.assert_close(got.logp, ref.logp, rtol=0, atol=0)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=0, atol=0)
    assert got.logp[cu[:-1].long()].eq(0).all()   # sequence starts are nothing's prediction
    assert got.entropy.requires_grad is entropy_grad
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(5))

    def grad(out):
        loss = (weights * out.logp).sum() + (out.entropy.sum() if entropy_grad else 0.0)
        return torch.autograd.grad(loss, logits)[0]
    torch.testing.assert_close(grad(got), grad(ref), rtol=1e-6, atol=1e-7)


def test_bf16_logits_give_the_float32_pass_of_the_same_values():
    """GPU logits are bf16: a chunk is cast to float32 inside, as the whole pass casts first."""
    logits, ids, cu = _case(dtype=torch.bfloat16)
    ref = token_logprobs(logits.float(), ids, cu, 1.0, False)
    got = token_logprobs(logits, ids, cu, 1.0, False, chunk=6)
    assert got.logp.dtype == torch.float32 and got.entropy is None
    torch.testing.assert_close(got.logp, ref.logp, rtol=0, atol=0)
    g = torch.autograd.grad(got.logp.sum(), logits)[0]
    assert g.dtype == torch.bfloat16 and g.abs().sum() > 0


def _saved_for_backward(chunk: int, entropy_grad: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor autograd keeps for the backward pass of one call."""
    n, vocab = 64, 50
    logits, ids, _ = _case(n, vocab, torch.bfloat16)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = token_logprobs(logits, ids, torch.tensor([0, n]), 0.9, True, entropy_grad, chunk=chunk)
        (out.logp.sum() + out.entropy.sum()).backward()
    return saved


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_pass_keeps_no_float32_vocabulary_tensor_for_backward(entropy_grad):
    n, vocab = 64, 50
    whole = _saved_for_backward(0, entropy_grad)
    chunked = _saved_for_backward(16, entropy_grad)
    # Without chunks the float32 log-softmax of every row waits for the backward pass ...
    assert ((n, vocab), torch.float32) in whole
    # ... with chunks no float32 tensor of a vocabulary's width outlives its chunk's forward:
    # only the bf16 logits (the chunks' checkpointed inputs) and per-token columns are kept.
    # (Tensors saved while a chunk is recomputed in the backward are at most chunk rows.)
    wide32 = [s for s, dt in chunked if dt == torch.float32 and len(s) == 2 and s[-1] == vocab]
    assert all(s[0] <= 16 for s in wide32), wide32
    assert not [s for s, dt in chunked if dt == torch.float32 and s and s[0] > 16 and len(s) == 2]


def _head_case(n: int = 23, hidden: int = 11, vocab: int = 37, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(n, hidden, generator=gen).to(dtype).requires_grad_(True)
    w = torch.randn(vocab, hidden, generator=gen).to(dtype).requires_grad_(True)
    ids = torch.randint(0, vocab, (n,), generator=gen)
    return h, w, ids, torch.tensor([0, 5, 6, 15, n], dtype=torch.int32)


@pytest.mark.parametrize("chunk", [0, 1, 7, 23, 100])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_the_output_layer_in_chunks_equals_logits_made_whole(chunk, entropy_grad):
    """head=W: each chunk's logits are h[chunk] @ W.T; values and both gradients (hidden states
    and weight) as from the whole logits h @ W.T, to float32 rounding (a row's product does not
    depend on which rows share its matrix product, up to the kernel's summation order)."""
    h, w, ids, cu = _head_case()
    ref = token_logprobs(h @ w.T, ids, cu, 0.7, True, entropy_grad, chunk=0)
    got = token_logprobs(h, ids, cu, 0.7, True, entropy_grad, chunk=chunk, head=w)
    torch.testing.assert_close(got.logp, ref.logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-6, atol=1e-6)
    assert got.logp[cu[:-1].long()].eq(0).all()
    weights = torch.randn(len(ids), generator=torch.Generator().manual_seed(5))

    def grads(out):
        loss = (weights * out.logp).sum() + (out.entropy.sum() if entropy_grad else 0.0)
        return torch.autograd.grad(loss, (h, w))
    # W's gradient sums per-chunk products: with one-row chunks, 23 rounded terms instead of one
    # matrix product's (2e-6 apart on an AVX-512 CPU at a gradient of 0.1)
    for g, g_ref in zip(grads(got), grads(ref), strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


def _largest_saved_storage(h, w, ids, chunk: int, head: bool) -> int:
    """Elements of the largest storage behind a tensor autograd keeps for the backward pass (a
    chunk's view of whole logits counts as the whole logits: it keeps them alive)."""
    sizes = []

    def pack(t):
        sizes.append(t.untyped_storage().nbytes() // t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rows = h if head else h @ w.T
        out = token_logprobs(rows, ids, torch.tensor([0, len(ids)]), 0.9, True, True, chunk=chunk,
                             head=w if head else None)
        (out.logp.sum() + out.entropy.sum()).backward()
    return max(sizes)


def test_the_chunked_output_layer_keeps_nothing_of_a_vocabulary_s_width_for_backward():
    """The point of `head`: from logits, the chunked pass still keeps the model's [N, vocab]
    logits alive (its chunks are views of them); from hidden states, autograd keeps the hidden
    states, the weight and per-token columns (bf16, as on a GPU)."""
    n, hidden, vocab, chunk = 64, 8, 50, 16
    h, w, ids, _ = _head_case(n, hidden, vocab, torch.bfloat16)
    assert _largest_saved_storage(h, w, ids, chunk, head=False) >= n * vocab
    assert _largest_saved_storage(h, w, ids, chunk, head=True) <= max(n * hidden, vocab * hidden)
    assert h.grad is not None and w.grad is not None and w.grad.abs().sum() > 0


def _divisions(temperature: float) -> tuple[int, torch.Tensor]:
    """The aten.div calls of a chunked pass (forward and backward) at `temperature`, and its log-probs."""
    from op_count import OpCount

    logits, ids, cu = _case(dtype=torch.bfloat16)
    with OpCount() as count:
        out = token_logprobs(logits, ids, cu, temperature, False, chunk=8)
        out.logp.sum().backward()
    return count.ops.get("div", 0), out.logp.detach()


def test_temperature_one_makes_no_pass_over_the_vocabulary_and_changes_no_bit():
    """T = 1 (the RL default) divides nothing: on an H200 the division of each chunk's float32
    logits took 14 ms of a 0.5B model's 400 ms step. The values are log_softmax(logits / 1)'s."""
    n_one, logp = _divisions(1.0)
    n_other, _ = _divisions(0.7)
    assert n_one == 0 and n_other > 0
    logits, ids, cu = _case(dtype=torch.bfloat16)
    want = torch.log_softmax(logits.detach().float() / 1.0, dim=-1)[:-1].gather(1, ids[1:, None])[:, 0]
    want = torch.cat([want.new_zeros(1), want]).index_fill(0, cu[:-1].long(), 0.0)
    torch.testing.assert_close(logp, want, rtol=0, atol=0)
