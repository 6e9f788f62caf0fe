"""Everything Megatron-core needs to run on a machine without a GPU, in one place.

megatron-core 0.16.1 runs on CPU with the local (non-TransformerEngine) layer spec, except for
a few places that assume CUDA. `apply()` fixes them and is called only when
`torch.cuda.is_available()` is false; on GPUs nothing here is touched. The accommodations:

1. `torch.cuda.current_device()` is used to place buffers (the attention matmul workspace in
   `parallel_state`'s global memory buffer, rotary `inv_freq`, p2p buffers). Without CUDA it
   raises, so it is made to return "cpu", which every `device=` argument accepts. Nothing else
   can depend on it on such a machine: it could only ever raise there.
2. `torch.cuda.synchronize()` is called by `dist_checkpointing`'s writer before copying
   tensors; without CUDA there is nothing to wait for, so it becomes a no-op.
3. The model-parallel RNG tracker (`tensor_parallel.get_cuda_rng_tracker()`) stores and forks
   CUDA generator states. It is replaced by a tracker with the same interface and seeding scheme
   that forks the CPU generator, so `model_parallel_cuda_manual_seed` and dropout forks work.
4. With pipeline parallelism and tied embeddings, GPTModel's constructor moves the last
   stage's copy of the embedding to CUDA (`weight.data.cuda()`) before an all-reduce;
   `model_construction()` makes `Tensor.cuda` return the tensor itself for the duration of the
   constructor only (the weights are loaded from the checkpoint afterwards anyway).
5. Activation recompute (`trainer.megatron.recompute`): Megatron's `CheckpointFunction` saves
   and restores the CUDA generator's state around the recomputed forward; without CUDA there is
   none, so those two calls save nothing and restore nothing (the CPU generator and the tracker
   above are still saved and restored by Megatron itself).
6. Mixture-of-experts models: megatron-core's all-to-all token dispatcher
   (`MoEAlltoAllTokenDispatcher`) creates a CUDA stream for its device-to-host copies of the
   split sizes and waits on an event of it (`_maybe_dtoh_and_synchronize`). Without CUDA the
   counts are already on the host: the stream is never made, and the copy step only turns the
   split sizes into numpy arrays, as the GPU path's copy does (`as_numpy=True`), so
   `all_to_all_single` gets the same kind of sizes on both paths.
7. Not patched but required of callers (see `packing.py` and `backend.py`): pack sequences in
   THD format with no mask (the default causal mask is built on CUDA), use torch AdamW
   (Megatron's DDP and optimizer allocate CUDA buffers), and do not use Megatron's pipeline
   schedules (they allocate a `device="cuda"` counter; see pipeline.py).
"""
from __future__ import annotations

import contextlib

import torch

_applied = False


def needed() -> bool:
    """True when there is no usable GPU, i.e. when `apply()` must be called."""
    return not torch.cuda.is_available()


def apply() -> None:
    """Install the CPU accommodations (idempotent). Call before building any Megatron module."""
    global _applied
    if _applied:
        return
    if not needed():
        raise RuntimeError("cpu_compat.apply() called on a machine with a GPU; the GPU path "
                           "must run unpatched Megatron")
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _nothing_to_wait_for
    _install_cpu_rng_tracker()
    _no_cuda_rng_state_in_recompute()
    _host_split_sizes_in_moe_dispatch()
    _applied = True


@contextlib.contextmanager
def model_construction():
    """Scope in which `Tensor.cuda()` is the identity (CPU only; see point 4 above)."""
    if not _applied:
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = _stay_on_cpu
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _stay_on_cpu(self, *args, **kwargs):
    return self


def _cpu_current_device() -> str:
    return "cpu"


def _nothing_to_wait_for(device=None) -> None:
    return None


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's RNG tracker with CPU generator states instead of CUDA ones."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _no_cuda_rng_state_in_recompute() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def _host_split_sizes_in_moe_dispatch() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def on_host(t, as_numpy: bool = False):
        return t.numpy() if as_numpy and torch.is_tensor(t) else t

    def dtoh_on_host(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            self.input_splits = on_host(self.input_splits, as_numpy=True)
            self.output_splits = on_host(self.output_splits, as_numpy=True)
            self.output_splits_tp = on_host(self.output_splits_tp, as_numpy=True)
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "host"   # any non-None: no CUDA stream is made
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = dtoh_on_host
