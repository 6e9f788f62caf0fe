"""The simulator's costs of a mixture-of-experts model (launcher/simulate/costs.py): a decode step
reads the dense weights and the experts its tokens route to (few at batch 1, all at a large
batch) and multiplies by the active parameters; training computes with the active parameters,
reduces the experts' gradients over the ranks holding the same experts, and pays expert
parallelism's all-to-alls. A dense model's costs are what they were (the other simulator tests)."""
from __future__ import annotations

import pytest

from tandem.launcher.simulate.costs import Layout, physical_costs
from tandem.launcher.simulate.hardware import load_gpu, load_model_shape

GPU = load_gpu("H100")
MOE = load_model_shape("Qwen3-30B-A3B")


def _costs(model, ep: int = 1, dp_gpus: int = 16):
    layout = Layout(gen_tp=2, num_servers=8, train_gpus=dp_gpus, train_tp=1, train_pp=1, gpus_per_node=8,
                    train_ep=ep)
    return physical_costs(GPU, model, layout, mem_fraction=0.85, max_running=256, weight_sync="disk",
                          disk_gbps=2.0)


def test_a_decode_step_reads_the_experts_its_tokens_route_to():
    c, e = _costs(MOE), GPU.eff
    expert_w = 2 * MOE.layers * MOE.expert_layer_params
    dense_w = MOE.weight_bytes - expert_w
    read = (dense_w + expert_w * 8 / 128) / 2 / (GPU.memory_bw * e.decode_bw)   # batch 1: 8 of 128 experts
    tp_s = 2 * MOE.layers * e.allreduce_latency_s
    tp_per_seq = 2 * MOE.layers * 2 * (2 - 1) / 2 * MOE.hidden * 2 / (GPU.nvlink_bw * e.network)
    assert c.decode_fixed[1] == pytest.approx(read + e.decode_step_overhead_s + tp_s + tp_per_seq, rel=1e-12)
    every_expert = MOE.weight_bytes / 2 / (GPU.memory_bw * e.decode_bw)
    assert read < every_expert / 4   # the 30B model reads about 3.7B parameters' bytes at batch 1
    assert MOE.experts_touched(256) == pytest.approx(1.0, abs=1e-6)   # a large batch touches them all


def test_training_prices_the_active_parameters_and_the_expert_groups():
    one, eight = _costs(MOE, ep=1), _costs(MOE, ep=8)
    e = GPU.eff
    assert one.train_per_token == pytest.approx(8 * MOE.matmul_params / (16 * GPU.bf16_flops * e.train_mfu))
    a2a = 6 * 8 * MOE.hidden * 2 * MOE.layers * 7 / 8 / (16 * GPU.nvlink_bw * e.network)
    assert eight.train_per_token == pytest.approx(one.train_per_token + a2a, rel=1e-12)
    # gradients: the dense part over 16 ranks, each rank's 1/8 of the experts over the 2 holding them
    expert_w = 2 * MOE.layers * MOE.expert_layer_params
    dense_w = MOE.weight_bytes - expert_w
    bw = GPU.node_network_bw / GPU.gpus_per_node * e.network     # 16 trainer GPUs span two nodes
    sync = 2 * 15 / 16 * dense_w / bw + 2 * 1 / 2 * expert_w / 8 / bw
    optim = 8 * (dense_w + expert_w / 8) / GPU.memory_bw
    assert eight.train_fixed == pytest.approx(sync + optim, rel=1e-12)
    assert eight.train_fixed < one.train_fixed


def test_a_dense_shape_is_priced_by_the_dense_formulas():
    """No experts: the decode step reads every weight, the gradients are reduced over DP alone, and
    there is no all-to-all, whatever trainer.expert_parallel says."""
    dense = load_model_shape("R1-Distill-Qwen-7B")
    c, e = _costs(dense), GPU.eff
    w = dense.weight_bytes
    read = w / 2 / (GPU.memory_bw * e.decode_bw)
    flop = 2 * dense.matmul_params / (2 * GPU.bf16_flops * e.decode_mfu)
    tp_s = 2 * dense.layers * e.allreduce_latency_s
    tp_per_seq = 2 * dense.layers * 2 * (2 - 1) / 2 * dense.hidden * 2 / (GPU.nvlink_bw * e.network)
    assert c.decode_fixed[1] == pytest.approx(max(read, flop) + e.decode_step_overhead_s + tp_s + tp_per_seq, rel=1e-12)
    bw = GPU.node_network_bw / GPU.gpus_per_node * e.network
    assert c.train_fixed == pytest.approx(2 * 15 / 16 * w / bw + 8 * w / GPU.memory_bw, rel=1e-12)
    assert c.train_per_token == pytest.approx(8 * dense.matmul_params / (16 * GPU.bf16_flops * e.train_mfu))
    assert _costs(dense, ep=8).train_per_token == c.train_per_token and dense.experts_touched(1) == 1.0
