"""Config sections owned by the rollout package: `rollout` (workers) and `gen` (servers)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.rollout.prompt_template import template_problem

# The fields of a row `rollout.columns` may map, each with the columns rollout/dataset.py reads
# it from when it is not mapped (the first of them there).
DEFAULT_COLUMNS = {
    "prompt": ("problem", "prompt", "question"),
    "answer": ("answer", "solution_answer"),
    "tests": ("tests", "input_output"),
    "visible_tests": ("visible_tests",),
    "id": ("id", "idx"),
}


def columns_problems(columns: dict) -> list[tuple[str, str]]:
    """(field, message) for each entry of a column mapping that cannot be used."""
    out = []
    for name, col in columns.items():
        if name not in DEFAULT_COLUMNS:
            out.append((name, f"not a field of a row; map one of {', '.join(DEFAULT_COLUMNS)}"))
        elif not isinstance(col, str) or not col:
            out.append((name, "must name a column"))
    return out


@dataclass
class RolloutConfig:
    """Rollout workers: which prompts, how many samples, how they are generated and graded."""
    # Prompt data: a JSONL or Parquet file, a directory written by datasets' `save_to_disk`
    # (DeepScaleR-style math or DeepCoder-style code rows), or `synthetic:math` /
    # `synthetic:code` for the generated tasks of the embedded default.
    dataset: str = "synthetic:math"
    # Which column gives each field of a row, e.g. {prompt: question, answer: final_answer}
    # (fields: prompt, answer, tests, visible_tests, id); an unmapped field is read from its
    # usual columns, the first there (prompt: problem, prompt or question; answer: answer or
    # solution_answer; tests: tests or input_output; id: id or idx).
    columns: dict[str, str] = field(default_factory=dict)
    # A system message put before every problem ("" = none).
    system_prompt: str = ""
    # The user message around each problem: a format string with `{prompt}` (literal braces
    # doubled: `\boxed{{}}`); "" = the problem as it is. The chat template renders both.
    prompt_template: str = ""
    # Size of the synthetic data set (ignored for files).
    synthetic_size: int = 20000
    # Samples generated per prompt (the group size n).
    n_samples: int = 8
    # Sampling temperature; the trainer applies the same one to its logits.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    # New tokens one /generate request asks for at most (0: the whole answer in one request): the
    # client resubmits prompt + output so far until the answer ends (AReaL's new_tokens_per_chunk).
    # With controller.interruptible: false a weight update then waits for one chunk of each running
    # request instead of whole answers; each chunk after the first prefills prompt + output again.
    new_tokens_per_chunk: int = 0
    # Longest prompt (tokens, after the chat template) a group may have: a longer one is rejected
    # by its worker (counted as rejected, never trained). With max_new_tokens it bounds a sequence,
    # which must fit trainer.max_tokens_per_mb (the config check refuses less; verl's
    # data.max_prompt_length).
    max_prompt_tokens: int = 2048
    # Worker processes; each runs many episodes concurrently.
    num_workers: int = 1
    # Episodes a worker runs concurrently.
    concurrency: int = 64
    # The episode function, `module:function` (see rollout/workflow.py); multi-turn code with
    # execution feedback: `tandem.rollout.code_feedback:code_with_feedback`.
    workflow: str = "tandem.rollout.workflow:single_turn"
    # Multi-turn workflows (e.g. tandem.rollout.code_feedback:code_with_feedback): model turns per sample;
    # with an agent, completions per episode.
    max_turns: int = 3
    # An agent to train, `module:function`: an async function (row, client) that talks to the model
    # through an OpenAI-compatible client, runs its tools and returns the episode's reward
    # (docs/agents.md). Replaces `workflow`; "" = none.
    agent: str = ""
    # Seconds an agent episode may take; past them it ends with agent_limit_reward.
    agent_timeout_s: float = 600.0
    # Tokens an agent episode may hold (first prompt, completions, tool results); 0 =
    # max_prompt_tokens + max_turns * max_new_tokens. An episode at the limit ends with agent_limit_reward.
    agent_context_tokens: int = 0
    # The reward of an episode ended by a limit (turns, context, time) or a tool failure the
    # Toolbox was told to end it on; null = reward.wrong_reward.
    agent_limit_reward: float | None = None
    # How the model writes tool calls: hermes (Qwen, Hermes: <tool_call>), llama3 or mistral;
    # "" = the format the model's chat template teaches (hermes when it teaches none).
    tool_call_format: str = ""
    # The factor a correct answer's reward takes per turn before it (turn k: turn_discount^(k-1)).
    turn_discount: float = 1.0
    # Characters of environment feedback shown per turn.
    feedback_chars: int = 300
    # Drop groups whose samples all got the same reward (no learning signal), DAPO-style.
    filter_all_equal: bool = False
    # Attempts for one generation request before the group is failed.
    max_attempts: int = 3
    # Seconds a reward request may take before the group is failed.
    reward_timeout_s: float = 120.0
    # Seconds between heartbeats to the controller (must be well under controller.lease_s).
    heartbeat_s: float = 5.0
    # Held-out problems scored greedily before and after a run (0 = no evaluation).
    eval_size: int = 0
    # Held-out data set (same formats as dataset); empty = fresh synthetic problems never drawn
    # for training.
    eval_dataset: str = ""
    # The column mapping of eval_dataset ({} = the same as columns).
    eval_columns: dict[str, str] = field(default_factory=dict)
    # Policy versions between held-out evaluations during training (0 = none): rollout worker
    # 0 scores the same problems greedily beside its episodes; `eval` records, the report's curve.
    eval_every: int = 0
    # Held-out problems per evaluation during training (0 = eval_size).
    eval_every_size: int = 0

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.n_samples < 1:
            out.append(("n_samples", "must be >= 1"))
        if self.temperature <= 0:
            out.append(("temperature", "must be > 0"))
        if self.max_new_tokens < 1:
            out.append(("max_new_tokens", "must be >= 1"))
        if self.new_tokens_per_chunk < 0:
            out.append(("new_tokens_per_chunk", f"must be >= 0 (0: no chunks), got {self.new_tokens_per_chunk}"))
        if self.max_prompt_tokens < 1:
            out.append(("max_prompt_tokens", "must be >= 1"))
        if not (0 < self.top_p <= 1):
            out.append(("top_p", "must be in (0, 1]"))
        if self.concurrency < 1 or self.num_workers < 1:
            out.append(("concurrency" if self.concurrency < 1 else "num_workers", "must be >= 1"))
        if ":" not in self.workflow:
            out.append(("workflow", f"must look like 'module:function', got {self.workflow!r}"))
        if not self.dataset:
            out.append(("dataset", "must name a data set (a .jsonl or .parquet file, a save_to_disk "
                                   "directory) or synthetic:math|code"))
        for key in ("columns", "eval_columns"):
            out += [(f"{key}.{name}", problem) for name, problem in columns_problems(getattr(self, key))]
        problem = template_problem(self.prompt_template)
        if problem:
            out.append(("prompt_template", problem))
        if self.max_turns < 1:
            out.append(("max_turns", "must be >= 1"))
        out += self._agent_problems()
        if not (0 < self.turn_discount <= 1):
            out.append(("turn_discount", "must be in (0, 1]"))
        if self.feedback_chars < 20:
            out.append(("feedback_chars", "must be >= 20"))
        if self.max_attempts < 1:
            out.append(("max_attempts", "must be >= 1"))
        if self.eval_every < 0 or self.eval_every_size < 0:
            out.append(("eval_every" if self.eval_every < 0 else "eval_every_size", "must be >= 0"))
        elif self.eval_every and not (self.eval_every_size or self.eval_size):
            out.append(("eval_every", "needs held-out problems: set eval_size or eval_every_size"))
        return out

    def _agent_problems(self) -> list[tuple[str, str]]:
        from tandem.rollout.tool_calls import FORMATS

        out = []
        if self.agent and ":" not in self.agent:
            out.append(("agent", f"must look like 'module:function', got {self.agent!r}"))
        if self.agent and self.workflow != "tandem.rollout.workflow:single_turn":
            out.append(("agent", f"replaces the workflow: leave rollout.workflow out (it is {self.workflow!r})"))
        if self.agent_timeout_s <= 0:
            out.append(("agent_timeout_s", "must be > 0"))
        if self.agent_context_tokens < 0:
            out.append(("agent_context_tokens", "must be >= 0 (0: max_prompt_tokens + max_turns * max_new_tokens)"))
        if self.tool_call_format and self.tool_call_format not in FORMATS:
            out.append(("tool_call_format", f"must be one of {', '.join(FORMATS)} or \"\" (from the chat template), "
                                            f"got {self.tool_call_format!r}"))
        return out


# The values of gen.device (rollout/server/main.py `resolve_device` turns them into a device).
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class GenConfig:
    """Generation servers: the embedded server (CPU or one GPU) or SGLang on GPUs (same HTTP API)."""
    # embedded: Tandem's own server (CPU, or one CUDA GPU, see device); sglang: SGLang servers on
    # GPUs (same HTTP API).
    backend: str = "embedded"
    # Generation servers (embedded: processes on this machine; sglang: one per tp_size GPUs).
    num_servers: int = 1
    # Torch threads of each embedded server (0: 1). The local launcher with launcher.cpus.pin
    # gives each server as many threads as its CPU set instead.
    threads: int = 1
    # Most sequences one embedded server decodes together (the running batch).
    max_running_requests: int = 64
    # Prompt tokens an embedded server prefills per engine step before decoding again.
    prefill_tokens_per_step: int = 2048
    # Weights dtype of the embedded server (float32 keeps log-probs exact on CPU).
    dtype: str = "float32"
    # Where an embedded server runs its model: auto (cuda when torch sees a CUDA device, else
    # cpu), cpu or cuda (the first GPU the process sees: the launcher's CUDA_VISIBLE_DEVICES
    # picks which). cuda without a CUDA device stops the server before it starts, naming this
    # field (the server checks, not the config check: the launching machine may have no GPU).
    device: str = "auto"
    # Seeds unseeded requests' sampling (server rank is added).
    seed: int = 0
    # Seconds between two `gen_window` records (decode/prefill timings the simulator calibrates
    # on) an embedded server appends to <exp>/metrics.jsonl; 0 = none.
    metrics_interval_s: float = 5.0
    # SGLang only: tensor-parallel GPUs per server.
    tp_size: int = 1
    # SGLang only: fraction of GPU memory for weights + KV cache.
    mem_fraction_static: float = 0.8
    # SGLang only: extra `python -m sglang.launch_server` arguments, as-is.
    sglang_args: list[str] = field(default_factory=list)
    # SGLang only: start with --enable-deterministic-inference (batch-invariant kernels, slower),
    # the mode in which a request's sampling_seed reproduces its sample. Rollout workers then seed
    # each sample from experiment.seed and its group/sample id (SGLang would give every unseeded
    # request the same seed, making a group's samples identical).
    deterministic_inference: bool = False
    # With trainer.weight_sync: disk, pass each version down a chain of nodes instead of every
    # server reading the shared filesystem: the first node reads it once, each node streams it to
    # the next while it receives it, and the servers load their node's copy (rollout/server/relay.py).
    # The shared filesystem then carries one read per version whatever the number of servers.
    weight_relay: bool = False
    # Where each node keeps its relayed copies (the newest two versions): a node-local directory,
    # shared by that node's servers. "" = /dev/shm/tandem-relay-<uid> (memory-backed).
    relay_dir: str = ""

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.backend not in ("embedded", "sglang"):
            out.append(("backend", f"must be 'embedded' or 'sglang', got {self.backend!r}"))
        if self.num_servers < 1:
            out.append(("num_servers", "must be >= 1"))
        if self.threads < 0:
            out.append(("threads", "must be >= 0"))
        if self.max_running_requests < 1:
            out.append(("max_running_requests", "must be >= 1"))
        if self.prefill_tokens_per_step < 1:
            out.append(("prefill_tokens_per_step", "must be >= 1"))
        if self.dtype not in ("float32", "bfloat16", "float16"):
            out.append(("dtype", f"must be float32, bfloat16 or float16, got {self.dtype!r}"))
        if self.device not in DEVICES:
            out.append(("device", f"must be {', '.join(DEVICES[:-1])} or {DEVICES[-1]}, got {self.device!r}"))
        if self.metrics_interval_s < 0:
            out.append(("metrics_interval_s", "must be >= 0"))
        if self.tp_size < 1:
            out.append(("tp_size", "must be >= 1"))
        if not (0 < self.mem_fraction_static < 1):
            out.append(("mem_fraction_static", "must be in (0, 1)"))
        return out
