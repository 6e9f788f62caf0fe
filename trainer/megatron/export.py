"""A Megatron dist checkpoint (`<exp>/checkpoints/step-<N>/dist/`) as Hugging Face tensors, in one
process on the CPU, whatever tensor/pipeline/data-parallel layout and device wrote it.

Why this way: the checkpoint stores every tensor with its place in the full tensor (dist_ckpt.py),
so Megatron's own loader reshards it into any layout — here TP = PP = DP = 1, one process, the
local layer spec on the CPU (its dist-checkpoint keys are the TransformerEngine spec's, so a GPU
run's checkpoint loads). Then the backend's converter (convert.py) names the tensors as
transformers does. The weights are those the published `weights/v<N>` of the same version holds:
the optimizer's float32 main weights (`optimizer.state.param.*`, saved once the run has updated),
else the model's parameters (a version-0 checkpoint); so the export is float32.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.trainer.hf_dir import copy_tokenizer_files
from tandem.trainer.megatron import convert, cpu_compat, dist_ckpt
from tandem.trainer.megatron.model import (
    build_gpt_model,
    init_parallel,
    layer_spec,
    padded_vocab_size,
    transformer_config,
)
from tandem.trainer.megatron.shape import decoder_shape


def write_hf_dir(state: dict[str, torch.Tensor], model_dir: Path, out_dir: Path) -> None:
    """`out_dir/model.safetensors` from HF tensors, with config.json, the tokenizer and every other
    non-weight file of `model_dir` (the run's base model) beside it."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(Path(model_dir) / "config.json", out_dir / "config.json")   # the run's mode, not the model's
    copy_tokenizer_files(model_dir, out_dir)


def hf_state_from_dist(dist_dir: Path, model_dir: Path, vocab_multiple: int = 128) -> dict[str, torch.Tensor]:
    """HF tensors (float32 main weights) of the dist checkpoint `dist_dir` of a run on `model_dir`.

    Runs in its own one-rank process group (gloo, in memory) and Megatron process groups, both torn
    down before it returns; refuses to run inside an existing Megatron job."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        raise RuntimeError("hf_state_from_dist runs in a process of its own (Megatron's groups exist here)")
    shape = decoder_shape(model_dir)
    made_group = not dist.is_initialized()
    if made_group:   # gloo even on a GPU machine: everything below stays on the CPU
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if not torch.cuda.is_available():
            cpu_compat.apply()
        init_parallel(1, 1)
        config = transformer_config(shape, torch.float32, on_gpu=False)
        with cpu_compat.model_construction():
            model = build_gpt_model(shape, config, layer_spec(on_gpu=False, qk_norm=shape.qk_norm, num_experts=shape.num_experts),
                                    padded_vocab_size(shape.vocab_size, vocab_multiple, 1))
        common = dist_checkpointing.load_common_state_dict(str(dist_dir))
        model_sd = model.sharded_state_dict()
        request = {"model": model_sd}
        if int(common["updates"]) > 0:
            template = {n: {"param": torch.zeros_like(p, dtype=torch.float32)} for n, p in model.named_parameters()}
            request["optimizer"] = dist_ckpt.optimizer_sharded(model, model_sd, template, kinds=("param",))
        loaded = dist_checkpointing.load(request, str(dist_dir))
        state = {k: v.float() for k, v in loaded["model"].items() if isinstance(v, torch.Tensor)}
        for name, kinds in loaded.get("optimizer", {}).items():
            state[name] = kinds["param"].float()
        return convert.megatron_to_hf(state, shape, te_norms=False, offset=0)
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if made_group and dist.is_initialized():
            dist.destroy_process_group()
