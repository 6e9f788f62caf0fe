"""What a simulation takes (SimSetup), what it tracks per sample and group, and what it returns
(SimResult)."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field


class SimulationError(Exception):
    """The configuration cannot run at all (e.g. one request does not fit a server's KV cache)."""


@dataclass
class SimSetup:
    num_servers: int
    groups_per_step: int
    n_samples: int
    eta: int
    max_concurrent_groups: int
    steps: int
    warmup_steps: int
    prompt_tokens: int
    max_new_tokens: int
    interruptible: bool = True
    # An interrupted request goes back to its rollout worker, which sends it again (the server
    # pays Costs.request_s once more: controller.interrupt_mode abort); false = the server keeps
    # it across the update and only re-prefills it (retract).
    resubmit_interrupted: bool = True
    # An interrupted request loses its KV cache and is re-prefilled (abort, retract); false = it
    # keeps the cache of the old weights and goes straight on (in_place).
    reprefill_interrupted: bool = True
    reward_s: float = 0.0
    # trainer.wait_for_ack: the trainer waits until every server holds the new version; else it
    # goes on and only its next publish waits for the previous version's loads.
    wait_for_ack: bool = True
    # Coalesced versions (trainer/announcements.py: coalesces_versions): the trainer publishes
    # while a sync runs, keeping the newest keep_weights versions on disk, and the next sync
    # goes straight to the newest.
    coalesce_versions: bool = False
    keep_weights: int = 3
    # trainer.checkpoint_every (0 = never): the trainer is busy Costs.checkpoint_s after those steps.
    checkpoint_every: int = 0
    # A rollout worker refused by the staleness bound asks again after controller.retry_after_s:
    # on average half of that passes between a new version and the next admissions.
    admit_delay_s: float = 0.0
    # rollout.new_tokens_per_chunk (0 = one request per answer): each request asks for at most
    # this many new tokens and comes back at a chunk boundary to be sent again (a drain waits
    # for at most one chunk of each running request).
    chunk_tokens: int = 0
    # simulate.chunk_prefix_cached: a request sent again at a chunk boundary finds its prompt +
    # output so far in the server's radix cache (unless a weight load flushed it in between);
    # false = it is prefilled in full, as after an interruption.
    chunk_prefix_cached: bool = True


@dataclass
class SimResult:
    steps_per_hour: float
    trajectories_per_s: float
    gen_tokens_per_s: float
    trained_tokens_per_s: float
    gen_utilization: float
    train_utilization: float
    mean_batch: float
    step_times: list[float]
    staleness: Counter = field(default_factory=Counter)
    token_staleness: Counter = field(default_factory=Counter)
    retractions: int = 0
    interrupts: int = 0
    events: int = 0
    # Non-interruptible generation: the share of server time spent draining (admitting nothing
    # while the running requests finish) before a load; and weight syncs per training step.
    drain_fraction: float = 0.0
    syncs_per_step: float = 0.0
    # The longest a server waited for its running requests before a load (the whole run).
    longest_drain_s: float = 0.0
    # Chunked generation: requests sent again at a chunk boundary (in the measured window).
    chunk_resumes: int = 0

    @property
    def step_s(self) -> float:
        return 3600.0 / self.steps_per_hour


class SampleRecord:
    """One sample's request as the simulated server sees it (slots: cheap as a list, but named)."""
    __slots__ = ("gid", "prompt", "target", "generated", "first_version", "start", "base", "sid", "apart",
                 "cached")

    def __init__(self, gid: int, prompt: int, target: int):
        self.gid, self.prompt, self.target = gid, prompt, target
        self.generated = 0.0       # tokens already generated (kept across an interruption)
        self.first_version = -1    # the version its first token was generated with
        self.start = 0.0           # server clock when it (re)started running
        self.base = 0.0            # its context = base + server clock, while running
        self.sid = 0               # id of its current admission (stale heap entries never match)
        self.apart = False         # decoded with the long rows (embedded server, cohorts.py)
        self.cached = -1           # back at a chunk boundary: the version whose radix cache holds it


class GroupRecord:
    """A group's accounting until it is trained."""
    __slots__ = ("remaining", "admit_version", "tokens", "sum_sq", "min_version")

    def __init__(self, samples: int, admit_version: int):
        self.remaining, self.admit_version = samples, admit_version
        self.tokens = self.sum_sq = 0.0
        self.min_version = 1 << 60


def samples_used(setup: SimSetup) -> int:
    """Samples a simulated run can admit, so the output lengths it consumes: every group up to
    the last step's and the eta + 1 steps of groups admitted ahead of it."""
    return setup.groups_per_step * (setup.steps + setup.eta + 1) * setup.n_samples


class ServerState:
    """One simulated generation server: its decode clock, running and queued requests, and
    whether it is loading weights or draining."""
    __slots__ = ("idx", "clock", "n", "base", "t_last", "heap", "run", "queue", "paused",
                 "draining", "drain_from", "drain_admits", "version", "loading_version", "token", "next_clock", "busy",
                 "area")

    def __init__(self, idx: int):
        self.idx = idx
        self.clock = 0.0      # decode steps done (continuous)
        self.n = 0            # running sequences
        self.base = 0.0       # context of running sequences = base + n * clock
        self.t_last = 0.0     # time up to which clock is accounted (or prefill/load end)
        self.heap: list = []  # (finish clock, sequence id)
        self.run: dict = {}   # sequence id -> record, in admission order
        self.queue: deque = deque()
        self.paused = False
        self.draining = False
        self.drain_from = 0.0  # when the current drain began
        # Draining: how many requests at the front of `queue` were submitted before the drain
        # began. They still run before the load (SGLang's update waits for every request
        # that holds its reader lock, queued ones included); later arrivals wait for the load.
        self.drain_admits = 0
        self.version = 0
        self.loading_version = 0
        self.token = 0
        self.next_clock = 0.0
        self.busy = 0.0       # seconds decoding or prefilling
        self.area = 0.0       # integral of n over decoding time
