"""The embedded generation server: SGLang's RL subset of HTTP endpoints, on CPU, for any HF causal LM.

SGLang needs CUDA, so a laptop or CI machine cannot run it; this package serves the same API
with transformers + torch so every other role (rollout workers, controller weight sync) runs the
identical client code here and on a GPU cluster. Modules: `sampling` (request parameters and the
sampling/log-prob convention), `kv_batch` (the running batch's KV cache: `kv_rows` rectangles of
rows decoded in place, `cohorts` the rule that sets long rows apart), `engine` (the continuous
batching loop), `versions` (per-request `weight_versions` spans), `weights` (disk and
torch.distributed updates), `auth` (API and admin keys, SGLang's auth levels), `http_api` (the
application and `/generate`), `control_routes` (pause, abort, flush, weight updates and
sessions), `info_routes` (health, readiness, loads, model and server information), `openai_routes`
(`/v1/models`, `/v1/completions`, `/v1/chat/completions`, streamed or not) with
`openai_requests` (bodies into engine work) and `openai_shapes` (the reply JSON), `main` (the
`tandem gen serve` process). The contract is SGLang 0.5.23's; docs/generation.md tables it.
"""
