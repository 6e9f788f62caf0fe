"""The plain-torch backend: any Hugging Face causal LM, one full replica per rank.

This is the backend of the embedded default (CPU) and of small GPU runs. Data parallelism is a
sum all-reduce of gradients over the default process group (gloo on CPU, nccl on GPU); no DDP
wrapper, because the loss is already normalised by the global token count (see backend.py) and
micro-batch counts are equal on every rank by construction.

Packed forward: all sequences of a micro-batch go through the model as one row, with position
ids restarting at 0 for each sequence, and the sequence boundaries (`cu_seq_lens_q/k`, the
flash-attention varlen convention transformers forwards to the attention function). With
flash-attention 2 installed (GPUs) that is its varlen kernel. Elsewhere a registered attention
function, `tandem_varlen`, runs causal SDPA once per sequence inside each layer: a
block-diagonal mask over the whole pack would cost (sum of lengths)^2 instead of the sum of
squares (measured: 60% of a CPU forward), while the linear layers still run on the whole pack.
`packed_forward: false` runs one model forward per sequence instead, the exact reference (a
test checks both agree).

The model stays in eval mode (no dropout) in training too: the proximal log-probs and the
first update's log-probs must be the same numbers, so that r = 1 exactly at the start of a step.

With `trainer.lora.rank > 0` the model is wrapped in peft's LoRA adapters (trainer/lora.py):
only they train and are checkpointed; the KL reference is the model with its adapters off;
`export_hf` (what the disk publication writes) is peft's adapter directory with
`trainer.lora.sync: adapter`, else the merged model, as is every broadcast.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

import tandem.trainer.compiled as compiled
import tandem.trainer.lora as lora
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
    packed_sequences,
    stats_on_host,
    to_device,
)
from tandem.trainer.expert_names import hub_tensors
from tandem.trainer.hf_dir import copy_tokenizer_files
from tandem.trainer.logprobs import token_logprobs
from tandem.trainer.lr_schedule import decay_updates, lr_factor
from tandem.trainer.routing_replay import RouterReplay

log = logging.getLogger(__name__)

VARLEN_ATTENTION = "tandem_varlen"


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """Causal attention within each packed sequence (query/key/value: [1, heads, N, dim])."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop("cu_seq_lens_q", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
        kwargs.pop(k, None)
    if cu is None:  # not a packed call (e.g. generation): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    outs = []
    for q, k, v in packed_sequences(cu, 2, query, key, value):
        out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True,
                                        **kwargs)
        outs.append(out)      # [1, length, heads, dim]
    return torch.cat(outs, dim=1), None


