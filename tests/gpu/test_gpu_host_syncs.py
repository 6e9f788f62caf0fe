"""The packed forward and backward never make the host wait for the GPU, and a training step waits
for it as often with four micro-batches as with two (issue 37), checked with CUDA's own sync
debug mode (`torch.cuda.set_sync_debug_mode`: at `error` any synchronising call raises with its
traceback; at `warn` each one warns, and the step's warnings are counted). The CPU tier's
stand-in is tests/unit/trainer/test_host_reads.py (the model on the meta device, where a host
read fails); this is the same claim on the real device, where a synchronising call the meta
device cannot see (a stream synchronisation before a copy from pageable memory) shows too.

Both backends as runs train them on a GPU: bf16 (autocast over float32 weights for the torch
backend; bf16 parameters for Megatron's) with activation recompute, so the recomputed forward is
checked as well. Each in its own process (step_worker.py --host-syncs 1).
"""
from __future__ import annotations

import pytest
from workers import run_worker

pytestmark = pytest.mark.timeout(600)

CASES = {
    "torch": ("--backend", "torch", "--dtype", "float32", "--compute-dtype", "bfloat16", "--recompute", 1),
    "megatron": ("--backend", "megatron", "--dtype", "bfloat16", "--recompute", 1),
}


@pytest.mark.parametrize("backend", sorted(CASES))
def test_the_packed_pass_never_synchronises_and_a_step_not_per_micro_batch(tmp_path, case_model, backend):
    rec = run_worker(tmp_path / "syncs.pt", *CASES[backend], "--model", case_model, "--host-syncs", 1)
    syncs = rec["host_syncs"]
    assert syncs["forward"] is None, f"{backend} on {rec['device']}:\n{syncs['forward']}"
    assert syncs["step"][4] == syncs["step"][2], (backend, rec["device"], syncs["step"])
