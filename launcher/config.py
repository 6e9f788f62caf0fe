"""The experiment config: each package's section composed into one typed object.

Loading is YAML file + command-line dotlist overrides + `${...}` interpolation, validated
against the dataclasses. Every mistake becomes one `ConfigError` naming the key and where it
came from (file and line, or the override), so the CLI can print it and exit 2 without a
traceback.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tandem.launcher.config_source import (
    ConfigError,
    Provenance,
    copies_in,
    dotted_keys,
    explain,
    merged,
    merged_naming_each_culprit,
    read_yaml,
    scalars,
)
from tandem.launcher.simulate.config import SimulateConfig
from tandem.reward.config import RewardConfig
from tandem.rollout.config import GenConfig, RolloutConfig
from tandem.services.config import ControllerConfig
from tandem.services.protocol.trackers import WandbConfig, tracker_problems
from tandem.trainer.config import TrainerConfig
from tandem.trainer.presets import PRESETS, preset_values


@dataclass
class ExperimentSection:
    """What the run is and where its files go."""
    # Names the run; the default exp_dir derives from it.
    name: str = MISSING
    # Relative paths are taken from the working directory at load time.
    exp_dir: str = "runs/${experiment.name}"
    # Seeds data shuffling, sampling and initialisation.
    seed: int = 1
    # Hugging Face model directory the run starts from (generation servers and trainer).
    model: str = MISSING
    # Where metrics go: jsonl (<exp>/metrics.jsonl, always written), tensorboard (<exp>/tb/),
    # wandb (see experiment.wandb); the trainer's rank 0 feeds them from metrics.jsonl.
    trackers: list[str] = field(default_factory=lambda: ["jsonl"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # false: exp_dir and everything the run writes are yours alone (0700 directories, 0600
    # files); true: your group may read them (0750 / 0640), never write. Others: never
    # (services/protocol/private.py; docs/cluster.md, "Running on a shared cluster").
    group_access: bool = False

    def problems(self) -> list[tuple[str, str]]:
        return tracker_problems(self.trackers, self.wandb)


@dataclass
class SlurmSection:
    """sbatch settings for `launcher.backend: slurm` (passed to submitit)."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"
    constraint: str | None = None
    exclusive: bool = True
    # Extra sbatch parameters passed to submitit as-is, e.g. {mail-type: END}.
    extra: dict[str, Any] = field(default_factory=dict)
    # Partition of the CPU-only roles (controller, reward, rollout workers); null = partition.
    cpu_partition: str | None = None
    # teardown: a failed role cancels every job; resubmit: restartable roles (not the trainer)
    # are resubmitted, up to max_resubmits times each.
    on_failure: str = "teardown"
    max_resubmits: int = 2
    # Seconds between two job-state polls (one squeue + one sacct call).
    poll_s: float = 15.0
    # Seconds from submission (queue wait included) until a role must have announced itself.
    ready_timeout_s: float = 3600.0
    # Shell lines run in every job before the role, e.g. ["module load cuda/12.4"].
    setup: list[str] = field(default_factory=list)
    # Address generation servers bind and publish; "{node}" = the SLURM node name of their job.
    bind_host: str = "{node}"
    # Seconds a role's job goes on without word from its launcher (a heartbeat file in
    # <exp>/services/, renewed every tenth of this): then it stops its role (SIGTERM: the trainer
    # checkpoints) and ends, so a launcher killed outright (SIGKILL, OOM, its node lost) does not
    # leave the jobs holding their GPUs until their time limit. 0 = jobs never stop on their own.
    launcher_lease_s: float = 600.0
    # Times the launcher continues the run by itself from its last checkpoint (as --resume) when a job
    # ends by the cluster's doing (time limit, preemption, lost node; never a crash, OOM, cancel or the
    # same end at the same step twice), and slurm/train.sbatch's job requeues itself. 0 = never
    # (docs/cluster.md, "Runs that last days").
    auto_resume: int = 3
    # Seconds before the first automatic continuation, doubled before each next one (at most 16x).
    auto_resume_backoff_s: float = 60.0

    def problems(self) -> list[tuple[str, str]]:
        out = []
        for key, zero in (("auto_resume", "never continue by itself"), ("auto_resume_backoff_s", "no wait")):
            if not getattr(self, key) >= 0:   # NaN too
                out.append((key, f"must be >= 0 (0 = {zero}), got {getattr(self, key)}"))
        if self.on_failure not in ("teardown", "resubmit"):
            out.append(("on_failure", f"must be 'teardown' or 'resubmit', got {self.on_failure!r}"))
        if self.max_resubmits < 0:
            out.append(("max_resubmits", "must be >= 0"))
        if self.poll_s <= 0 or self.ready_timeout_s <= 0:
            out.append(("poll_s" if self.poll_s <= 0 else "ready_timeout_s", "must be > 0"))
        if not self.launcher_lease_s >= 0:
            out.append(("launcher_lease_s", f"must be >= 0 seconds (0 = off), got {self.launcher_lease_s}"))
        return out


