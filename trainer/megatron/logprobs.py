"""Token log-probs from the logits a chunk of rows at a time (`trainer.megatron.logprob_chunk`).

Why: the float32 log-softmax over a 150K vocabulary is the largest activation of a long micro-
batch. Computed at once (`token_logprobs`), a micro-batch of N tokens holds the float32 copy of
its logits, the logits divided by the temperature, their log-softmax (kept for the backward
pass) and the entropy's temporaries: about 20 bytes per token per vocabulary entry, 100 GB for
N = 34,816 and Qwen2's 152K vocabulary, on top of the model's own logits. Here each chunk of
`chunk` rows is cast, divided, normalised and gathered inside `torch.utils.checkpoint`, so only
the gathered log-probs (and entropies) are kept, and the backward pass recomputes one chunk at a
time from the model's logits in their own dtype. Rows are independent, so the values are those
of `token_logprobs` on the same logits (a test checks log-probs and gradients).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.backend import TokenOutputs


def _rows(logits: torch.Tensor, targets: torch.Tensor, temperature: float, dt: torch.dtype,
          with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target | row) and the row's entropy (zeros when not asked) for a chunk of rows."""
    logp_all = F.log_softmax(logits.to(dt) / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    if entropy_grad:
        return logp, -(logp_all.exp() * logp_all).sum(-1)
    with torch.no_grad():
        return logp, -(logp_all.exp() * logp_all).sum(-1)


def chunked_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                           temperature: float, with_entropy: bool, entropy_grad: bool, chunk: int
                           ) -> TokenOutputs:
    """`trainer.torch_backend.token_logprobs` on `logits` [N, vocab] (any dtype), `chunk` rows at
    a time: position i holds log p(input_ids[i] | the tokens before it), 0 at every sequence start."""
    n = input_ids.numel()
    device = logits.device
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    ids = input_ids.to(device)
    # Row j predicts token j + 1; the last row predicts nothing (its target is a placeholder).
    targets = torch.cat([ids[1:], ids.new_zeros(1)]) if n else ids
    recompute = torch.is_grad_enabled() and logits.requires_grad
    logps, ents = [], []
    for part, tgt in zip(torch.split(logits, chunk), torch.split(targets, chunk), strict=True):
        if recompute:
            lp, ent = checkpoint(_rows, part, tgt, temperature, dt, with_entropy, entropy_grad,
                                 use_reentrant=False)
        else:
            lp, ent = _rows(part, tgt, temperature, dt, with_entropy, entropy_grad)
        logps.append(lp)
        ents.append(ent)
    zero = torch.zeros(1, dtype=dt, device=device)
    starts = cu_seqlens[:-1].long().to(device)
    starts = starts[starts < n]
    # Shift row j's prediction to position j + 1; a sequence start is nothing's prediction.
    logp = torch.cat([zero, *logps])[:n].index_fill(0, starts, 0.0)
    entropy = None
    if with_entropy:
        entropy = torch.cat([zero, *ents])[:n].index_fill(0, starts, 0.0)
        if not entropy_grad:
            entropy = entropy.detach()
    return TokenOutputs(logp=logp, entropy=entropy)
