"""The simulator's own settings (section `simulate`); everything else comes from the experiment."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SimulateConfig:
    """`tandem simulate` / `tandem plan --suggest`: the cluster and workload assumptions.

    Server limits come from the `gen` section (tp_size, max_running_requests,
    mem_fraction_static), the trainer layout from `trainer`, the cluster from `launcher`,
    interruptible generation from `controller.interruptible`.
    """
    # GPU type: a name in configs/hardware/ (H800, H100, A100) or a path to such a YAML file.
    hardware: str = "H800"
    # Model shape: a name in configs/hardware/models.yaml (e.g. R1-Distill-Qwen-1.5B); empty =
    # read config.json of experiment.model, else the models.yaml entry its directory name matches.
    model_size: str = ""
    # Prompt length in tokens (every prompt).
    prompt_tokens: int = 512
    # Output lengths: lognormal (median, sigma below, clipped to [1, rollout.max_new_tokens]),
    # fixed (every output is output_median tokens), or empirical:PATH (a run's metrics.jsonl or
    # trajectory JSONL file: records with `output_tokens`, or an experiment directory).
    output_lengths: str = "lognormal"
    output_median: int = 4096
    # Log-space standard deviation of the lognormal: larger = longer tail.
    output_sigma: float = 1.0
    # Output lengths grow during the run by this factor (reasoning models lengthen their answers
    # during RL, so the best generation:training split moves; `--elastic` prices following it):
    # the i-th of the N samples a simulated run admits gets its drawn length times
    # length_growth ** (i / N), clipped to rollout.max_new_tokens. The simulated steps stand for
    # the whole run. 1.0 = no growth.
    length_growth: float = 1.0
    # Synchronous colocated baseline: every GPU generates, then every GPU trains (needs eta = 0).
    colocated: bool = False
    # Aggregate shared-filesystem bandwidth in GB/s for trainer.weight_sync: disk (every server
    # reads its own copy through it). An assumption; measure yours.
    disk_gbps: float = 20.0
    # Chunked generation (rollout.new_tokens_per_chunk): a request sent again at a chunk
    # boundary finds its prompt + output so far in its server's radix cache (SGLang keeps a
    # finished request's prefix; the client sends the next chunk to the same server at once), so
    # it costs one scheduling round and a prefill of its one uncached token; a weight load
    # flushes the cache, so across an update it is prefilled in full. false = every chunk
    # prefills prompt + output in full (no prefix cache, e.g. --disable-radix-cache).
    chunk_prefix_cached: bool = True
    # Seconds to grade one group (reward service latency); 0 with --calibrate: the run's median.
    reward_s: float = 0.0
    # Training steps measured per configuration (rates are averaged over them).
    steps: int = 6
    # Steps simulated before measuring; raised to eta + 1 when smaller, so the staleness
    # pipeline has filled (shorter warm-ups under-estimate asynchronous runs by up to ~15%).
    warmup_steps: int = 2
    # Seed of the simulated output lengths (same seed = same workload in every sweep point).
    seed: int = 0
    # Simulate 1/k of the cluster: k times fewer groups per step (k must divide them) and
    # servers (rounded), the trainer priced for the whole batch, rates scaled back up. Servers
    # are interchangeable, so this changes little while >= 4 servers and >= 1,024 samples per
    # step remain, and makes big configurations k times faster. 0 = the largest such k (rounding
    # the servers by at most 2%); 1 = simulate everything.
    shrink: int = 0

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.prompt_tokens < 1:
            out.append(("prompt_tokens", "must be >= 1"))
        kind = self.output_lengths.split(":", 1)[0]
        if kind not in ("lognormal", "fixed", "empirical"):
            out.append(("output_lengths", f"must be lognormal, fixed or empirical:PATH, "
                                          f"got {self.output_lengths!r}"))
        if kind == "empirical" and not self.output_lengths.partition(":")[2]:
            out.append(("output_lengths", "empirical needs a path: empirical:PATH"))
        if self.output_median < 1:
            out.append(("output_median", "must be >= 1"))
        if self.output_sigma < 0:
            out.append(("output_sigma", "must be >= 0"))
        if self.length_growth < 1:
            # Lengths drawn past max_new_tokens are clipped before they grow, so a shrinking
            # workload would shorten answers whose real length is unknown.
            out.append(("length_growth", f"must be >= 1 (1 = lengths do not grow; 8 = the last answers "
                                         f"8x the first), got {self.length_growth}"))
        if self.disk_gbps <= 0:
            out.append(("disk_gbps", "must be > 0"))
        if self.reward_s < 0:
            out.append(("reward_s", "must be >= 0"))
        if self.steps < 1:
            out.append(("steps", "must be >= 1"))
        if self.warmup_steps < 0:
            out.append(("warmup_steps", "must be >= 0"))
        if self.shrink < 0:
            out.append(("shrink", "must be >= 0 (0 = automatic, 1 = the whole cluster)"))
        return out