@dataclass
class CpuSection:
    """Local backend: the CPU pool of each role (Linux cpu-list syntax, e.g. "0-5,8").

    Empty = planned (docs/plan.md, "CPU placement"): 2 CPUs give generation one and training
    the other, the light services sharing the generation CPU; more CPUs keep a few cores for the
    light services and split the rest in launcher.gen_train_ratio.
    """
    # Pin every role to its pool (os.sched_setaffinity) and size its threads to it; false = roles
    # float over every CPU with gen.threads / trainer.threads threads.
    pin: bool = True
    # Generation pool, divided between the gen.num_servers servers.
    gen: str = ""
    # Training pool (disjoint from gen).
    train: str = ""
    # Controller, reward service, rollout workers, evaluation and the launcher; may overlap one
    # pool. Empty = the CPUs gen and train leave over, else the generation pool.
    services: str = ""
    # Trainer ranks on the CPU miniature (embedded generation servers): torch.distributed over
    # gloo, each rank on its own share of the training pool. With gen.backend: sglang the plan
    # decides instead (one rank per training GPU, as on SLURM).
    trainer_ranks: int = 1

    def problems(self) -> list[tuple[str, str]]:
        out = []
        for key in ("gen", "train", "services"):
            value = getattr(self, key)
            if value:
                try:
                    parse_cpus(value, f"launcher.cpus.{key}")
                except ConfigError as e:
                    out.append((key, str(e).removeprefix(f"launcher.cpus.{key}=")))
        if self.trainer_ranks < 1:
            out.append(("trainer_ranks", f"must be >= 1, got {self.trainer_ranks}"))
        if (self.gen or self.train or self.services) and not (self.gen and self.train):
            out.append(("gen" if not self.gen else "train",
                        "launcher.cpus needs both gen and train when either (or services) is set"))
        return out


@dataclass
class LauncherSection:
    """How roles are started and how the cluster is split between them."""
    # local: subprocesses on this machine; slurm: one submitit job per role.
    backend: str = "local"
    # Nodes of the allocation (slurm backend).
    nodes: int = 1
    gpus_per_node: int = 8
    # Generation GPUs : training GPUs.
    gen_train_ratio: str = "3:1"
    slurm: SlurmSection = field(default_factory=SlurmSection)
    # Local backend: CPU pools of generation, training and the light services.
    cpus: CpuSection = field(default_factory=CpuSection)
    # Elastic split (launcher/elastic_policy.py): move one unit of GPUs (a node; in the CPU
    # miniature one generation server's CPUs) between generation and training during the run
    # when the measured rates say a neighbouring split is faster; output lengths grow during RL,
    # so the best split moves. `tandem simulate --elastic` predicts the gain before the run.
    elastic: bool = False
    # Move only when the best split is predicted faster than the current one by more than this
    # fraction: a move costs a restart, and predictions from a few steps err by several percent.
    elastic_min_gain: float = 0.15
    # Training steps between decisions: the window the rates are measured over.
    elastic_every_steps: int = 5
    # Local backend with a CPU build of torch: the model roles (generation, training, rollout,
    # evaluation) start as forks of one interpreter that imported torch and transformers once,
    # saving each about 5 CPU-seconds of imports (launcher/backends/role_forks.py says what stays
    # the same). false: each starts as a fresh `python -m tandem.launcher.cli`, as on SLURM and GPUs.
    fork_roles: bool = True
    # Seconds a stopping trainer (Ctrl-C, scancel of the launcher, another role's failure) gets
    # to finish its step and write its last checkpoint before it is killed, after the rollout
    # workers stop and before the services do; the other roles get 15 s locally
    # (services/protocol STOP_GRACE_S) and the cluster's KillWait on SLURM, shorter than a real
    # model's checkpoint takes. slurm/train.sbatch's launcher gets its SIGTERM 5 minutes before
    # its time limit: this leaves room for the rest of the teardown.
    trainer_stop_s: float = 180.0

    def problems(self) -> list[tuple[str, str]]:
        out = []
        if self.backend not in ("local", "slurm"):
            out.append(("backend", f"must be 'local' or 'slurm', got {self.backend!r}"))
        if self.nodes < 1:
            out.append(("nodes", "must be >= 1"))
        if self.gpus_per_node < 0:
            out.append(("gpus_per_node", "must be >= 0"))
        out += [(f"slurm.{k}", m) for k, m in self.slurm.problems()]
        out += [(f"cpus.{k}", m) for k, m in self.cpus.problems()]
        parts = self.gen_train_ratio.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            hint = (" (YAML reads an unquoted 3:1 as the base-60 number 181: write '3:1' in quotes)"
                    if self.gen_train_ratio.isdigit() else "")
            out.append(("gen_train_ratio", f"must look like '3:1' (two positive integers), "
                                           f"got {self.gen_train_ratio!r}{hint}"))
        if self.elastic_min_gain < 0:
            out.append(("elastic_min_gain", f"must be >= 0 (a fraction: 0.15 = move when 15% faster), "
                                            f"got {self.elastic_min_gain}"))
        if not self.trainer_stop_s > 0:
            out.append(("trainer_stop_s", f"must be > 0 (seconds), got {self.trainer_stop_s}"))
        if self.elastic_every_steps < 1:
            out.append(("elastic_every_steps", f"must be >= 1 (training steps between decisions), "
                                               f"got {self.elastic_every_steps}"))
        return out


