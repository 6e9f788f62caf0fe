"""Running packed micro-batches through pipeline stages (GPipe order), with plain send/recv.

Megatron's own schedules (`get_forward_backward_func`) allocate their token counter with
`device="cuda"` in megatron-core 0.16.1, so they cannot run without a GPU. This schedule is
small enough to own and runs the same on gloo and nccl, so the pipeline path is tested here:

- forward: every micro-batch in order; a stage receives its input activation `[N, 1, hidden]`
  from the previous stage (N = the micro-batch's token count, known to every rank, so no shape
  exchange), runs its layers and sends its output to the next stage; the last stage turns its
  final hidden states into the micro-batch's result (and loss);
- backward (training): micro-batches in reverse; the last stage back-propagates its loss, the
  others the gradient received from the next stage, and each non-first stage sends its input's
  gradient back.

All activations of a minibatch stay alive until its backward (GPipe, not 1F1B): fine for the
few micro-batches of an RL minibatch; on large GPU jobs Megatron's 1F1B schedule would save
memory. With one stage there is no communication and each micro-batch is back-propagated
right after its forward (nothing is kept).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from tandem.services.protocol import collectives
from tandem.trainer.backend import PackedBatch

# stage_forward(mb) -> this stage's output hidden states (the last stage's after the final norm).
StageForward = Callable[[PackedBatch], torch.Tensor]
# on_last(mb, hidden) -> (loss or None, result kept for the caller).
OnLast = Callable[[PackedBatch, torch.Tensor], tuple[torch.Tensor | None, object]]


def run_micro_batches(module, mbs: list[PackedBatch], stage_forward: StageForward, on_last: OnLast,
                      *, forward_only: bool, hidden_size: int, dtype: torch.dtype,
                      device: torch.device) -> list:
    """Results of `on_last` per micro-batch (on the last stage; an empty list elsewhere)."""
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    prev = None if first else ps.get_pipeline_model_parallel_prev_rank()
    nxt = None if last else ps.get_pipeline_model_parallel_next_rank()
    results, kept = [], []
    grad_ctx = torch.no_grad() if forward_only else nullcontext()
    for mb in mbs:
        inp = None
        if not first:
            inp = torch.empty(mb.n_tokens, 1, hidden_size, dtype=dtype, device=device)
            collectives.recv(inp, src=prev)
            inp.requires_grad_(not forward_only)
            module.set_input_tensor(inp)
        with grad_ctx:
            out = stage_forward(mb)
            if not last:
                collectives.send(out.detach(), dst=nxt)
                kept.append((inp, out))
                continue
            loss, res = on_last(mb, out)
        results.append(res)
        if forward_only:
            continue
        if first:  # a single stage: back-propagate now, keep nothing
            loss.backward()
        else:
            kept.append((inp, loss))
    if forward_only:
        return results
    for inp, out in reversed(kept):
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            collectives.recv(grad, src=nxt)
            torch.autograd.backward(out, grad)
        if not first:
            collectives.send(inp.grad, dst=prev)
    return results
