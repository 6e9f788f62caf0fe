"""The multi-rank training loop under NCCL's device rule, on CPUs (issue 31).

NCCL refuses CPU tensors and gloo accepts them, so the trainer's first GPU run died at step 1
(`_reduce_stats` all-reduced its CPU statistics) although every CPU test passed. Here two real
`tandem trainer` ranks run over gloo with `TANDEM_EMULATE_NCCL=1`: every collective the
project's code calls with a CPU tensor that `services.protocol.collectives` did not place on the
group's device raises "NCCL would refuse ..." (services/protocol/nccl_guard.py), as the GPU run
did. One training step, its checkpoint and its weight export run on both backends: the torch
backend with two data-parallel ranks, and the Megatron backend with two pipeline stages (the
layout with the most collectives of its own: send/recv of activations, the broadcast of
log-probs, the tied embedding's gradient sum, the gradient norm, the export's object gather).

Checked to fail: with `_reduce_stats` restored to its old `dist.all_reduce(sums)` the torch run
exits with "NCCL would refuse this: torch.distributed.all_reduce got a CPU tensor (14,) torch.float64".
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from rank_processes import rank_errors, reap, start_ranks
from test_trainer_loop import SPECS, FakeController, groups, make_exp
from trainer_feed import send

from tandem.services.protocol import read_metrics

pytestmark = pytest.mark.timeout(300)
EMULATE = {"TANDEM_EMULATE_NCCL": "1", "OMP_NUM_THREADS": "1"}


def test_the_guard_refuses_a_cpu_tensor_that_collectives_did_not_place(python_bin):
    """The guard can fail: a direct all_reduce from a project module is refused, the same
    tensor through `collectives` is not (one gloo rank in a fresh process)."""
    probe = textwrap.dedent("""
        import torch, torch.distributed as dist
        from tandem.services.protocol import collectives
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        t = torch.ones(3)
        assert collectives.all_reduce(t) is t and t.tolist() == [1.0, 1.0, 1.0]
        scope = {"__name__": "tandem.trainer.probe", "dist": dist, "t": t}
        try:
            exec("dist.all_reduce(t)", scope)
        except RuntimeError as e:
            print(e)
        else:
            raise SystemExit("not refused")
        dist.destroy_process_group()
    """)
    out = subprocess.run([python_bin, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **EMULATE})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NCCL would refuse this: torch.distributed.all_reduce got a CPU tensor (3,)" in out.stdout


@pytest.mark.parametrize("backend", ["torch", "megatron-pp2"])
def test_two_ranks_train_a_step_under_nccls_device_rule(tmp_path, small_model_dir, traj, python_bin, backend):
    overrides = {"trainer.total_steps": 1}
    if backend == "megatron-pp2":
        overrides |= {"trainer.backend": "megatron", "trainer.pipeline_parallel": 2}
    exp = make_exp(tmp_path, "nccl", small_model_dir, **overrides)
    ctl = FakeController(exp, python_bin)
    procs = []
    try:
        procs, logs = start_ranks(["-m", "tandem.launcher.cli", "trainer", "--exp", str(exp.root)], tmp_path, "trainer",
                                  env=EMULATE)
        send(exp, groups(traj, SPECS[:2]))
        errors = rank_errors(procs, logs)
    finally:
        reap(procs)
        ctl.close()
    assert not errors, "\n----\n".join(errors)
    (rec,) = read_metrics(exp, "trainer", "step")
    assert rec["train_world_size"] == 2 and rec["valid_tokens"] > 0
    assert (exp.checkpoints / "step-1").is_dir() and (exp.weights / "v1" / "model.safetensors").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
