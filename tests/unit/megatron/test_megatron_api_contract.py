"""The Megatron GPU path against the installed megatron-core 0.16.1, on a machine without a GPU.

Most of `trainer/megatron/` runs here (tests/unit/megatron/test_megatron_backend.py,
tests/integration/megatron/test_megatron_parallel.py); the GPU-only calls do not: Megatron's DDP and (distributed) optimizer, the TransformerEngine layer spec, THD
packed sequences, the optimizer's sharded checkpoint state. So that a renamed or newly
required argument fails here rather than on the cluster:

1. Every use of megatron-core in `trainer/megatron/*.py` is read from the source with `ast`
   (megatron_api.py: no list of names here) and checked against the installed package: each
   call's positional count and keyword names are bound with `inspect.signature(...).bind`
   (dataclasses through their generated `__init__`), each attribute read or assigned must
   exist, each overridden method must exist in the megatron base with the same parameters.
   Method calls on GPU-only objects are checked through the receivers' annotations in
   gpu.py (`DistributedDataParallel`, `MegatronOptimizer`, `GPTModel`).
2. The GPU configs are really constructed (their `__post_init__` validation runs on CPU):
   `DistributedDataParallelConfig`, `OptimizerConfig` (bf16/fp16/fp32, with and without the
   distributed optimizer) and the bf16 `TransformerConfig` of the GPU path.
3. Megatron's `DistributedDataParallel` wraps the model for real on CPU (it does not need
   CUDA), and the dist-checkpoint state is taken from the unwrapped GPTModel: the wrapper's own
   `sharded_state_dict` would prefix every key with `module.`.

What could NOT be checked here, and why:
- Anything that imports TransformerEngine (not installable without CUDA): calling
  `get_gpt_layer_with_transformer_engine_spec()` (its signature is bound above; calling it
  without TE raises NameError inside megatron-core), the TE modules it selects and their state
  names (convert.py's TE names are tested only as a name mapping), and TE's fused attention
  consuming `PackedSeqParams(qkv_format="thd")` (the dataclass and `GPTModel.forward`'s
  `packed_seq_params` argument are bound; whether TE accepts int32 `cu_seqlens` is not run).
- `get_megatron_optimizer` and the optimizers it builds (Float16/Distributed/FP32Optimizer)
  accept only CUDA tensors, so here their calls are only bound; they do run, with CUDA type
  names and placement stood in, in tests/unit/megatron/test_megatron_gpu_checkpoint.py and
  tests/integration/megatron/test_megatron_gpu_optimizer_checkpoint.py (`gpu.step`, the
  model-space state of optim_state.py, checkpoints with both optimizers).
- The values of string options (`optimizer="adam"`, `qkv_format="thd"`): only the argument
  names are bound.
"""
from __future__ import annotations

import sys
from pathlib import Path

import megatron_api
import megatron_case as mc
import pytest
import torch

from tandem.trainer.config import OptimConfig
from tandem.trainer.megatron import dist_ckpt, gpu
from tandem.trainer.megatron.config import MegatronConfig
from tandem.trainer.megatron.model import transformer_config
from tandem.trainer.megatron.shape import decoder_shape

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "trainer" / "megatron"


@pytest.fixture(scope="module")
def uses() -> list[megatron_api.Use]:
    return megatron_api.collect(PACKAGE, ROOT)


def test_every_megatron_use_binds_to_the_installed_release(uses):
    problems = [f"{u.where}: {why}" for u in uses if (why := megatron_api.check(u))]
    assert not problems, "\n".join(problems)
    calls = [u for u in uses if u.kind == "call"]
    print(f"\n{len(calls)} megatron-core calls checked:")
    for u in calls:
        print(f"  {u.where}: {u.target}({u.n_positional} positional; {', '.join(u.keywords)})")
    # The reader must see the GPU path: every callable gpu.py imports from megatron is called.
    gpu_imports = {u.target for u in uses if u.kind == "import" and u.where.startswith("trainer/megatron/gpu.py")}
    gpu_calls = {u.target for u in calls if u.where.startswith("trainer/megatron/gpu.py")}
    for name in gpu_imports:
        assert any(c == name or c.startswith(name + ".") for c in gpu_calls), f"{name}: no call seen"


