"""The GPU path's optimizers and their checkpoint state, run for real on CPU (issue 31).

On an H200 (bf16, local layer spec: no TransformerEngine) the first Megatron checkpoint failed
with both optimizers: "Optimizer shape (128,) does not match model shape (256,)" in
`make_sharded_optimizer_tensor` (use_distributed_optimizer: false) and "size of tensor a (256)
must match b (128)" in `get_parameter_state_dp_zero` (true). The cause, read from the installed
megatron-core 0.16.1: the local spec builds its norms with `torch.nn.RMSNorm`, in float32
whatever `params_dtype` says, and both optimizers assume every parameter is in `params_dtype`
(trainer/megatron/model.py `cast_parameters` says how each one mis-numbers a mix).

Here the bf16 model of the GPU path is built on CPU with the backend's own code and handed to
the backend's own `gpu.wrap_model_and_optimizer`, i.e. Megatron's real `DistributedDataParallel`
and `get_megatron_optimizer` (Float16OptimizerWithFloat16Params or DistributedOptimizer). Their
constructors and `sharded_state_dict` run unchanged except for two things a CPU cannot provide,
replaced while they run (`cuda_on_cpu`, the only stand-in here): CUDA type names
(`param.type()` reports 'torch.cuda.BFloat16Tensor' for a CPU bf16 tensor) and CUDA placement
(`device='cuda'` and `.cuda()` stay on the CPU). With the old mixed dtypes both tests below fail
with the hidden-64 twins of the GPU run's errors ("(64,) does not match model shape (128,)",
"size of tensor a (128) must match ... b (64)"); with the fix every optimizer tensor lands on
the parameter it belongs to. Writing the checkpoint (dist_checkpointing's writer processes)
is not done here: it is the same for both, and the GPU tier saves and loads for real.
"""
from __future__ import annotations

from contextlib import contextmanager

import megatron_case as mc
import pytest
import torch
from torch.overrides import TorchFunctionMode

from trainer.config import OptimConfig
from trainer.megatron import cpu_compat, gpu
from trainer.megatron.config import MegatronConfig
from trainer.megatron.model import build_gpt_model, layer_spec, qwen2_shape, transformer_config

pytestmark = pytest.mark.timeout(240)


class _CudaPlacementOnCpu(TorchFunctionMode):
    """`device='cuda'` arguments and `.cuda()` calls stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextmanager
def cuda_on_cpu():
    """Megatron's optimizers on CPU tensors: CUDA type names and placement, for the duration."""
    real_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        if args or kwargs or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type
    try:
        with _CudaPlacementOnCpu():
            yield
    finally:
        torch.Tensor.type = real_type


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """The in-process TP=1 backend: it sets up the process group, Megatron's parallel state and
    the CPU accommodations (cpu_compat)."""
    yield from mc.in_process_backend(mc.make_model_dir(tmp_path_factory.mktemp("qwen2")))


def _bf16_model(backend):
    """The GPU path's model (bf16 params, local spec as on a GPU without TE), built on CPU."""
    shape = qwen2_shape(backend.model_dir)
    config = transformer_config(shape, torch.bfloat16, on_gpu=False)
    with cpu_compat.model_construction():
        model = build_gpt_model(shape, config, layer_spec(on_gpu=False), backend.padded_vocab)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():   # weights are loaded, never initialised, by the backend: fill them
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model, config


@pytest.fixture(scope="module", params=[False, True], ids=["float16-optimizer", "distributed-optimizer"])
def trained(backend, request):
    """(GPTModel, MegatronOptimizer) after one real step, the Adam moments then set to name their
    parameter: exp_avg = its fp32 main value, exp_avg_sq = that squared."""
    model, config = _bf16_model(backend)
    mcfg = MegatronConfig(use_distributed_optimizer=request.param)
    with cuda_on_cpu():
        ddp, opt = gpu.wrap_model_and_optimizer(model, config, mcfg, OptimConfig(grad_clip=1.0), torch.bfloat16)
        gen = torch.Generator().manual_seed(1)
        for p in ddp.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        applied, _ = gpu.step(ddp, opt, lr=1e-3)
    assert applied
    for inner in (o.optimizer for o in opt.chained_optimizers):
        for group in inner.param_groups:
            for main in group["params"]:
                inner.state[main]["exp_avg"].copy_(main)
                inner.state[main]["exp_avg_sq"].copy_(main.square())
    return model, opt


def test_every_parameter_is_in_params_dtype(backend):
    model, _ = _bf16_model(backend)
    odd = {n: p.dtype for n, p in model.named_parameters() if p.dtype != torch.bfloat16}
    assert not odd, f"parameters outside params_dtype (the optimizers mis-number them): {odd}"


def _place(key: str, t) -> tuple:
    """Where a sharded tensor sits in the checkpoint: key and offset (layers share a key,
    stacked along a leading axis); a factory (the fused gate/up weight) by its build function,
    which the optimizer's copy shares."""
    return key, (t.global_offset if hasattr(t, "global_offset") else id(t.build_fn))


def test_optimizer_checkpoint_state_lands_on_its_own_parameter(trained):
    """The state the checkpoint is written from (`gpu.optimizer_sharded_state`, the call that
    failed on the H200): each main weight and Adam moment sits under its own parameter's key."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    model, opt = trained
    model_sd = model.sharded_state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    param_at = {_place(t.key, t): names[id(t.data)] for t in nested_values(model_sd)
                if id(getattr(t, "data", None)) in names}
    with cuda_on_cpu():
        sd = gpu.optimizer_sharded_state(opt, model_sd, is_loading=False)
    mains = gpu.main_params(model, opt)
    assert mains.keys() == set(names.values())
    seen = set()
    for t in nested_values(sd):
        if not getattr(t, "key", "").startswith("optimizer.state."):
            continue
        kind, model_key = t.key.removeprefix("optimizer.state.").split(".", 1)
        name = param_at[_place(model_key, t)]
        want = mains[name].square() if kind == "exp_avg_sq" else mains[name]
        assert torch.equal(t.data.reshape(want.shape), want), (kind, name)
        seen.add((kind.replace("fp32_param", "param"), name))
    assert seen == {(k, n) for k in ("param", "exp_avg", "exp_avg_sq") for n in names.values()}


def test_main_weights_hold_the_checkpoint_exactly_and_are_what_export_reads(trained):
    """Export semantics with bf16 parameters: the backend loads the checkpoint's fp32 values into
    the optimizer's fp32 main copies (`gpu.load_main_params`) and exports those copies
    (`gpu.main_params`, read by `MegatronBackend.full_megatron_state`), so version 0 is the
    source checkpoint bit for bit, which the bf16 parameters alone cannot give."""
    model, opt = trained
    gen = torch.Generator().manual_seed(2)
    fp32 = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(fp32[n])            # what loading into the parameters alone keeps: a rounding
    assert not any(torch.equal(p.float(), fp32[n]) for n, p in model.named_parameters())
    assert gpu.load_main_params(model, opt, fp32) == len(fp32)
    exported = gpu.main_params(model, opt)
    assert exported.keys() == fp32.keys()
    for n, t in exported.items():
        assert t.dtype == torch.float32 and torch.equal(t, fp32[n]), n
