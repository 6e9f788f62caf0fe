"""The embedded generation server: SGLang's RL subset of HTTP endpoints, on CPU, for any HF causal LM.

SGLang needs CUDA, so a laptop or CI machine cannot run it; this package serves the same API
with transformers + torch so every other role (rollout workers, controller weight sync) runs the
identical client code here and on a GPU cluster. Modules: `sampling` (request parameters and the
sampling/log-prob convention), `kv_batch` (the running batch's KV cache), `engine` (the continuous
batching loop), `weights` (disk and torch.distributed updates), `http_api` (routes), `main`
(the `tandem gen serve` process).
"""
