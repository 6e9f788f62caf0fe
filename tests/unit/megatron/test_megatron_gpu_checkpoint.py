"""The GPU path's optimizer checkpoint, reproduced on CPU (issue 31).

On an H200 (bf16, local layer spec: no TransformerEngine) the first Megatron checkpoint failed
with both optimizers: "Optimizer shape (128,) does not match model shape (256,)" in
`make_sharded_optimizer_tensor` (use_distributed_optimizer: false) and "size of tensor a (256)
must match b (128)" in `get_parameter_state_dp_zero` (true). The cause, read from the installed
megatron-core 0.16.1: the local spec builds its norms with `torch.nn.RMSNorm`, in float32
whatever `params_dtype` says, and both optimizers assume every parameter is in `params_dtype`
(trainer/megatron/model.py `cast_parameters` says how each one mis-numbers a mix).

Megatron's optimizers cannot be constructed here: their constructors accept only CUDA tensors
(`param.type() == 'torch.cuda.BFloat16Tensor'`). So the test builds the bf16 model of the GPU
path on CPU with the backend's own `build_gpt_model`, groups its parameters with Megatron's real
`_get_param_groups` and the backend's real `OptimizerConfig`, performs the one CUDA-only step of
`Float16OptimizerWithFloat16Params.__init__` (the split into float16 and fp32 params, by dtype
instead of by CUDA type name) and then calls that class's real `sharded_state_dict`, which is
the mapping that failed. Before the fix it fails with the GPU run's error; after it, every
optimizer tensor lands on the parameter it belongs to.
"""
from __future__ import annotations

import megatron_case as mc
import pytest
import torch

from trainer.config import OptimConfig
from trainer.megatron import cpu_compat, gpu
from trainer.megatron.config import MegatronConfig
from trainer.megatron.model import build_gpt_model, layer_spec, qwen2_shape, transformer_config

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """The in-process TP=1 backend: it sets up the process group and Megatron's parallel state."""
    yield from mc.in_process_backend(mc.make_model_dir(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="module")
def bf16_model(backend):
    """The GPU path's model (bf16 params, local spec as on a GPU without TE), built on CPU."""
    shape = qwen2_shape(backend.model_dir)
    config = transformer_config(shape, torch.bfloat16, on_gpu=False)
    with cpu_compat.model_construction():
        model = build_gpt_model(shape, config, layer_spec(on_gpu=False), backend.padded_vocab)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():   # weights are loaded, never initialised, by the backend: fill them
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def test_every_parameter_is_in_params_dtype(bf16_model):
    odd = {n: p.dtype for n, p in bf16_model.named_parameters() if p.dtype != torch.bfloat16}
    assert not odd, f"parameters outside params_dtype (the optimizers mis-number them): {odd}"


def _float16_optimizer(inner: torch.optim.Optimizer, config):
    """A `Float16OptimizerWithFloat16Params` whose constructor's grouping is done here, as the
    0.16.1 constructor does it but testing the dtype instead of the CUDA type name (the one thing
    a CPU cannot provide); every method called afterwards is the real one."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    opt = object.__new__(Float16OptimizerWithFloat16Params)
    opt.optimizer, opt.config, opt.grad_scaler, opt.init_state_fn = inner, config, None, None
    opt.float16_groups, opt.fp32_from_float16_groups, opt.fp32_from_fp32_groups = [], [], []
    for group in inner.param_groups:
        f16, main16, f32 = [], [], []
        for i, p in enumerate(group["params"]):
            if p.dtype in (torch.float16, torch.bfloat16):
                main = p.detach().clone().float()
                group["params"][i] = main
                p.main_param = main
                f16.append(p)
                main16.append(main)
            else:
                f32.append(p)
        opt.float16_groups.append(f16)
        opt.fp32_from_float16_groups.append(main16)
        opt.fp32_from_fp32_groups.append(f32)
    return opt


def _place(key: str, t) -> tuple:
    """Where a sharded tensor sits in the checkpoint: key and offset (layers share a key,
    stacked along a leading axis); a factory (the fused gate/up weight) by its build function,
    which the optimizer's copy shares."""
    return key, (t.global_offset if hasattr(t, "global_offset") else id(t.build_fn))


def test_float16_optimizer_state_lands_on_its_own_parameter(bf16_model):
    from megatron.core.optimizer import _get_param_groups

    cfg = gpu.optimizer_config(OptimConfig(), MegatronConfig(use_distributed_optimizer=False), torch.bfloat16)
    groups = _get_param_groups([bf16_model], cfg, None)
    assert len(groups) == 2   # weight decay / none (biases and norms): the split that mis-numbered
    inner = torch.optim.AdamW(groups, lr=cfg.lr)
    opt = _float16_optimizer(inner, cfg)
    # Adam state that names its parameter: exp_avg = the parameter's values, exp_avg_sq = their square.
    for group in inner.param_groups:
        for main in group["params"]:
            inner.state[main] = {"step": torch.tensor(1.0), "exp_avg": main.detach().clone(),
                                 "exp_avg_sq": main.detach().square()}
    model_sd = bf16_model.sharded_state_dict()
    params = {_place(t.key, t): t.data for t in model_sd.values()
              if isinstance(getattr(t, "data", None), torch.nn.Parameter)}
    sd = type(opt).sharded_state_dict(opt, model_sd, is_loading=False)
    seen = 0
    for entry in sd["optimizer"]["state"].values():
        if not isinstance(entry, dict):
            continue   # the common step
        for kind in ("exp_avg", "exp_avg_sq"):
            st = entry[kind]
            want = params[_place(st.key.removeprefix(f"optimizer.state.{kind}."), st)].detach().float()
            torch.testing.assert_close(st.data, want.square() if kind == "exp_avg_sq" else want, rtol=0, atol=0)
            seen += 1
    for group in sd["fp32_from_fp16_params"]:
        for st in group:
            want = params[_place(st.key.removeprefix("optimizer.state.fp32_param."), st)].detach().float()
            torch.testing.assert_close(st.data, want, rtol=0, atol=0)
    assert seen == 2 * len(list(bf16_model.parameters()))


def test_main_weights_hold_the_checkpoint_exactly_and_are_what_export_reads(bf16_model):
    """Export semantics with bf16 parameters: the backend loads the checkpoint's fp32 values into
    the optimizer's fp32 main copies (`gpu.load_main_params`) and exports those copies
    (`gpu.main_params`, read by `MegatronBackend.full_megatron_state`), so version 0 is the source
    checkpoint bit for bit, which the bf16 parameters alone cannot give."""
    from megatron.core.optimizer import _get_param_groups

    cfg = gpu.optimizer_config(OptimConfig(), MegatronConfig(use_distributed_optimizer=False), torch.bfloat16)
    opt = _float16_optimizer(torch.optim.AdamW(_get_param_groups([bf16_model], cfg, None), lr=cfg.lr), cfg)
    gen = torch.Generator().manual_seed(1)
    fp32 = {n: torch.randn(p.shape, generator=gen) for n, p in bf16_model.named_parameters()}
    with torch.no_grad():
        for n, p in bf16_model.named_parameters():
            p.copy_(fp32[n])            # what loading into the parameters alone keeps: a rounding
    assert not any(torch.equal(p.float(), fp32[n]) for n, p in bf16_model.named_parameters())
    assert gpu.load_main_params(bf16_model, opt, fp32) == len(fp32)
    exported = gpu.main_params(bf16_model, opt)
    assert exported.keys() == fp32.keys()
    for n, t in exported.items():
        assert t.dtype == torch.float32 and torch.equal(t, fp32[n]), n
