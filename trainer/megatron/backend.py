"""`MegatronBackend`: the `TrainBackend` contract on a Megatron-core GPTModel.

One instance per trainer rank. Process groups come from `megatron.core.parallel_state`
(tensor x pipeline x data parallel over the default group: gloo on CPU, nccl on GPUs). All
tensor-parallel ranks of one data-parallel replica get the same micro-batches (`dp_rank`), run
the same forward, and so compute the same loss; Megatron's column/row-parallel layers do the TP
communication in forward and backward. Log-probs come from the last stage's hidden states, the
output layer applied a chunk of tokens at a time and vocabulary-parallel over TP
(logprob_head.py): no rank holds [tokens, vocab] logits.

Packed sequences go in THD format on both paths (TE's attention, or varlen_attention.py's).
CPU (runs here, see cpu_compat.py): local layer spec, torch AdamW
over this rank's shards, data-parallel gradients summed with one all-reduce, the gradient norm
reduced over the model-parallel group counting replicated tensors once.
GPU (written against megatron-core 0.16.1, not run here): TransformerEngine spec when
installed, Megatron's `DistributedDataParallel` and distributed optimizer
(`calculate_per_token_loss=True`, so gradients are summed, not averaged, over DP ranks).

Pipeline parallelism: each stage holds a contiguous range of layers; micro-batches flow
through the stages with the small GPipe schedule of pipeline.py (Megatron's own schedules need
CUDA); log-probs are broadcast from the last stage, and with tied embeddings the first and
last stages' copies of the embedding get their gradients summed over Megatron's embedding group.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

import tandem.trainer.compiled as compiled
import tandem.trainer.recompute as recompute
from tandem.services.protocol import attention_without_cudnn, collectives
from tandem.trainer.backend import (
    LossFn,
    PackedBatch,
    StepResult,
    TokenOutputs,
    TrainBackend,
    add_stats,
    agreed_nonfinite,
    stats_on_host,
    to_device,
)
from tandem.trainer.lr_schedule import decay_updates, lr_factor
from tandem.trainer.megatron import (
    convert,
    convert_moe,
    cpu_compat,
    cpu_grads,
    dist_ckpt,
    gpu,
    moe,
    moe_replay,
    moe_step,
    optim_state,
)
from tandem.trainer.megatron.config import MegatronConfig
from tandem.trainer.megatron.export import write_hf_dir
from tandem.trainer.megatron.logprob_head import hidden_logprobs
from tandem.trainer.megatron.model import (
    bounds_device,
    build_gpt_model,
    check_parallel_fits,
    init_parallel,
    layer_offset,
    layer_spec,
    padded_vocab_size,
    transformer_config,
)
from tandem.trainer.megatron.pipeline import run_micro_batches
from tandem.trainer.megatron.shape import decoder_shape

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF directory's safetensors files (sharded or not)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (the Megatron backend "
                                "reads safetensors only)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


class MegatronBackend(TrainBackend):
    # The loop checkpoints this backend with Megatron's dist checkpointing (save_checkpoint):
    # reshardable on load, and the only way to save the distributed optimizer's state.
    sharded_checkpoint = True

    def __init__(self, cfg, model_dir: Path, seed: int, mcfg: MegatronConfig | None = None,
                 alive_micro_batches: int = 1):
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        self.cfg = cfg
        self.mcfg = mcfg or getattr(cfg, "megatron", None) or MegatronConfig()
        self.model_dir = Path(model_dir)
        self.on_gpu = torch.cuda.is_available()
        tp, pp, ep = cfg.tensor_parallel, cfg.pipeline_parallel, getattr(cfg, "expert_parallel", 1)
        attention_without_cudnn()   # a graph build per new sequence length (services/protocol/runtime.py)
        if self.on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            cpu_compat.apply()
            self.device = torch.device("cpu")
        self.bounds_device = bounds_device(self.on_gpu, self.device)   # where cu_seqlens go
        self.shape = decoder_shape(self.model_dir)
        check_parallel_fits(self.shape, tp, pp, ep)
        init_parallel(tp, pp, ep)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), tp
        self.pp_size = pp
        self.ep_rank, self.ep_size = ps.get_expert_model_parallel_rank(), ep
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        # trainer.megatron.recompute: true, false, or auto (chosen by memory, alike on every rank:
        # trainer/recompute.py); self.mcfg.recompute is the decision from here on.
        view = copy.copy(cfg)
        view.megatron = self.mcfg
        self.recompute_choice = recompute.decide(view, self.model_dir, self.dp_size, self.device, "megatron",
                                                 alive_micro_batches)
        self.mcfg = recompute.resolved(self.mcfg, self.recompute_choice.on)
        self.padded_vocab = padded_vocab_size(self.shape.vocab_size, self.mcfg.vocab_multiple, tp)
        dtype = _DTYPES[self.mcfg.params_dtype] if self.on_gpu else torch.float32
        self.dtype = dtype
        self.config = transformer_config(self.shape, dtype, self.on_gpu, recompute=self.mcfg.recompute,
                                         fused_activation=cfg.compile, mcfg=self.mcfg)
        # trainer.compile: the log-prob chunks compiled too (the one-rank output layer's; with TP
        # the vocabulary-parallel chunks, which all-reduce, stay eager)
        self.chunk_fn = compiled.compiled_chunk_fn() if cfg.compile and tp == 1 else None
        with cpu_compat.model_construction():
            model = build_gpt_model(self.shape, self.config, self._layer_spec(), self.padded_vocab)
        if self.on_gpu:
            model.cuda()
        # MoE: each step's routing counts (moe.py), read by step_metrics
        self.router_stats = (moe.RouterStats(model, self.shape.num_layers, self.shape.num_experts, self.shape.moe_topk)
                             if self.shape.is_moe else None)
        # Rollout routing replay (trainer.routing_replay) and the routers' agreement with the
        # sampler's experts, on MoE models (moe_replay.py); the reference model gets its own.
        self.routing = self._routing_replay(model)
        self.ref_routing = None
        self.te_norms = any(k.endswith("layer_norm_weight") for k in model.state_dict())
        self.model = model
        hf_local = self.load_hf(self.model_dir)
        model.eval()  # no dropout anyway; eval keeps proximal and first-update log-probs equal
        # A KL penalty's initial policy: built here, by every rank together (with PP and tied
        # embeddings GPTModel's constructor runs a collective), never trained.
        self.reference = self._reference_model() if cfg.kl_coef > 0 else None
        if self.reference is not None:
            self.ref_routing = self._routing_replay(self.reference)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.updates = 0
        if self.on_gpu:
            self.model, self.optimizer = gpu.wrap_model_and_optimizer(self.model, self.config, self.mcfg,
                                                                      cfg.optim, dtype)
            # The optimizer made its fp32 main copies from the (bf16) parameters: give them the
            # checkpoint's own values instead, so training starts from exactly those weights.
            optim_state.load_main_params(self._module(), self.optimizer, hf_local)
        else:
            o = cfg.optim
            self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.beta1, o.beta2),
                                               eps=o.eps, weight_decay=o.weight_decay)

    # ---- weights in ---------------------------------------------------------------------------
    def load_hf(self, model_dir: Path, module=None) -> dict[str, torch.Tensor]:
        """Load this rank's shard of a HF checkpoint (every rank reads the files) into the policy
        (or `module`); returns the shard in the checkpoint's precision (the parameters may be bf16)."""
        from megatron.core import parallel_state as ps

        hf = read_hf_tensors(model_dir)
        n_local = self.shape.num_layers // ps.get_pipeline_model_parallel_world_size()
        start = layer_offset(self.shape)
        full = convert.hf_to_megatron(
            hf, self.shape, self.padded_vocab, te_norms=self.te_norms,
            layers=range(start, start + n_local), embedding=ps.is_pipeline_first_stage(),
            output=ps.is_pipeline_last_stage())
        full = convert_moe.ep_shard(full, self.ep_rank, self.ep_size, self.shape.num_experts)
        local = {k: convert.shard(k, v, self.tp_rank, self.tp_size) for k, v in full.items()}
        self.load_model_state(local, module)
        return local

    def load_model_state(self, state: dict, module=None) -> None:
        """Load local tensors; anything missing other than Megatron's `_extra_state` is an error."""
        module = module if module is not None else self._module()
        missing, unexpected = module.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise KeyError(f"Megatron model load: missing {missing}, unexpected {unexpected}")

    def _routing_replay(self, module):
        if not self.shape.is_moe:
            return None
        return moe_replay.install(module, getattr(self.cfg, "routing_replay", False), self.shape.num_layers,
                                  recompute=self.mcfg.recompute)

    def _layer_spec(self):
        return layer_spec(self.on_gpu, self.shape.qk_norm, self.shape.num_experts)

    def _module(self):
        """The GPTModel itself (unwrapped from Megatron's DDP on GPUs)."""
        return getattr(self.model, "module", self.model)

    def _reference_model(self):
        """The initial policy (experiment.model) frozen in a GPTModel of this rank's layout, dtype
        and layer spec: the same forward as the policy's, another copy of the weights."""
        with cpu_compat.model_construction():
            ref = build_gpt_model(self.shape, self.config, self._layer_spec(), self.padded_vocab)
        if self.on_gpu:
            ref.cuda()
        self.load_hf(self.model_dir, module=ref)
        return ref.eval().requires_grad_(False)

    # ---- forward ------------------------------------------------------------------------------
    def _stage_forward(self, mb: PackedBatch, model=None, logits: bool = False) -> torch.Tensor:
        """This pipeline stage's output, hidden states [N, 1, h] (on the last stage after the final
        norm), of the policy or of `model` (the reference); with `logits`, the last stage's
        gathered logits [1, N, V] instead."""
        model = model if model is not None else self.model
        ids = to_device(mb.input_ids, self.device)[None]
        pos = to_device(mb.position_ids, self.device)[None]
        # THD on both specs: TE's fused attention, or the local spec's VarlenCoreAttention; rotary
        # positions restart per sequence from cu_seqlens.
        forward = gpu.forward_thd if logits else gpu.forward_thd_hidden
        replay = self.routing if model is self.model else self.ref_routing
        if replay is not None:
            routes = mb.fields.get("routed_experts")
            replay.set_routes(None if routes is None else to_device(routes, self.device))
        if moe_step.is_phantom(mb):   # no router loss, no routing counted (moe_step.py)
            with moe_step.without_router_losses(self._module(), self.router_stats):
                return forward(model, ids, pos, mb.cu_seqlens, self.bounds_device)
        return forward(model, ids, pos, mb.cu_seqlens, self.bounds_device)

    def _logits(self, mb: PackedBatch) -> torch.Tensor:
        """[N, vocab] logits (padding rows cut off). Single-stage models only (tests, tools)."""
        return self._stage_forward(mb, logits=True)[0, :, : self.shape.vocab_size]

    def _outputs(self, mb: PackedBatch, hidden: torch.Tensor, temperature: float,
                 with_entropy: bool, model=None) -> TokenOutputs:
        """Log-probs from the last stage's hidden states, the output layer (vocabulary-parallel
        with TP) applied `trainer.logprob_chunk` tokens at a time: logprob_head.py."""
        entropy_grad = self.entropy_grad and torch.is_grad_enabled()
        return hidden_logprobs(model if model is not None else self._module(), hidden,
                               to_device(mb.input_ids, self.device), mb.cu_seqlens, temperature, with_entropy,
                               entropy_grad, self.cfg.logprob_chunk, self.shape.vocab_size, self.chunk_fn)

    def _run(self, mbs: list[PackedBatch], on_last, forward_only: bool, model=None) -> list:
        module = model if model is not None else self._module()
        return run_micro_batches(module, mbs, lambda mb: self._stage_forward(mb, model), on_last,
                                 forward_only=forward_only, hidden_size=self.shape.hidden_size,
                                 dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def forward_logprobs(self, mb: PackedBatch, temperature: float, *, with_entropy: bool = False,
                         model=None) -> TokenOutputs:
        if mb.n_tokens == 0:
            z = torch.zeros(0)
            if self.ep_size > 1:   # the expert-parallel peers run a forward: so does this rank
                self._run([moe_step.phantom_batch(self.device)], lambda m, hidden: (None, None),
                          forward_only=True, model=model)
                if self.pp_size > 1:
                    self._from_last_stage(None, 1, with_entropy)
            return TokenOutputs(logp=z, entropy=z if with_entropy else None)
        res = self._run([mb], lambda m, hidden: (None, self._outputs(m, hidden, temperature, with_entropy, model)),
                        forward_only=True, model=model)
        if self.pp_size > 1:
            res = [self._from_last_stage(res[0] if res else None, mb.n_tokens, with_entropy)]
        out = res[0]
        return TokenOutputs(logp=out.logp.cpu(), entropy=None if out.entropy is None else out.entropy.cpu())

    @torch.no_grad()
    def forward_ref_logprobs(self, mb: PackedBatch, temperature: float) -> TokenOutputs:
        """The initial policy's log-probs for a KL penalty (trainer.kl_coef > 0): the policy's
        forward on the frozen reference model; the loss (trainer/loss.py) is the torch backend's."""
        if self.reference is None:   # kl_coef was 0 at construction: every rank builds it now
            self.reference = self._reference_model()
            self.ref_routing = self._routing_replay(self.reference)
        return self.forward_logprobs(mb, temperature, model=self.reference)

    def _from_last_stage(self, out: TokenOutputs | None, n: int, with_entropy: bool) -> TokenOutputs:
        """Broadcast the last stage's log-probs (and entropy) to every stage."""
        from megatron.core import parallel_state as ps

        buf = torch.empty(2 if with_entropy else 1, n, dtype=torch.float32, device=self.device)
        if out is not None:
            buf[0] = out.logp
            if with_entropy:
                buf[1] = out.entropy
        collectives.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                              group=ps.get_pipeline_model_parallel_group())
        return TokenOutputs(logp=buf[0], entropy=buf[1] if with_entropy else None)

    # ---- update -------------------------------------------------------------------------------
    def _lr(self) -> float:
        """The torch backend's schedule (trainer/lr_schedule.py) at this update; `updates` is in
        every checkpoint, so a resumed run continues it."""
        o = self.cfg.optim
        return o.lr * lr_factor(o, self.updates, decay_updates(self.cfg))

    def train_step(self, mbs: list[PackedBatch], loss_fn: LossFn, temperature: float) -> StepResult:
        lr = self._lr()
        if self.on_gpu:
            gpu.zero_grad(self.model, self.optimizer)
        else:
            self.optimizer.zero_grad()
        stats: dict = {}

        def on_last(mb: PackedBatch, hidden: torch.Tensor):
            if moe_step.is_phantom(mb):   # expert-parallel ranks in step; no gradient (moe_step.py)
                return hidden.sum() * 0.0, None
            out = self._outputs(mb, hidden, temperature, with_entropy=True)
            loss, mb_stats = loss_fn(mb, out)
            add_stats(stats, mb_stats)
            return loss, None

        # Megatron recomputes only in a block whose `training` flag is set; the layers themselves
        # stay in eval mode (the block's flag gates nothing else in megatron-core 0.16.1).
        block = self._module().decoder
        block.training = self.mcfg.recompute
        if self.routing is not None:
            self.routing.clear_stacks()
        # each micro-batch on the device once: the first stage's forward and the last's loss read it
        run = moe_step.in_step([mb.on(self.device) for mb in mbs], self.ep_size, self.device)
        routing = (moe_step.training_routers(self._module(), self.mcfg, self.router_stats,
                                             moe_step.global_tokens(run) if moe.router_losses_on(self.mcfg) else 0.0,
                                             self.device) if self.shape.is_moe else contextlib.nullcontext())
        try:
            with routing:
                self._run(run, on_last, forward_only=False)
        finally:
            block.training = False
        if self.shape.is_moe:   # each expert shard saw every TP rank's copy of the tokens (moe_step.py)
            moe_step.undo_tp_copies(list(self._module().named_parameters()), self.tp_size)
        if self.pp_size > 1 and self.shape.tie_word_embeddings and not self.on_gpu:
            cpu_grads.sum_shared_embedding_grads(self)
        if self.tp_size > 1 and self.shape.qk_norm and not self.on_gpu:
            cpu_grads.sum_qk_norm_grads_over_tp(self)
        stats = self._count_once(stats_on_host(stats))
        nonfinite = agreed_nonfinite(stats)
        if nonfinite:   # the loop names the terms and stops the step; no rank steps
            if self.on_gpu:
                gpu.zero_grad(self.model, self.optimizer)
            else:
                self.optimizer.zero_grad()
            return StepResult(grad_norm=math.nan, lr=lr, stats=stats, applied=False, nonfinite=nonfinite)
        if self.on_gpu:
            applied, grad_norm = gpu.step(self.model, self.optimizer, lr)
            self.updates += applied
            return StepResult(grad_norm=grad_norm, lr=lr, stats=stats, applied=applied)
        if self.dp_size > 1:
            cpu_grads.sum_grads_over_dp(self)
        grad_norm = cpu_grads.grad_norm(self)
        if not math.isfinite(grad_norm):
            log.warning("non-finite gradient norm %s: update skipped", grad_norm)
            self.optimizer.zero_grad()
            return StepResult(grad_norm=grad_norm, lr=lr, stats=stats, applied=False)
        clip = self.cfg.optim.grad_clip
        if clip > 0 and grad_norm > clip:
            scale = clip / (grad_norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.updates += 1
        return StepResult(grad_norm=grad_norm, lr=lr, stats=stats)

    def _count_once(self, stats: dict[str, float]) -> dict[str, float]:
        """Every TP rank of a replica saw the same tokens; the loop SUMS stats over all ranks, so
        only TP rank 0 of the last stage reports the sums (duplicated maxima are harmless)."""
        if self.tp_rank == 0:
            return stats
        return {k: (v if k.endswith("_max") else 0.0) for k, v in stats.items()}

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shards (same-layout reload, used by tests and tools); the loop's
        checkpoints use `save_checkpoint` (reshardable)."""
        if self.on_gpu and self.mcfg.use_distributed_optimizer:
            raise RuntimeError("the distributed optimizer's state is sharded over data-parallel "
                               "ranks: checkpoint with save_checkpoint()/load_checkpoint()")
        model = {k: v.detach().cpu().clone() for k, v in self._module().state_dict().items()
                 if isinstance(v, torch.Tensor)}
        return {"model": model, "optimizer": self.optimizer.state_dict(), "updates": self.updates,
                "layout": self._layout()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("layout") != self._layout():
            raise ValueError(f"checkpoint layout {state.get('layout')} differs from this job's "
                             f"{self._layout()}; use the dist checkpoint (save_checkpoint) to reshard")
        self.load_model_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])

    def _layout(self) -> dict:
        return {"tp": self.tp_size, "pp": self.cfg.pipeline_parallel, "dp": self.dp_size,
                "rank": self.rank}

    def save_checkpoint(self, ckpt_dir: Path) -> None:
        """Collective: a Megatron dist checkpoint (loads into any TP layout)."""
        dist_ckpt.save(self, ckpt_dir)

    def load_checkpoint(self, ckpt_dir: Path) -> None:
        """Collective: inverse of save_checkpoint."""
        dist_ckpt.load(self, ckpt_dir)

    # ---- weights out --------------------------------------------------------------------------
    def full_megatron_state(self) -> dict[str, torch.Tensor]:
        """Full (TP-merged) Megatron tensors, gathered with all_gather over the TP group.

        Which weights: the optimizer's fp32 main weights where it keeps them (GPU, bf16/fp16
        parameters: the values training updates, of which the parameters are a rounding), the
        parameters themselves elsewhere (fp32: CPU, or `params_dtype: float32`). So the export
        of a bf16 run is fp32, and at version 0 it is the source checkpoint bit for bit.

        Collective over the TP group (and the DP group with the distributed optimizer): every
        rank must call it. (Merging shards by having rank 0 read other ranks' files hangs inside
        the job; collectives do not.)
        """
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        mains = optim_state.main_params(self._module(), self.optimizer) if self.on_gpu else {}
        out = {}
        for name, t in self._module().state_dict().items():
            if not isinstance(t, torch.Tensor):
                continue
            t = mains.get(name, t).detach()
            if self.tp_size > 1 and convert.tp_layout(name)[0] is not None:
                parts = [torch.empty_like(t) for _ in range(self.tp_size)]
                collectives.all_gather(parts, t, group=group)
                t = convert.merge(name, parts)
            out[name] = t.cpu()
        if self.ep_size > 1:   # each expert-parallel rank holds its own experts: gather them all
            parts: list = [None] * self.ep_size
            collectives.all_gather_object(parts, {k: v for k, v in out.items() if moe.is_expert_param(k)},
                                          group=ps.get_expert_model_parallel_group())
            dense = {k: v for k, v in out.items() if not moe.is_expert_param(k)}
            out = convert_moe.ep_merge([dense | parts[0]] + parts[1:])
        return out

    def hf_state(self) -> dict[str, torch.Tensor]:
        """Collective: the model as HF tensors (every rank gets them). Stages convert their own
        layers, then exchange them over the pipeline group."""
        from megatron.core import parallel_state as ps

        part = convert.megatron_to_hf(self.full_megatron_state(), self.shape, te_norms=self.te_norms,
                                      offset=layer_offset(self.shape))
        if self.pp_size == 1:
            return part
        parts: list = [None] * self.pp_size
        collectives.all_gather_object(parts, part, group=ps.get_pipeline_model_parallel_group())
        return {k: v for p in parts for k, v in p.items()}

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective when called (not when iterated): gathers first, then yields in name order."""
        state = self.hf_state()
        return iter(sorted(state.items()))

    def export_hf(self, out_dir: Path) -> None:
        state = self.hf_state()
        if self.rank == 0:
            write_hf_dir(state, self.model_dir, out_dir)

    def step_metrics(self) -> dict[str, float]:
        """MoE models: each layer's expert load and dropped assignments over the step's updates
        (moe.routing_metrics). Collective."""
        if self.router_stats is None:
            return {}
        return {**moe_step.routing_metrics(self.router_stats, self.tp_rank),
                **moe_step.agreement_metric(self.routing, self.tp_rank)}

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