def test_every_megatron_import_is_used_where_the_reader_can_see_it(uses):
    """An import the reader never sees used would hide unchecked calls (e.g. on an unannotated
    receiver): each one must be reached by a checked call, attribute, override or annotation."""
    for imp in (u for u in uses if u.kind == "import"):
        file = imp.where.split(":")[0]
        seen = [u for u in uses if u.kind != "import" and u.where.startswith(file + ":")
                and (u.target == imp.target or u.target.startswith(imp.target + "."))]
        assert seen, f"{imp.where}: {imp.target} is imported but no use of it was checked"


def test_the_checker_fails_on_a_renamed_argument(tmp_path):
    """The reader and binder can fail: a module with a renamed keyword, a misspelled one on an
    annotated receiver, a missing method and a missing module attribute."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "bad.py").write_text(
        "from megatron.core import parallel_state as ps\n"
        "from megatron.core.distributed import DistributedDataParallelConfig\n"
        "from megatron.core.optimizer import MegatronOptimizer\n\n\n"
        "def f(opt: MegatronOptimizer):\n"
        "    DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduction=False)\n"
        "    opt.sharded_state_dict({}, is_loading=True, metdata={})\n"
        "    opt.no_such_method()\n"
        "    ps.get_no_such_group()\n")
    problems = {u.where: megatron_api.check(u) for u in megatron_api.collect(pkg, tmp_path)
                if megatron_api.check(u)}
    assert "overlap_grad_reduction" in problems["pkg/bad.py:7"]
    assert "metdata" in problems["pkg/bad.py:8"]
    assert "no_such_method" in problems["pkg/bad.py:9"]
    assert "get_no_such_group" in problems["pkg/bad.py:10"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("distributed", [True, False])
def test_gpu_configs_construct(dtype, distributed):
    mcfg = MegatronConfig(use_distributed_optimizer=distributed)
    ddp = gpu.ddp_config(mcfg)
    assert ddp.use_distributed_optimizer is distributed and ddp.grad_reduce_in_fp32
    opt = gpu.optimizer_config(OptimConfig(lr=3e-6, grad_clip=0.5, beta2=0.99), mcfg, dtype)
    assert (opt.lr, opt.clip_grad, opt.adam_beta2, opt.params_dtype) == (3e-6, 0.5, 0.99, dtype)
    assert (opt.bf16, opt.fp16) == (dtype == torch.bfloat16, dtype == torch.float16)


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """A TP=1 CPU backend in this process (Megatron's process-group state is global)."""
    import torch.distributed as dist

    from tandem.trainer.megatron.backend import MegatronBackend

    created_group = not dist.is_initialized()
    torch.backends.cuda.enable_cudnn_sdp(True)   # test_the_backend_turns_cudnn_attention_off
    be = MegatronBackend(mc.trainer_cfg(tp=1), mc.make_model_dir(tmp_path_factory.mktemp("m")), seed=0)
    be.cudnn_attention_after_init = torch.backends.cuda.cudnn_sdp_enabled()
    yield be
    be.close()
    if created_group and dist.is_initialized():
        dist.destroy_process_group()


def test_the_backend_turns_cudnn_attention_off(backend):
    """cuDNN attention builds a graph per new sequence length (services/protocol/runtime.py
    `attention_without_cudnn`; tests/unit/foundation/test_attention_kernels.py for the others)."""
    assert backend.cudnn_attention_after_init is False


def test_gpu_transformer_config_constructs(backend):
    cfg = transformer_config(decoder_shape(backend.model_dir), torch.bfloat16, on_gpu=True)
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16 and not cfg.use_cpu_initialization
    assert cfg.calculate_per_token_loss


def test_ddp_wrapper_and_checkpoint_keys(backend, monkeypatch):
    """Megatron's DDP (GPU path) wraps the model on CPU too; checkpoints are keyed by the
    GPTModel's own names, never the wrapper's `module.` ones, so GPU and CPU runs share them."""
    from megatron.core.distributed import DistributedDataParallel

    module = backend._module()   # the GPTModel (on a GPU the backend has wrapped it already)
    plain = set(dist_ckpt._model_sharded(backend))
    assert plain and not any(k.startswith("module.") for k in plain)
    ddp = backend.model if isinstance(backend.model, DistributedDataParallel) else \
        DistributedDataParallel(config=backend.config, ddp_config=gpu.ddp_config(backend.mcfg), module=module)
    assert all(k.startswith("module.") for k in ddp.sharded_state_dict())
    monkeypatch.setattr(backend, "model", ddp)
    assert backend._module() is module
    assert set(dist_ckpt._model_sharded(backend)) == plain


if __name__ == "__main__":  # print the list of checked calls
    sys.exit(pytest.main([__file__, "-q", "-s", "-k", "binds_to"]))