@dataclass
class ExperimentConfig:
    experiment: ExperimentSection = field(default_factory=ExperimentSection)
    launcher: LauncherSection = field(default_factory=LauncherSection)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    gen: GenConfig = field(default_factory=GenConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)


SECTIONS = ("experiment", "launcher", "controller", "gen", "rollout", "reward", "trainer", "simulate")


def parse_cpus(text: str, key: str = "launcher.cpus") -> tuple[int, ...]:
    """Linux cpu-list syntax ("0-3,6,8-9") -> sorted CPU ids; an error names `key`."""
    out: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ConfigError(f"{key}={text!r}: expected CPU ids and ranges like '0-3,6'") from None
        if a < 0 or b < a:
            raise ConfigError(f"{key}={text!r}: bad range {part!r}")
        out.update(range(a, b + 1))
    if not out:
        raise ConfigError(f"{key}={text!r}: names no CPU")
    return tuple(sorted(out))


def _non_finite(obj, prefix: str = "") -> list[tuple[str, str]]:
    """Every float setting that is NaN or infinite, by dotted key. No setting means either (a
    NaN temperature or learning rate passes every range check, since comparisons with NaN are
    false, and then fails in a role long after the run started)."""
    out = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out += _non_finite(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            out.append((key, f"must be a finite number, got {value}"))
        elif isinstance(value, list | tuple):
            out += [(f"{key}[{i}]", f"must be a finite number, got {v}")
                    for i, v in enumerate(value) if isinstance(v, float) and not math.isfinite(v)]
    return out


def _cross_section_problems(cfg: ExperimentConfig) -> list[tuple[str, str]]:
    out = []
    if cfg.controller.groups_per_step != cfg.trainer.groups_per_step:
        out.append(("controller.groups_per_step",
                    f"{cfg.controller.groups_per_step} differs from trainer.groups_per_step="
                    f"{cfg.trainer.groups_per_step}; admission and training must agree on B"))
    out += _sequence_fits_micro_batch(cfg)
    out += _adapter_sync_problems(cfg)
    out += _weight_relay_problems(cfg)
    return out


def _weight_relay_problems(cfg: ExperimentConfig) -> list[tuple[str, str]]:
    """`gen.weight_relay` relays whole models published on disk (rollout/server/relay.py)."""
    if not cfg.gen.weight_relay:
        return []
    if cfg.trainer.weight_sync != "disk":
        return [("gen.weight_relay", f"relays versions published on disk, but trainer.weight_sync is "
                                     f"{cfg.trainer.weight_sync!r}; set trainer.weight_sync: disk or "
                                     f"gen.weight_relay: false")]
    if cfg.trainer.lora.adapter_sync:
        return [("gen.weight_relay", "relays whole models; with trainer.lora.sync: adapter the servers load "
                                     "adapters (a few MB) straight from disk: set gen.weight_relay: false, or "
                                     "trainer.lora.sync: merged")]
    return []


def _adapter_sync_problems(cfg: ExperimentConfig) -> list[tuple[str, str]]:
    """`trainer.lora.sync: adapter`: the servers swap adapters over /load_lora_adapter, always
    under an abort pause (services/controller/weights/adapter.py says why)."""
    from tandem.rollout.sglang_launch import SGLANG_LORA_TARGETS

    if not cfg.trainer.lora.adapter_sync:
        return []
    out = []
    if not cfg.controller.interruptible:
        out.append(("controller.interruptible",
                    "false cannot hold with trainer.lora.sync: adapter: an adapter swap pauses the servers "
                    "(abort), since SGLang swaps an adapter name safely only while no request holds it; set "
                    "controller.interruptible: true, or trainer.lora.sync: merged"))
    unsupported = [m for m in cfg.trainer.lora.target_modules if m not in SGLANG_LORA_TARGETS]
    if cfg.gen.backend == "sglang" and unsupported:
        out.append(("trainer.lora.target_modules",
                    f"{unsupported} cannot take a LoRA adapter in SGLang (its supported target modules: "
                    f"{list(SGLANG_LORA_TARGETS)}); drop them, or set trainer.lora.sync: merged"))
    return out


def model_turns(rollout) -> int:
    """Model turns a sample may hold: one for the built-in single-turn episode, else max_turns."""
    from tandem.rollout.workflow import DEFAULT_WORKFLOW

    return 1 if rollout.workflow == DEFAULT_WORKFLOW and not rollout.agent else rollout.max_turns


def longest_sequence(rollout) -> int:
    """Tokens of the longest sample a worker sends: its prompt and every model turn's output (a
    multi-turn episode's environment turns come on top of this)."""
    return rollout.max_prompt_tokens + model_turns(rollout) * rollout.max_new_tokens


def _sequence_fits_micro_batch(cfg: ExperimentConfig) -> list[tuple[str, str]]:
    """The longest sequence a worker can send (its prompt, then every model turn) must fit one
    micro-batch: a longer one is left out of the loss (the trainer's `too_long` count), so a
    budget equal to max_new_tokens silently dropped exactly the samples cut at the length limit."""
    r, budget = cfg.rollout, cfg.trainer.max_tokens_per_mb
    turns, need = model_turns(r), longest_sequence(r)
    if r.agent and r.agent_context_tokens:   # an agent's episode, tool results and all
        need = r.agent_context_tokens
    if budget >= need:
        return []
    if r.agent and r.agent_context_tokens:
        return [("trainer.max_tokens_per_mb", f"{budget} is less than rollout.agent_context_tokens = {need}: an episode "
                                              "that long would be left out of the loss; raise one or lower the other")]
    outputs = f"{turns} x rollout.max_new_tokens" if turns > 1 else "rollout.max_new_tokens"
    values = f"{turns} x {r.max_new_tokens}" if turns > 1 else str(r.max_new_tokens)
    return [("trainer.max_tokens_per_mb",
             f"{budget} is less than rollout.max_prompt_tokens + {outputs} = {r.max_prompt_tokens} + "
             f"{values} = {need}: a sample that long would be left out of the loss (counted as "
             f"too_long); raise trainer.max_tokens_per_mb to {need} or lower the other two")]


def _apply_algorithm(cfg: DictConfig, explicit: set[str], prov: Provenance, applied: dict | None) -> DictConfig:
    """Set the `trainer.algorithm` preset's keys (trainer/presets.py) that neither the file nor
    an override set explicitly: an explicit key always wins. Unknown names are left to the
    section's validation. `applied` (if given) receives {key: value} set and {key: None} kept."""
    try:
        algorithm = OmegaConf.select(cfg, "trainer.algorithm")
    except OmegaConfBaseException:
        return cfg
    if algorithm not in PRESETS:
        return cfg

    def get(key):
        return OmegaConf.select(cfg, key)
    try:
        values = preset_values(algorithm, get)
        for key, value in values.items():
            if key in explicit:
                if applied is not None:
                    applied[key] = ("explicit", get(key))
                continue
            OmegaConf.update(cfg, key, value, merge=False)
            if applied is not None:
                applied[key] = ("preset", value)
    except OmegaConfBaseException as e:
        key, msg = explain(e, _schema())
        raise ConfigError(f"{prov.where('trainer.algorithm')}: preset {algorithm!r}: {key}: {msg}") from None
    return cfg


@functools.cache
def _schema() -> DictConfig:
    """The dataclass defaults as a structured config, made once and only ever read: making it
    takes about 0.1 s, and every role, `tandem` command and test loads a config. A load starts
    from a copy of it (`config_source.merged`: the preset and `resolve` change a config in place)."""
    return OmegaConf.structured(ExperimentConfig)


@functools.cache
def _schema_pickle() -> bytes:
    return pickle.dumps(_schema())


def load_config(path: str | os.PathLike | None, overrides: list[str] = (),
                applied: dict | None = None) -> ExperimentConfig:
    """Load, merge, interpolate and validate an experiment; raise ConfigError on any mistake.

    Order: dataclass defaults, the YAML file, the overrides, then the `trainer.algorithm`
    preset for every key of it that neither the file nor an override set (`applied`, if given,
    is filled with {key: ("preset" | "explicit", value)})."""
    return load_config_traced(path, overrides, applied)[0]


def problems_error(prov: Provenance, problems: list[tuple[str, str]], earlier: list[str] = ()) -> ConfigError:
    """The ConfigError of (key, message) problems, each on one line blaming what the user wrote,
    after `earlier` lines (settings that could not be merged at all)."""
    lines = [*earlier, *prov.lines(problems)]
    if len(lines) == 1:
        return ConfigError(lines[0])
    return ConfigError("invalid configuration:\n  " + "\n  ".join(lines))


def load_config_traced(path: str | os.PathLike | None, overrides: list[str] = (),
                       applied: dict | None = None,
                       deferred: list[str] | None = None) -> tuple[ExperimentConfig, Provenance]:
    """`load_config`, and where each key came from (for the checks that run after loading,
    launcher/preflight.py, to blame what the user wrote as loading does). Every mistake is said,
    not the first: a setting that cannot be merged (an unknown key, a wrong type) is left out and
    named, and the rest is checked. With `deferred`, those lines are appended to it instead of
    raised when nothing else is wrong, for the caller's later checks to say with theirs."""
    schema = _schema()
    src = Path(path) if path is not None else None
    prov = Provenance(path=src)
    raw = read_yaml(src, SECTIONS) if src is not None else None
    if raw is not None:
        prov.file_keys |= dotted_keys(raw)
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}': expected key=value")
        prov.override_keys.add(ov.split("=", 1)[0].strip())
    unmerged: list[str] = []
    try:
        cfg = merged(pickle.loads(_schema_pickle()), raw, overrides)
    except OmegaConfBaseException:   # again step by step, to name each key of the file or override
        cfg, unmerged = merged_naming_each_culprit(schema, src, raw, overrides)
    applied = {} if applied is None else applied
    cfg = _apply_algorithm(cfg, prov.file_keys | prov.override_keys, prov, applied)
    prov.preset_keys = {k for k, (how, _) in applied.items() if how == "preset"}
    plain = OmegaConf.to_container(cfg, resolve=False)
    leaves = [v for v in scalars(plain) if isinstance(v, str)]
    # OmegaConf's own walks (missing values, interpolations) only where the plain copy has such
    # a value: each costs more than the rest of the checks.
    missing = sorted(OmegaConf.missing_keys(cfg)) if MISSING in leaves else []
    if missing and unmerged:   # most likely what was not merged (a section's name mistyped): that is said
        raise problems_error(prov, [], unmerged)
    if missing:
        where = f"{src}: " if src else ""
        raise ConfigError(f"{where}missing required value: {', '.join(missing)} "
                          f"(set it in the file or as an override, e.g. {missing[0]}=...)")
    prov.copies = copies_in(plain)
    try:
        if any("${" in v for v in leaves):
            OmegaConf.resolve(cfg)
        obj: ExperimentConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key, msg = explain(e, schema)
        raise problems_error(prov, [(key, msg)], unmerged) from None
    # Non-finite values first: "got nan" says more than the range check a NaN or inf also fails.
    problems = _non_finite(obj)
    for section in SECTIONS:
        check = getattr(getattr(obj, section), "problems", None)
        if check:
            problems += [(f"{section}.{k}", m) for k, m in check()]
    problems += _cross_section_problems(obj)
    if problems or (unmerged and deferred is None):
        raise problems_error(prov, problems, unmerged)
    if deferred is not None:
        deferred += unmerged
    obj.experiment.exp_dir = str(Path(obj.experiment.exp_dir).expanduser().absolute())
    model = Path(obj.experiment.model).expanduser()
    if obj.experiment.model.startswith((".", "~")) or model.exists():
        # Roles may run elsewhere (another cwd, a cluster node): pin local paths down now.
        obj.experiment.model = str(model.absolute())
    return obj, prov


def to_yaml(cfg: ExperimentConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_resolved(cfg: ExperimentConfig, exp_dir: str | os.PathLike) -> Path:
    """Write `<exp>/config.yaml` atomically; roles started later read only this file."""
    out = Path(exp_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, out)
    return out


def load_experiment(exp_dir: str | os.PathLike) -> ExperimentConfig:
    """The resolved config of an existing experiment directory (what every role reads)."""
    path = Path(exp_dir) / "config.yaml"
    if not path.exists():
        raise ConfigError(f"{path}: no such file; is '{exp_dir}' an experiment directory "
                          f"created by `tandem run`?")
    return load_config(path)