def recompute_layers(model) -> None:
    """trainer.recompute (true, or auto decided on): transformers' activation checkpointing, one
    decoder layer per unit.
    Its layers checkpoint only in training mode, and the backend keeps the model in eval mode (no
    dropout: the proximal and the first update's log-probs are the same numbers), so only the
    modules that carry the checkpointing flag are put in training mode, not their children."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):   # its newer name (5.24 deprecates the older)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            module.training = True


def _register_varlen_attention() -> None:
    from transformers import AttentionInterface
    # Eager inside a compiled layer (trainer.compile): it splits the pack at sizes only the data
    # knows, which would end the compiled graph at an unplanned place (trainer/compiled.py).
    AttentionInterface.register(VARLEN_ATTENTION, torch.compiler.disable(varlen_sdpa_attention))


def packed_attention_implementation() -> str:
    """flash_attention_2 when it can run (CUDA + the package), else the per-sequence SDPA."""
    try:
        from transformers.utils import is_flash_attn_2_available
        if torch.cuda.is_available() and is_flash_attn_2_available():
            return "flash_attention_2"
    except ImportError:
        pass
    _register_varlen_attention()
    return VARLEN_ATTENTION


def plain_output_weight(model) -> torch.Tensor | None:
    """The output layer's weight when a model's logits are exactly hidden @ weight.T (a Linear
    without bias, no logit scale or soft-capping, not wrapped by an adapter), else None."""
    head = model.get_output_embeddings()
    cfg = model.config
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    return head.weight


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


class TorchBackend(TrainBackend):
    def __init__(self, cfg, model_dir: Path, seed: int, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model_dir = Path(model_dir)
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world_size
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(seed)
        # trainer.recompute: true, false, or auto (chosen by memory before the model takes any:
        # trainer/recompute.py); self.cfg.recompute is the decision from here on.
        self.recompute_choice = recompute.decide(cfg, self.model_dir, self.world_size, self.device, "torch")
        self.cfg = cfg = recompute.resolved(cfg, self.recompute_choice.on)
        attention_without_cudnn()   # a graph build per new sequence length (services/protocol/runtime.py)
        attn = packed_attention_implementation() if cfg.packed_forward else "sdpa"
        # Where a pack's bounds go: flash-attn's kernels read them on the device; the per-sequence
        # SDPA splits the pack on the host, and reading a device copy there would wait for the
        # GPU in every layer (tests/unit/trainer/test_host_reads.py).
        self.bounds_device = self.device if attn == "flash_attention_2" else torch.device("cpu")
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype, attn_implementation=attn)
        # LoRA's settings (trainer/lora.py) when the adapters train instead of the whole model;
        # wrapped on the CPU, so the adapters' initial values are the same on every device.
        self.lora = lora.lora_settings(cfg.lora) if cfg.lora.rank > 0 else None
        if self.lora is not None:
            model = lora.wrap(model, self.lora, seed)
        self.model = model.to(self.device)
        self.model.eval()
        # MoE routers that replay the sampler's experts (trainer.routing_replay) and, either way,
        # count their agreement with them (trainer/routing_replay.py); nothing on a dense model.
        self.routing = RouterReplay(self.model, getattr(cfg, "routing_replay", False))
        self.routing.recompute = cfg.recompute
        if cfg.recompute:
            recompute_layers(self.model)
        self.chunk_fn = None   # trainer/logprobs.py's own
        if cfg.compile:
            log.info("trainer.compile: %d decoder layers compile on their first forward (the first steps "
                     "take longer, once per kind of pass)", compiled.compile_layers(self.model))
            self.chunk_fn = compiled.compiled_chunk_fn()
        o = cfg.optim
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        # Fused: one kernel over all the tensors instead of foreach's several passes (read and
        # write of weights, gradients and both moments: a few ms of a 0.5B step on a GPU). On the
        # CPU too, so the CPU tiers run the optimizer a GPU runs, with its rules (one device, and
        # floating-point parameters only).
        self.optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=True)
        total = decay_updates(cfg)   # warm-up, then constant, linear or cosine (lr_schedule.py)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda k: lr_factor(o, k, total))

    # ---- forward ------------------------------------------------------------------------------
    def _forward(self, mb: PackedBatch, temperature: float, with_entropy: bool, model=None) -> TokenOutputs:
        """Every forward (training, proximal, reference) under trainer.compute_dtype: with bfloat16
        the matrix products run in bf16 under torch.autocast (the backward pass follows the dtypes
        the forward recorded, and the log-prob chunks' recomputation re-enters the same autocast),
        while the parameters, their gradients and AdamW stay in the model's dtype."""
        bf16 = self.cfg.compute_dtype == "bfloat16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            return self._forward_in_dtype(mb, temperature, with_entropy, model)

    def _forward_in_dtype(self, mb: PackedBatch, temperature: float, with_entropy: bool, model=None
                          ) -> TokenOutputs:
        model = model if model is not None else self.model
        replay = self.routing if model is self.model else self._ref_routing
        routes = mb.fields.get("routed_experts") if replay.routers else None
        ids = to_device(mb.input_ids, self.device)
        routes = None if routes is None else to_device(routes, self.device)
        replay.set_routes(routes)
        if mb.n_tokens == 0:
            z = torch.zeros(0, device=self.device)
            return TokenOutputs(logp=z, entropy=z if with_entropy else None)
        if self.cfg.packed_forward:
            cu = to_device(mb.cu_seqlens.to(torch.int32), self.bounds_device)
            longest = max(mb.seqlens())
            return self._token_outputs(model, ids, mb.cu_seqlens, temperature, with_entropy,
                                       position_ids=to_device(mb.position_ids, self.device)[None], cu_seq_lens_q=cu,
                                       cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        cu = mb.cu_seqlens.tolist()
        if routes is not None and self.cfg.recompute and mb.n_seqs > 1:
            # a recomputing backward would re-run every sequence under the last one's routes
            raise ValueError("routing replay with trainer.recompute needs trainer.packed_forward")
        parts = []
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            if routes is not None:
                replay.set_routes(routes[a:b])
            parts.append(self._token_outputs(model, ids[a:b], torch.tensor([0, b - a]), temperature, with_entropy))
        return TokenOutputs(logp=torch.cat([p.logp for p in parts]),
                            entropy=torch.cat([p.entropy for p in parts]) if with_entropy else None)

    def _token_outputs(self, model, ids: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float,
                       with_entropy: bool, **inputs) -> TokenOutputs:
        """One forward of `ids` (a packed row or one sequence) and its token log-probs. With
        chunks and a plain output layer, the decoder's hidden states go to the log-prob step with
        the output layer's weight, so the logits are made a chunk at a time (trainer/logprobs.py)."""
        grad = self.entropy_grad and torch.is_grad_enabled()
        chunk = self.cfg.logprob_chunk
        head = plain_output_weight(model) if chunk > 0 else None
        if head is None:
            logits = model(input_ids=ids[None], use_cache=False, **inputs).logits[0]
            return token_logprobs(logits, ids, cu_seqlens, temperature, with_entropy, grad, chunk,
                                  chunk_fn=self.chunk_fn)
        hidden = model.get_decoder()(input_ids=ids[None], use_cache=False, **inputs).last_hidden_state[0]
        return token_logprobs(hidden, ids, cu_seqlens, temperature, with_entropy, grad, chunk, head=head,
                              chunk_fn=self.chunk_fn)

    @torch.no_grad()
    def forward_logprobs(self, mb: PackedBatch, temperature: float, *, with_entropy: bool = False
                         ) -> TokenOutputs:
        out = self._forward(mb, temperature, with_entropy)
        return TokenOutputs(logp=out.logp.cpu(), entropy=None if out.entropy is None else out.entropy.cpu())

    @torch.no_grad()
    def forward_ref_logprobs(self, mb: PackedBatch, temperature: float) -> TokenOutputs:
        """The initial policy: a frozen copy of experiment.model, loaded on first use (one more
        model in memory, and one more forward per step, for a KL penalty). With LoRA it is the
        trained model itself with its adapters off: its frozen weights are experiment.model's."""
        if self.lora is not None:
            with self.model.disable_adapter():
                return TokenOutputs(logp=self._forward(mb, temperature, False).logp.cpu())
        if getattr(self, "_ref_model", None) is None:
            from transformers import AutoModelForCausalLM
            self._ref_model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=next(self.model.parameters()).dtype,
                attn_implementation=self.model.config._attn_implementation).to(self.device)
            self._ref_model.eval().requires_grad_(False)
            self._ref_routing = RouterReplay(self._ref_model, self.routing.replay)
        out = self._forward(mb, temperature, False, model=self._ref_model)
        return TokenOutputs(logp=out.logp.cpu())

    # ---- update -------------------------------------------------------------------------------
    def train_step(self, mbs: list[PackedBatch], loss_fn: LossFn, temperature: float) -> StepResult:
        self.optimizer.zero_grad(set_to_none=False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        stats: dict = {}
        self.routing.clear_stacks()
        for mb in mbs:
            if mb.n_tokens == 0:
                continue
            mb = mb.on(self.device)
            out = self._forward(mb, temperature, with_entropy=True)
            loss, mb_stats = loss_fn(mb, out)
            loss.backward()
            add_stats(stats, mb_stats)
        stats = stats_on_host(stats)
        lr = self.optimizer.param_groups[0]["lr"]
        nonfinite = agreed_nonfinite(stats)
        if nonfinite:   # the loop names the terms and stops the step
            self.optimizer.zero_grad(set_to_none=False)
            return StepResult(grad_norm=math.nan, lr=lr, stats=stats, applied=False, nonfinite=nonfinite)
        if self.world_size > 1:
            self._all_reduce_grads(params)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if not math.isfinite(grad_norm):
            log.warning("non-finite gradient norm %s: update skipped", grad_norm)
            self.optimizer.zero_grad(set_to_none=False)
            return StepResult(grad_norm=grad_norm, lr=lr, stats=stats, applied=False)
        self.optimizer.step()
        self.scheduler.step()
        return StepResult(grad_norm=grad_norm, lr=lr, stats=stats)

    def _all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks in one flat buffer (one collective instead of one per tensor)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        collectives.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p).clone()
            offset += n

    def step_metrics(self) -> dict[str, float]:
        """MoE models: `moe_router_agreement`, the fraction of recorded token-layer top-k sets the
        trainer's own routers chose too, over the step's forwards and every rank (collective)."""
        if not self.routing.routers:
            return {}
        counts = torch.tensor(self.routing.take_agreement(), dtype=torch.float64)
        if self.world_size > 1:
            collectives.all_reduce(counts)
        agreeing, compared = counts.tolist()
        return {"moe_router_agreement": agreeing / compared} if compared else {}

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # A snapshot on the CPU: the live optimizer state keeps changing in place. With LoRA the
        # adapters alone (and the settings they were trained with) instead of the whole model.
        weights = ({"model": self.model.state_dict()} if self.lora is None else
                   {"adapter": lora.adapter_state(self.model), "lora": dict(self.lora)})
        return _cpu_copy({**weights, "optimizer": self.optimizer.state_dict(),
                          "scheduler": self.scheduler.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("lora")
        if saved != self.lora:
            held = f"LoRA adapters {saved}" if saved else "the whole model (trained without trainer.lora)"
            want = f"trainer.lora {self.lora}" if self.lora else "trainer.lora.rank: 0"
            raise ValueError(f"the checkpoint holds {held}, but this run has {want}: resume with the "
                             f"trainer.lora settings it was trained with")
        if self.lora is None:
            self.model.load_state_dict(state["model"])
        else:
            lora.load_adapter_state(self.model, state["adapter"])
        self.optimizer.load_state_dict(_cpu_copy(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])

    def export_hf(self, out_dir: Path) -> None:
        if self.rank != 0:
            return
        if self.lora is not None and self.cfg.lora.sync == "adapter":   # peft's adapter directory
            lora.save_adapter(self.model, self.model_dir, out_dir, tokenizer=False)
            return
        if self.lora is not None:   # the merged model under the plain names
            lora.save_merged(self.model, self.model_dir, out_dir)
            return
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir, safe_serialization=True)
        copy_tokenizer_files(self.model_dir, out_dir)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora is not None:   # merged, under the plain model's names and order
            yield from lora.merged_tensors(self.model)
            return
        for name, p in self.model.named_parameters():
            yield from hub_tensors(name, p.detach())   # a MoE's fused experts under the Hub's names
