"""The packed forward and backward never make the host wait for the GPU (issue 37), checked with
CUDA's own sync debug mode (`torch.cuda.set_sync_debug_mode("error")`): any synchronising call
raises with its traceback. The CPU tier's stand-in is tests/unit/trainer/test_host_reads.py (the
model on the meta device, where a host read fails); this is the same claim on the real device,
where a synchronising call the meta device cannot see (a stream synchronisation, a device-to-host
copy) would show too.

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
def test_the_packed_step_never_synchronises(tmp_path, case_model, backend):
    rec = run_worker(tmp_path / "syncs.pt", *CASES[backend], "--model", case_model, "--host-syncs", 1)
    assert rec["host_syncs"] is None, f"{backend} on {rec['device']}:\n{rec['host_syncs']}"
