"""Shared material of the Megatron log-prob-from-hidden-states tests (trainer/megatron/logprob_head.py):
the new path and the rows path it replaced, run on the same backend, and a dispatch mode that
records the widest [rows, vocabulary] tensor any operation creates.

Why a dispatch mode: on a GPU the claim is about peak memory; on the CPU the honest equivalent
is that no operation of the log-prob step (forward or backward) ever makes a tensor of the
vocabulary's width with more than `chunk` rows — every tensor, not only what autograd keeps.
"""
from __future__ import annotations

import weakref

import megatron_case as mc
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tandem.trainer.backend import PackedBatch
from tandem.trainer.logprobs import token_logprobs

TEMPERATURE = 0.7
ENTROPY_COEF = 0.3


def batch(seed: int = 0) -> PackedBatch:
    """46 tokens in 3 sequences: a token count that is neither a vocabulary width nor hidden."""
    gen = torch.Generator().manual_seed(seed)
    return mc.packed([torch.randint(0, mc.VOCAB, (n,), generator=gen) for n in (20, 17, 9)], seed)


def vocab_widths(be) -> set[int]:
    """Every width a vocabulary-wide tensor of this backend can have: the true vocabulary, the
    padded one, a TP shard, and the shard's rows of the true vocabulary."""
    shard = be.padded_vocab // be.tp_size
    valid = max(0, min(shard, be.shape.vocab_size - be.tp_rank * shard))
    return {w for w in (be.shape.vocab_size, be.padded_vocab, shard, valid) if w > 0}


class WidestVocabRows(TorchDispatchMode):
    """Largest number of rows of any tensor created with a vocabulary width (`widths`) as one of
    its dimensions; tensors whose other dimensions make `hidden` (a weight, its gradient) are
    not rows."""

    def __init__(self, widths: set[int], hidden: int):
        super().__init__()
        self.widths, self.hidden, self.rows, self.shape = widths, hidden, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.is_floating_point():
                for w in self.widths & set(t.shape):
                    rest = t.numel() // w
                    if rest != self.hidden and rest > self.rows:
                        self.rows, self.shape = rest, tuple(t.shape)
        return out


class LiveBytesPeak(TorchDispatchMode):
    """Peak of the bytes of every storage an operation creates, alive at once: the CPU stand-in
    for `torch.cuda.max_memory_allocated` over a step. A storage counts from the operation that
    makes it until its last holder lets go, autograd's saved tensors included (the finalizer is
    on the storage, whose Python object lives as long as the storage does; a tensor's may not)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = storage._cdata, storage.nbytes()
                if key in self.live or size == 0:
                    continue
                self.live[key] = size
                self.now += size
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, key)
        return out


def run_path(be, mb: PackedBatch, rows_path: bool, hidden: torch.Tensor | None = None,
             entropy_grad: bool = True) -> dict:
    """One log-prob step with gradients: logp, entropy, and every parameter's gradient of
    loss = sum(adv * logp) + ENTROPY_COEF * sum(entropy). The new path (the backend's `_outputs`
    on its hidden states) or the rows path it replaced (the gathered logits, then token_logprobs
    a chunk of rows at a time). `hidden`: detached hidden states to start from (then only the
    log-prob step runs: its gradients reach the output weight, and `hidden.grad`). Without
    `entropy_grad` (the default training step's: no entropy bonus) the entropy is detached."""
    module = be._module()
    for p in module.parameters():
        p.grad = None
    be.entropy_grad = entropy_grad
    ids = mb.input_ids
    if rows_path:
        if hidden is None:
            logits = be._stage_forward(mb, logits=True)[0, :, : be.shape.vocab_size]
        else:   # the output layer as GPTModel applies it (gathered over TP)
            shared = module.share_embeddings_and_output_weights
            weight = module.shared_embedding_or_output_weight() if shared else None
            logits = module.output_layer(hidden, weight=weight)[0][:, 0, : be.shape.vocab_size]
        out = token_logprobs(logits, ids, mb.cu_seqlens, TEMPERATURE, True, entropy_grad, be.cfg.logprob_chunk)
    else:
        out = be._outputs(mb, be._stage_forward(mb) if hidden is None else hidden, TEMPERATURE, True)
    loss = (mb.fields["adv"].to(out.logp.device) * out.logp).sum() + ENTROPY_COEF * out.entropy.sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    for p in module.parameters():
        p.grad = None
    return {"logp": out.logp.detach().clone(), "entropy": out.entropy.detach().clone(), "grads": grads}


def widest_rows(be, mb: PackedBatch, rows_path: bool) -> tuple[int, tuple | None]:
    """(rows, shape) of the widest vocabulary tensor the log-prob step creates, forward and
    backward, from the backend's (detached) final hidden states."""
    with torch.no_grad():
        hidden = be._stage_forward(mb)
    hidden = hidden.detach().requires_grad_(True)
    mode = WidestVocabRows(vocab_widths(be), be.shape.hidden_size)
    with mode:
        run_path(be, mb, rows_path, hidden=hidden)
    return mode.rows, mode.shape


def compare(be, chunks=(8, 0)) -> dict:
    """Both paths at each chunk size, and the widest rows of each (what the tests assert on)."""
    mb = batch()
    res = {"n_tokens": mb.n_tokens, "tp_rank": be.tp_rank, "tp_size": be.tp_size,
           "padded_vocab": be.padded_vocab, "widths": sorted(vocab_widths(be))}
    if be.tp_size == 1:   # the hidden states are what GPTModel's output layer takes
        from tandem.trainer.megatron.logprob_head import output_weight
        with torch.no_grad():
            made = be._stage_forward(mb)[:, 0] @ output_weight(be._module()).T
            res["logits_from_hidden_err"] = float((made[:, : be.shape.vocab_size] - be._logits(mb)).abs().max())
        res["post_process_after"] = be._module().post_process
    for chunk in chunks:
        be.cfg.logprob_chunk = chunk
        res[chunk] = {"new": run_path(be, mb, False), "rows": run_path(be, mb, True),
                      "widest_new": widest_rows(be, mb, False), "widest_rows": widest_rows(be, mb, True)}
    return res


def assert_paths_equal(case: dict) -> None:
    """The new path against the rows path: values and gradients to float32 rounding. A gradient
    is a sum over tokens whose order differs (all-reduced hidden-state gradients against
    gathered logits split back), so its elements agree to a few float32 epsilons of the
    tensor's largest element (measured: under 1e-6 of it); a wrong reduction is off by O(1)."""
    new, rows = case["new"], case["rows"]
    torch.testing.assert_close(new["logp"], rows["logp"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new["entropy"], rows["entropy"], rtol=1e-5, atol=1e-5)
    assert sorted(new["grads"]) == sorted(rows["grads"])
    for name, g in rows["grads"].items():
        scale = float(g.abs().max())
        torch.testing.assert_close(new["grads"][name], g, rtol=1e-5, atol=1e-5 * scale + 1e-9, msg=name)
