"""The GPU roles keep PyTorch's cuDNN attention off (services/protocol/runtime.py
`attention_without_cudnn`): cuDNN builds an execution graph per new shape, which most likely
made the embedded server's bf16 decoding 15 times slower than float32 on an H200 (every step
attends over one more column); the trainers' sequences have a new length at almost every step too.

On the CPU the backend flag is all there is to see (cuDNN attention exists only on CUDA, where
`scaled_dot_product_attention` consults this flag): each test turns it on, makes the component
as its role does, and checks the component turned it off. The Megatron backend's check is in
tests/unit/megatron/test_megatron_api_contract.py (its process-group fixture)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cudnn_attention_on():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_the_torch_backend_turns_cudnn_attention_off(cudnn_attention_on, small_model_dir):
    from tandem.trainer.config import TrainerConfig
    from tandem.trainer.torch_backend import TorchBackend

    TorchBackend(TrainerConfig(backend="torch"), small_model_dir, seed=0)
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_the_embedded_servers_engine_turns_cudnn_attention_off(cudnn_attention_on, small_model_dir):
    from tandem.rollout.server.main import load_engine

    engine = load_engine(str(small_model_dir), max_running=4, prefill_tokens_per_step=64, dtype="float32",
                         weight_version="0", seed=0)
    try:
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        engine.stop()
