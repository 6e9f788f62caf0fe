"""`tandem run FILE [overrides] [--resume]`: one experiment end to end on the chosen backend.

The local backend starts the roles in dependency order (controller, reward, generation
servers, trainer, rollout workers), registers the servers with the controller, evaluates the
starting policy, supervises the run while printing progress, evaluates again, writes
`<exp>/summary.json` and stops everything — also on Ctrl-C, with nothing left behind.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sys
import time
from pathlib import Path

from services.protocol import (
    ExpDir,
    RegisterServer,
    SyncRequestClient,
    free_port,
    generate_keys,
    load_keys,
    read_service,
)

from .config import ConfigError, ExperimentConfig, load_config, load_experiment, save_resolved
from .local import LaunchError, LocalSupervisor, RoleSpec
from .plan import cpu_placement_for
from .progress import Progress, summarize
from .report import write_report

log = logging.getLogger(__name__)


def prepare(file: str | None, overrides: list[str], resume: bool) -> tuple[ExperimentConfig, ExpDir]:
    """Resolve the config and create (or reopen, with --resume) the experiment directory."""
    cfg = load_config(file, overrides)
    sglang_layout(cfg)      # sets gen.num_servers from the plan; a layout the backend cannot start fails
    cpu_placement_for(cfg)  # a CPU placement that does not fit fails before the directory exists
    exp = ExpDir(cfg.experiment.exp_dir)
    if exp.config.exists():
        if not resume:
            raise ConfigError(f"{exp.root} already holds an experiment; pass --resume to continue it, "
                              f"or choose another experiment.name / experiment.exp_dir")
        previous = load_experiment(exp.root)
        if previous.trainer.groups_per_step != cfg.trainer.groups_per_step:
            raise ConfigError("trainer.groups_per_step differs from the run being resumed; "
                              "staleness accounting would not agree")
    elif resume:
        raise ConfigError(f"--resume: {exp.root} holds no experiment to resume")
    if not Path(cfg.experiment.model).exists():
        raise ConfigError(f"experiment.model: {cfg.experiment.model} does not exist "
                          f"(for the embedded default, `make train-math` builds it with `tandem sft`)")
    exp.root.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, exp.root)
    generate_keys(exp.keys)
    write_gen_keys(exp)
    return cfg, exp


# Local backend: SGLang loads and warms up a GPU model (minutes for 14B), not seconds.
SGLANG_READY_TIMEOUT_S = 1800.0
# The generation servers' bearer keys under <exp>/keys/ (the names travel in RegisterServer).
GEN_API_KEY, GEN_ADMIN_KEY = "gen-api-key", "gen-admin-api-key"


def write_gen_keys(exp: ExpDir) -> None:
    """Fresh random API and admin keys for this launch, each created 0600 (never world-readable,
    not even for an instant) and swapped in atomically."""
    for name in (GEN_API_KEY, GEN_ADMIN_KEY):
        path, tmp = exp.keys / name, exp.keys / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            # The prefix keeps a key from starting with "-": SGLang turns its --config file into
            # command-line options in-process, where such a value would parse as a flag.
            f.write(f"tandem-{secrets.token_urlsafe(32)}\n")
        os.replace(tmp, path)


def sglang_layout(cfg: ExperimentConfig):
    """With gen.backend: sglang, the plan that places the servers on GPUs (None otherwise).

    The plan decides the server count (one per gen.tp_size generation GPUs), as on SLURM; the
    local backend — one machine, one trainer process — also gives each server and the trainer
    their GPUs from it, so it refuses layouts it cannot start as planned."""
    if cfg.gen.backend != "sglang":
        return None
    from .plan import plan_for

    plan = plan_for(cfg, place_cpus=False)
    cfg.gen.num_servers = plan.num_servers
    la = cfg.launcher
    if la.backend == "local":
        if la.nodes != 1:
            raise ConfigError(f"launcher.nodes={la.nodes}: the local backend runs on this machine only; "
                              f"use launcher.backend: slurm for several nodes")
        if plan.trainer_world != 1:
            raise ConfigError(f"the local backend starts one trainer process, but the plan gives training "
                              f"{plan.trainer_world} GPUs (launcher.gpus_per_node={la.gpus_per_node}, "
                              f"gen_train_ratio={la.gen_train_ratio}); choose a ratio that leaves training "
                              f"one GPU (e.g. {la.gpus_per_node - 1}:1) or use launcher.backend: slurm")
    return plan


def role_specs(cfg: ExperimentConfig, exp: ExpDir, resume: bool) -> list[RoleSpec]:
    root = str(exp.root)
    specs = [RoleSpec("controller-0", ["controller", "--exp", root], ready_file="controller", restart=True),
             RoleSpec("reward-0", ["reward", "serve", "--exp", root], ready_file="reward", restart=True)]
    specs += gen_role_specs(cfg, exp)
    gpu_plan = sglang_layout(cfg) if cfg.launcher.backend == "local" else None
    specs.append(RoleSpec("trainer-0", ["trainer", "--exp", root] + (["--resume"] if resume else []),
                          threads=cfg.trainer.threads, ready_file="trainer",
                          # On a local GPU machine the trainer gets the plan's training GPU only.
                          env={"CUDA_VISIBLE_DEVICES": gpu_plan.cuda_visible_devices("trainer", 0)}
                          if gpu_plan else {}))
    for r in range(cfg.rollout.num_workers):
        specs.append(RoleSpec(f"rollout-{r}", ["rollout", "--exp", root, "--rank", str(r)], restart=True))
    return specs


def gen_role_specs(cfg: ExperimentConfig, exp: ExpDir) -> list[RoleSpec]:
    """The generation servers: `tandem gen serve` (embedded, CPU) or, with gen.backend: sglang,
    `tandem gen sglang` (rollout/sglang_role.py: a supervised `python -m sglang.launch_server`).
    Both take the same key files and announce `<exp>/services/gen-<i>.json`; the launcher then
    registers each with the controller. On SLURM, slurm_requests rewrites host and ports."""
    root = str(exp.root)
    sglang = cfg.gen.backend == "sglang"
    plan = sglang_layout(cfg)                       # None for embedded servers
    gpu_plan = plan if cfg.launcher.backend == "local" else None
    specs = []
    for i in range(cfg.gen.num_servers):
        argv = ["gen", "sglang" if sglang else "serve", "--model", cfg.experiment.model, "--host", "127.0.0.1",
                "--port", str(free_port())]
        if sglang:
            argv += ["--nccl-port", str(free_port())]
        argv += ["--api-key-file", str(exp.keys / GEN_API_KEY), "--admin-api-key-file",
                 str(exp.keys / GEN_ADMIN_KEY), "--exp", root, "--rank", str(i)]
        # SGLang runs a scheduler per TP rank, a tokenizer/HTTP process and a detokenizer, each
        # busy on its own core: a SLURM job asks for that many CPUs (the plan's pool locally).
        threads = max(cfg.gen.threads, cfg.gen.tp_size + 2) if sglang else cfg.gen.threads
        specs.append(RoleSpec(f"gen-{i}", argv, threads=threads, ready_file=f"gen-{i}", restart=True,
                              on_ready=lambda i=i: register_server(exp, i),
                              env={"CUDA_VISIBLE_DEVICES": gpu_plan.cuda_visible_devices("gen", i)}
                              if gpu_plan else {},
                              ready_timeout_s=SGLANG_READY_TIMEOUT_S if sglang else None))
    return specs


def register_server(exp: ExpDir, rank: int) -> None:
    """Add server `rank` (as announced in services/gen-<rank>.json) to the controller's rotation,
    naming the key files it checks (the controller and workers read them from <exp>/keys/)."""
    info = read_service(exp, f"gen-{rank}", timeout_s=10)
    controller = read_service(exp, "controller", timeout_s=10)
    client = SyncRequestClient(load_keys(exp.keys), controller["address"], timeout_s=30)
    try:
        client.request(RegisterServer(address=info["url"], api_key_ref=GEN_API_KEY, admin_key_ref=GEN_ADMIN_KEY,
                                      tp_size=int(info.get("tp_size", 0))))
    finally:
        client.close()


def evaluate(sup: LocalSupervisor, exp: ExpDir, tag: str) -> dict | None:
    """Greedy accuracy of the policy the generation servers hold now (a `tandem eval` child)."""
    out = exp.root / f"eval-{tag}.json"
    spec = RoleSpec(f"eval-{tag}", ["eval", "--exp", str(exp.root), "--out", str(out)])
    child = sup.start(spec)
    code = child.proc.wait()
    sup.children.pop(spec.name, None)
    if code != 0 or not out.exists():
        log.error("evaluation '%s' failed (status %s)\n%s", tag, code, sup.tail(spec.name))
        return None
    return json.loads(out.read_text())


def run_local(cfg: ExperimentConfig, exp: ExpDir, resume: bool) -> int:
    sup = LocalSupervisor(exp, cpu_placement_for(cfg))
    t0 = time.time()
    progress = Progress(exp, cfg.trainer.total_steps)
    evals: dict[str, dict | None] = {}
    try:
        specs = role_specs(cfg, exp, resume)
        for spec in specs:
            if spec.name.startswith("trainer"):
                if cfg.rollout.eval_size > 0 and not resume:
                    print("evaluating the starting policy ...", flush=True)
                    evals["before"] = evaluate(sup, exp, "before")
            sup.start(spec)
        print(f"run {cfg.experiment.name}: {len(specs)} roles up in {time.time() - t0:.0f}s; "
              f"logs in {exp.logs}", flush=True)
        trainer_done = False
        while not trainer_done:
            time.sleep(1.0)
            for child in sup.poll():
                name, code = child.spec.name, child.proc.returncode
                if name.startswith("trainer"):
                    if code != 0:
                        raise LaunchError(f"the trainer exited with status {code}:\n{sup.tail(name)}\n"
                                          f"continue from its last checkpoint with: tandem run <file> --resume")
                    trainer_done = True
                elif name in sup.children:
                    print(f"{name} crashed (status {code}); restarted", flush=True)
                elif code != 0:
                    raise LaunchError(f"{name} failed repeatedly (status {code}):\n{sup.tail(name)}")
            progress.update()
        sup.stop([n for n in sup.children if n.startswith("rollout")])
        if cfg.rollout.eval_size > 0:
            print("evaluating the trained policy ...", flush=True)
            evals["after"] = evaluate(sup, exp, "after")
        summary = summarize(exp, evals, wall_s=time.time() - t0)
        print(json.dumps({k: summary[k] for k in ("steps", "eval", "wall_s")}, indent=1), flush=True)
        try:
            png, page, _ = write_report(exp)
            print(f"report: {page} ({png})", flush=True)
        except Exception as e:  # a plotting problem must not turn a finished run into a failure
            log.warning("could not write the report: %s", e)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every role ...", flush=True)
        return 130
    except LaunchError as e:
        print(f"tandem run: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        sup.stop()


def cmd_run(args) -> int:
    cfg, exp = prepare(args.file, args.overrides, args.resume)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s: %(message)s")
    if shutil.which("bwrap") is None and cfg.reward.task == "code":
        print("note: bubblewrap is missing; generated code runs with rlimits only", flush=True)
    if cfg.launcher.backend == "slurm":
        from .slurm_backend import run_slurm
        return run_slurm(cfg, exp, args.resume)
    return run_local(cfg, exp, args.resume)


def register(sub) -> None:
    p = sub.add_parser("run", help="run an experiment (local backend: every role as a subprocess)")
    p.add_argument("file", help="experiment YAML file")
    p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.total_steps=20")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.set_defaults(func=cmd_run)
