"""Token log-probs and entropies from the last pipeline stage's hidden states, the output layer
applied a chunk of tokens at a time: the Megatron backend never holds [tokens, vocab] logits.

Why (issue 37): taking Megatron's logits whole and chunking only their float32 log-softmax (the
`rows` mode of trainer/logprobs.py) still keeps the model's gathered [N, vocab] logits and their
gradient alive; at a 32K-token pack and Qwen2.5's 152K vocabulary that is most of the log-prob
step's peak (benchmarks/results/logprob_memory.json: `rows` against `head`). Here the final
hidden states [N, hidden] (after the final norm: gpu.forward_thd_hidden) and the output layer's
weight go in instead, and each chunk makes its own logits inside `torch.utils.checkpoint`, so
nothing of a vocabulary's width outlives its chunk, in the forward or the backward pass.

- TP = 1: the weight [padded vocab, hidden] cut to the true vocabulary (Megatron pads it,
  model.padded_vocab_size) through token_logprobs' `head` mode, as the torch backend does.
- TP > 1: Megatron's output layer is a ColumnParallelLinear, its weight sharded along the
  vocabulary (rank r holds rows [r * V/tp, (r + 1) * V/tp) of the padded vocabulary:
  VocabUtility's split). Each rank makes the [c, V/tp] logits of its shard and the log-softmax
  is vocabulary-parallel: the maximum all-reduced (MAX, no gradient: the result does not depend
  on it), the sum of exponentials, the target's logit (from the rank that holds it) and the
  entropy's sum of p * (logit - max) all-reduced with Megatron's
  `reduce_from_tensor_model_parallel_region` (forward all-reduce, backward identity). The
  hidden states enter through `copy_to_tensor_model_parallel_region` (forward identity,
  backward all-reduce), exactly as ColumnParallelLinear's input does, so the hidden states'
  gradient is the sum of every shard's part and each rank's weight gradient is its shard's.
  The backward identity is right because everything computed after a reduction is the same
  on every rank (log Z, the log-prob, the entropy, the loss), so every rank's gradient of the
  reduced value is the same number. Padding rows of the vocabulary (global index >= the true
  vocabulary) are cut off each rank's shard before the product: they are in no softmax.

Megatron's own `vocab_parallel_cross_entropy` is not used: it takes the padded columns into
its softmax (their logits are 0, not -inf: the values would differ from the torch backend's
and from transformers'), has no entropy, and takes logits, which a chunk would have to make
anyway. Its vocabulary split (`VocabUtility`) and autograd mappings are used as they are.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.services.protocol import collectives
from tandem.trainer.backend import TokenOutputs
from tandem.trainer.logprobs import scaled, token_logprobs

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


def output_weight(model: GPTModel) -> torch.Tensor:
    """The weight GPTModel's output layer multiplies by (this rank's vocabulary shard, padded
    rows included): the embedding's when input and output embeddings are tied (on the last
    stage of a pipeline, the copy Megatron keeps in sync), else the output layer's own."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def hidden_logprobs(model: GPTModel, hidden: torch.Tensor, input_ids: torch.Tensor,
                    cu_seqlens: torch.Tensor, temperature: float, with_entropy: bool,
                    entropy_grad: bool, chunk: int, vocab_size: int, chunk_fn=None) -> TokenOutputs:
    """token_logprobs of the logits `hidden @ W.T` (W: `model`'s output weight, all TP shards),
    over the true vocabulary (`vocab_size`), `chunk` tokens at a time (0: in one piece).

    `hidden`: the last stage's final hidden states [N, hidden] (or [N, 1, hidden], as Megatron
    returns them), the same on every TP rank (no sequence parallelism). `chunk_fn`: with one TP
    rank, what makes a chunk's log-probs (trainer.compile's compiled one; default: token_logprobs')."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.utils import VocabUtility

    if model.config.sequence_parallel:
        raise NotImplementedError("log-probs from hidden states assume no sequence parallelism "
                                  "(each TP rank holds every token's hidden state)")
    rows = hidden.reshape(hidden.shape[0], -1) if hidden.dim() == 3 else hidden
    weight = output_weight(model)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return token_logprobs(rows, input_ids, cu_seqlens, temperature, with_entropy, entropy_grad,
                              chunk, head=_first_rows(weight, vocab_size), chunk_fn=chunk_fn)
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        weight.shape[0], ps.get_tensor_model_parallel_rank(), tp)
    valid = max(0, min(end, vocab_size) - start)   # this shard's rows of the true vocabulary
    fn = functools.partial(vocab_parallel_rows, start=start, group=ps.get_tensor_model_parallel_group())
    return token_logprobs(rows, input_ids, cu_seqlens, temperature, with_entropy, entropy_grad,
                          chunk, head=_first_rows(weight, valid), chunk_fn=fn)


def _first_rows(weight: torch.Tensor, n: int) -> torch.Tensor:
    """weight[:n], or the weight itself where that is all of it: a slice's backward makes a
    zero-filled weight-sized gradient to copy into (one more [vocab, hidden] tensor)."""
    return weight if n >= weight.shape[0] else weight[:n]


def vocab_parallel_rows(rows: torch.Tensor, targets: torch.Tensor, temperature: float,
                        dt: torch.dtype, with_entropy: bool, entropy_grad: bool, head: torch.Tensor,
                        *, start: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's (log p(target), entropy) from hidden states `rows` [c, hidden] and this rank's
    shard `head` [v, hidden] of the output weight (global vocabulary rows start .. start + v;
    v may be 0 where a shard is all padding). Collective over `group`; the signature of
    trainer/logprobs.py's `_rows`, which token_logprobs chunks and checkpoints."""
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    c, v = rows.shape[0], head.shape[0]
    x = scaled(F.linear(copy_to_tensor_model_parallel_region(rows, group), head).to(dt), temperature)
    with torch.no_grad():   # log Z = m + log sum exp(x - m) for any m: no gradient through m
        m = x.amax(-1) if v else x.new_full((c,), float("-inf"))
        collectives.all_reduce(m, op=collectives.ReduceOp.MAX, group=group)
    shifted = x - m[:, None]
    e = shifted.exp()
    local = targets - start
    mine = (local >= 0) & (local < v)
    if v:
        picked = shifted.gather(-1, local.clamp(0, v - 1)[:, None]).squeeze(-1)
        picked = torch.where(mine, picked, torch.zeros_like(picked))
    else:
        picked = shifted.new_zeros(c)
    # sum of exponentials and the target's shifted logit (0 on ranks that do not hold it): one
    # all-reduce of both
    sum_exp, target = reduce_from_tensor_model_parallel_region(torch.stack([e.sum(-1), picked], -1),
                                                               group).unbind(-1)
    log_z = sum_exp.log()          # of the shifted logits
    logp = target - log_z
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # H = log Z - E_p[x - m] = log sum_exp - (sum over shards of exp(x - m) * (x - m)) / sum_exp
        weighted = reduce_from_tensor_model_parallel_region((e * shifted).sum(-1), group)
        return logp, log_z - weighted / sum_exp
