"""Token log-probs and entropies from a packed micro-batch's logits, a chunk of rows at a time.

One function for both backends (`trainer.logprob_chunk`, default 1024 tokens).

Why chunks: the float32 log-softmax over a 150K vocabulary is the largest activation of a long
micro-batch. Taken over the whole micro-batch at once, N tokens hold the float32 copy of their
logits, the logits divided by the temperature, their log-softmax (kept for the backward pass)
and the entropy's temporaries: about 20 bytes per token per vocabulary entry, 100 GB for
N = 34,816 and Qwen2's 152K vocabulary, on top of the model's own logits (verl and slime chunk
for the same reason). Here each chunk of rows is cast, divided, normalised and gathered inside
`torch.utils.checkpoint`, so only the gathered log-probs (and entropies) are kept, and the
backward pass recomputes one chunk at a time from the logits in their own dtype. Rows are
independent, so the values are those of the whole pass on the same logits, bit for bit
(tests/unit/trainer/test_logprobs.py checks values, gradients and what autograd keeps).

The output layer, chunked too (`head`): a chunked pass from logits still keeps the model's own
logits and their gradient whole, [N, vocab] in bf16 twice, which at a 32K-token pack and a 152K
vocabulary is 20 GB. Given the hidden states [N, hidden] and the output layer's weight
[vocab, hidden] instead, each chunk makes its own logits inside the checkpoint, so nothing of a
vocabulary's width outlives its chunk: autograd keeps the hidden states (the model keeps them
anyway) and the weight, and the backward pass adds each chunk's share to both gradients.

Layout: logits row j predicts input_ids[j + 1]; the result at position i is that prediction for
i, 0 at the first position of every sequence (nothing predicts it: the row before a sequence
start belongs to the previous sequence).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tandem.trainer.backend import TokenOutputs, to_device


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T, without a pass over [rows, vocab] (and a float32 copy of it) when T is 1, the
    RL default: dividing by 1 changes no bit. On an H200 the division took 14 ms of a 0.5B
    model's 400 ms train step at 8K tokens (benchmarks/results/gpu_speed.json's profiles)."""
    return logits if temperature == 1.0 else logits / temperature


def _rows(rows: torch.Tensor, targets: torch.Tensor, temperature: float, dt: torch.dtype,
          with_entropy: bool, entropy_grad: bool, head: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target | row) and the row's entropy (zeros when not asked) for a chunk of rows
    (logits, or hidden states that `head` turns into logits)."""
    logits = rows if head is None else F.linear(rows, head)
    logp_all = F.log_softmax(scaled(logits.to(dt), temperature), dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, -(logp_all.exp() * logp_all).sum(-1)


def token_logprobs(rows: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                   temperature: float, with_entropy: bool, entropy_grad: bool = False,
                   chunk: int = 0, head: torch.Tensor | None = None, chunk_fn=None) -> TokenOutputs:
    """log_softmax(logits / T) of each next token, shifted to the token's own position.

    `rows`: the logits [N, vocab] in any dtype (float32 math, float64 kept), or with `head` (the
    output layer's weight, [vocab, hidden], no bias) the hidden states [N, hidden] that make them.
    `chunk` rows at a time, each recomputed in the backward pass (0: the whole micro-batch in one
    piece, nothing recomputed). The entropy is detached unless `entropy_grad` (an entropy bonus).
    `chunk_fn`: what turns one chunk into (log-probs, entropies), `_rows`'s signature; the
    Megatron backend's vocabulary-parallel output layer passes its own
    (trainer/megatron/logprob_head.py), and shares the chunking and the shift here."""
    n = input_ids.numel()
    device = rows.device
    dt = torch.float64 if rows.dtype == torch.float64 else torch.float32
    ids = input_ids.to(device)
    targets = torch.cat([ids[1:], ids.new_zeros(1)]) if n else ids   # the last row predicts nothing
    needs_grad = rows.requires_grad or (head is not None and head.requires_grad)
    recompute = chunk > 0 and torch.is_grad_enabled() and needs_grad
    fn = chunk_fn if chunk_fn is not None else _rows
    logps, ents = [], []
    for part, tgt in zip(torch.split(rows, chunk if chunk > 0 else max(n, 1)),
                         torch.split(targets, chunk if chunk > 0 else max(n, 1)), strict=True):
        if recompute:
            lp, ent = checkpoint(fn, part, tgt, temperature, dt, with_entropy, entropy_grad, head,
                                 use_reentrant=False)
        else:
            lp, ent = fn(part, tgt, temperature, dt, with_entropy, entropy_grad, head)
        logps.append(lp)
        ents.append(ent)
    zero = torch.zeros(1, dtype=dt, device=device)
    # Filtered where the bounds are (the host, from the packer): a boolean index of a device
    # tensor has a size only the device knows, so the host would wait for it.
    starts = cu_seqlens[:-1].long()
    starts = to_device(starts[starts < n], device)
    # Shift row j's prediction to position j + 1; a sequence start is nothing's prediction.
    logp = torch.cat([zero, *logps])[:n].index_fill(0, starts, 0.0)
    entropy = None
    if with_entropy:
        entropy = torch.cat([zero, *ents])[:n].index_fill(0, starts, 0.0)
        if not entropy_grad:
            entropy = entropy.detach()
    return TokenOutputs(logp=logp, entropy=entropy)
