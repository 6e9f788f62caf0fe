"""One backend in its own process: train a few steps on fixed micro-batches and record what the GPU
tier compares (log-probs, gradient norms), optionally saving, loading or exporting on the way.

Each configuration runs in a fresh process because Megatron's process groups and global state
are per process (a second backend in the same process would inherit the first's), and because
`CUDA_VISIBLE_DEVICES=""` is how a GPU checkpoint is loaded on the CPU path. Only the backends'
public interface is used (`TrainBackend`: forward_logprobs, train_step, state_dict /
save_checkpoint, export_hf).

    python tests/gpu/step_worker.py --backend megatron --dtype bfloat16 --model DIR --steps 2 --out R.pt \
        [--dist-opt 0|1] [--load CKPT --start-step 1] [--save-after 1 CKPT] [--export-after 1 DIR]
        [--lora-rank R] [--compute-dtype bfloat16 --recompute 1 --compile 1] [--host-syncs 1]

Step k (1-based, counting the `--start-step` steps a loaded checkpoint already trained) trains on
`micro_batches(seed=k)`, so a resumed run sees the batch the uninterrupted one saw; log-probs are always measured on the fixed
`micro_batches(seed=0)`, packed, and one sequence at a time (`per_seq`). The result file holds
{device, dtype, logp: [before, after step 1, ...], per_seq: [...], grad_norms: [...]}.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1] / "support")]

import megatron_case as mc  # noqa: E402

from tandem.trainer.backend import PackedBatch  # noqa: E402
from tandem.trainer.config import LoraConfig, OptimConfig, TrainerConfig  # noqa: E402
from tandem.trainer.megatron.config import MegatronConfig  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Adam's first steps move each weight by about lr: 1e-2 moves the policy far more than bf16's
# forward noise, and more than a bf16 weight's resolution (|w| ~ 0.15: 0.15 * 2**-8 = 6e-4).
LR = 1e-2
# No clipping (the comparison is of raw gradients), but a finite clip: Megatron computes the
# gradient norm only when clipping is on.
NO_CLIP = 1e6


def make_backend(backend: str, dtype: str, dist_opt: bool, model: Path, lora_rank: int = 0,
                 compute_dtype: str = "float32", recompute: bool = False, compile: bool = False):
    optim = OptimConfig(lr=LR, grad_clip=NO_CLIP, warmup_steps=1)
    if backend == "torch":
        from tandem.trainer.torch_backend import TorchBackend

        cfg = TrainerConfig(backend="torch", optim=optim, lora=LoraConfig(rank=lora_rank, sync="merged"),
                            compute_dtype=compute_dtype, recompute=recompute, compile=compile)
        return TorchBackend(cfg, model, seed=0, dtype=DTYPES[dtype])
    from tandem.trainer.megatron.backend import MegatronBackend

    mcfg = MegatronConfig(params_dtype=dtype, use_distributed_optimizer=dist_opt, recompute=recompute)
    return MegatronBackend(TrainerConfig(backend="megatron", optim=optim, compile=compile), model, seed=0, mcfg=mcfg)


def measure(be, mbs: list[PackedBatch]) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.cat([be.forward_logprobs(mb, 1.0).logp.float() for mb in mbs])
    per_seq = torch.cat([be.forward_logprobs(mc.one_sequence(mb, s), 1.0).logp.float()
                         for mb in mbs for s in range(mb.n_seqs)])
    return packed, per_seq


def host_syncs(be) -> dict:
    """{"forward": None if the packed forward (the log-probs and entropies from the last stage)
    and its backward ran with CUDA's sync debug mode at `error`, else the first synchronising
    call's error and traceback; "step": {micro-batches: synchronising calls} of whole training
    steps with the loop's loss (megatron_case.ppo_minibatch), counted in the mode's `warn`}.
    The forward's tokens and positions are put on the device first, its bounds left on the host
    where the packer makes them; one warm-up pass and step first (lazy initialisation may
    synchronise once). On the CPU (the rehearsal) the passes just run and count nothing."""
    import contextlib
    import traceback
    import warnings

    from tandem.trainer import objective_step

    mb = mc.micro_batches(seed=0)[0].on(be.device)

    def forward_backward():
        if hasattr(be, "_stage_forward"):   # Megatron
            out = be._outputs(mb, be._stage_forward(mb), 1.0, True)
        else:
            out = be._forward(mb, 1.0, True)
        (out.logp.float().sum() + out.entropy.float().sum()).backward()

    def step(n: int) -> int:
        mp = mc.ppo_minibatch(n)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            be.train_step(mp.micro_batches, objective_step.make_loss_fn(mc.PPO_SETTINGS, mp, 0, 1, 2), 1.0)
        return sum("synchroniz" in str(w.message) for w in seen)

    @contextlib.contextmanager
    def sync_debug(mode: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")

    forward_backward()
    step(2)
    found = None
    with sync_debug("error"):
        try:
            forward_backward()
        except RuntimeError:
            found = traceback.format_exc()[-4000:]
    with sync_debug("warn"):
        counts = {n: step(n) for n in (2, 4)}
    return {"forward": found, "step": counts}


def save(be, backend: str, ckpt: Path) -> None:
    if backend == "megatron":
        be.save_checkpoint(ckpt)
    else:
        ckpt.mkdir(parents=True, exist_ok=True)
        torch.save(be.state_dict(), ckpt / "state.pt")


def load(be, backend: str, ckpt: Path) -> None:
    if backend == "megatron":
        be.load_checkpoint(ckpt)
    else:
        be.load_state_dict(torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("torch", "megatron"), required=True)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    ap.add_argument("--dist-opt", type=int, default=1)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--start-step", type=int, default=0, help="steps already trained (a resumed run)")
    ap.add_argument("--load", type=Path)
    ap.add_argument("--save-after", nargs=2, metavar=("STEP", "DIR"))
    ap.add_argument("--export-after", nargs=2, metavar=("STEP", "DIR"))
    ap.add_argument("--lora-rank", type=int, default=0, help="torch backend: train LoRA adapters of this rank")
    ap.add_argument("--compute-dtype", choices=tuple(DTYPES), default="float32",
                    help="torch backend: trainer.compute_dtype (bfloat16: autocast over float32 weights)")
    ap.add_argument("--recompute", type=int, default=0,
                    help="trainer.recompute (torch backend), trainer.megatron.recompute (Megatron)")
    ap.add_argument("--host-syncs", type=int, default=0,
                    help="only count where the packed pass and the training step synchronise (host_syncs)")
    ap.add_argument("--compile", type=int, default=0, help="trainer.compile")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    # The fp32 reference must be fp32: no TF32 matrix products (10-bit mantissas) behind its back.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    be = make_backend(a.backend, a.dtype, bool(a.dist_opt), a.model, a.lora_rank, a.compute_dtype,
                      bool(a.recompute), bool(a.compile))
    if a.host_syncs:
        torch.save({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "host_syncs": host_syncs(be)}, a.out)
        be.close()
        return 0
    if a.load:
        load(be, a.backend, a.load)
    evals = mc.micro_batches(seed=0)
    logp, per_seq = measure(be, evals)
    rec = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "dtype": a.dtype,
           "logp": [logp], "per_seq": [per_seq], "grad_norms": [], "applied": []}
    last = a.start_step + a.steps
    for step in range(a.start_step + 1, last + 1):
        if a.export_after and int(a.export_after[0]) == step - 1:
            be.export_hf(Path(a.export_after[1]))
        if a.save_after and int(a.save_after[0]) == step - 1:
            save(be, a.backend, Path(a.save_after[1]))
        mbs = mc.micro_batches(seed=step)
        res = be.train_step(mbs, mc.make_loss_fn(mc.n_valid(mbs)), 1.0)
        rec["grad_norms"].append(res.grad_norm)
        rec["applied"].append(res.applied)
        logp, per_seq = measure(be, evals)
        rec["logp"].append(logp)
        rec["per_seq"].append(per_seq)
    if a.export_after and int(a.export_after[0]) == last:
        be.export_hf(Path(a.export_after[1]))
    if a.save_after and int(a.save_after[0]) == last:
        save(be, a.backend, Path(a.save_after[1]))
    rec["param_dtypes"] = sorted({str(p.dtype) for p in be.model.parameters()})
    torch.save(rec, a.out)
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
