"""trainer.compile (trainer/compiled.py): which graphs torch.compile makes of the torch backend,
that they are reused when the pack changes shape, and that they compute the eager numbers.

These tests give torch.compile a recording backend that runs each captured graph as it is
(Inductor generates and builds C++ on a CPU, which starts compiler processes;
test_compiled_backend.py runs Inductor itself). They start no process, but their tracing takes
about 16 s, a quarter of the unit tier's minute: they run in `make test` only."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tandem.trainer.compiled as compiled
from tandem.trainer.config import LoraConfig, TrainerConfig
from tandem.trainer.microbatch import pack
from tandem.trainer.torch_backend import TorchBackend


def cfg(**kw) -> TrainerConfig:
    c = TrainerConfig(temperature=1.0, max_staleness=0, **kw)
    c.optim.lr = 1e-2
    return c


def packs(seed: int, *counts: int) -> list:
    rng = np.random.default_rng(seed)
    return [pack([rng.integers(7, 200, int(k)) for k in rng.integers(2, 30, n)]) for n in counts]


class Recorder:
    """A torch.compile backend that keeps each graph it is given and runs it unchanged."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def calls(self) -> set[str]:
        return {getattr(n.target, "__name__", str(n.target)) for g in self.graphs for n in g.graph.nodes
                if n.op in ("call_function", "call_method", "call_module")}


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", rec)
    with torch._dynamo.config.patch(recompile_limit=8):   # PyTorch's default, restored after
        yield rec
    torch._dynamo.reset()


def _step(be, mbs):
    total = float(sum(mb.n_tokens for mb in mbs))

    def loss_fn(_, out):
        return -out.logp.sum() / total, {}
    lp = be.forward_logprobs(mbs[0], 1.0, with_entropy=True)
    return lp, be.train_step(mbs, loss_fn, 1.0)


def test_compiled_layers_leave_attention_out_reuse_their_graphs_and_give_the_eager_numbers(
        small_model_dir, recorder):
    """Each decoder layer and the log-prob chunk are captured (linear layers and log_softmax in
    the graphs), the packed attention is not (it splits the pack at sizes only the data knows),
    and once the no-gradient and the training forward have run, packs of other lengths and
    sequence counts run the same graphs: a recompilation raises here. Run as captured, the
    graphs give the eager backend's log-probs, entropies and gradient norm exactly."""
    eager = TorchBackend(cfg(), small_model_dir, 0)
    comp = TorchBackend(cfg(compile=True), small_model_dir, 0)
    first = packs(0, 5, 3)
    (lp_e, res_e), (lp_c, res_c) = _step(eager, first), _step(comp, first)
    assert torch.equal(lp_e.logp, lp_c.logp) and torch.equal(lp_e.entropy, lp_c.entropy)
    assert res_c.applied and res_c.grad_norm == res_e.grad_norm
    calls = recorder.calls()
    assert {"linear", "log_softmax"} <= calls, calls
    assert not any("attention" in c for c in calls), calls
    seen = len(recorder.graphs)
    # Room for every kind of pass: past the limit a layer would run eagerly, with a log line only.
    assert torch._dynamo.config.recompile_limit == compiled.RECOMPILE_LIMIT
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, counts in ((1, (7, 2)), (2, (4, 6))):
            _step(comp, packs(seed, *counts))
    assert len(recorder.graphs) == seen


def test_compile_with_lora_and_recompute_trains_the_adapters_as_eager_does(small_model_dir, recorder):
    """peft's LoRA layers inside a compiled decoder layer that trainer.recompute runs again in
    the backward pass: the same gradient norm as eager, and only the adapters move."""
    lora = LoraConfig(rank=4, alpha=8.0)
    eager = TorchBackend(cfg(lora=lora, recompute=True), small_model_dir, 0)
    comp = TorchBackend(cfg(lora=lora, recompute=True, compile=True), small_model_dir, 0)
    mbs = packs(3, 4, 4)
    before = {n: p.detach().clone() for n, p in comp.model.named_parameters()}
    (_, res_e), (_, res_c) = _step(eager, mbs), _step(comp, mbs)
    assert recorder.graphs and res_c.grad_norm == res_e.grad_norm
    moved = {n for n, p in comp.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_" in n for n in moved), moved


def test_compile_needs_decoder_layers_and_is_an_option_of_both_backends():
    # (what it turns on there: tests/unit/megatron/test_megatron_memory_options.py)
    assert not [k for k, _ in cfg(backend="megatron", compile=True).problems() if k == "compile"]
    with pytest.raises(ValueError, match="trainer.compile: Sequential has no transformers decoder layers"):
        compiled.compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
