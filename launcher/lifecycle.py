"""One run, start to end, the same on every backend.

Start the roles wave by wave (controller and reward; generation servers and trainer; rollout
workers: `roles.waves`), each generation server joining the controller's rotation once it is
up; evaluate the starting policy just before the rollout workers start (the trainer, up but
given no data yet, has published nothing); watch until the trainer exits, printing
progress; stop the rollout workers; evaluate the trained policy; write `<exp>/summary.json` and
the report; stop everything — also on an error, Ctrl-C or SIGTERM, with nothing left running.

Between two polls the watch also takes `tandem scale` requests (`scaling.py`: generation servers
joining and leaving the run) and, with `launcher.elastic: true`, runs the elastic split
(`elastic.py`): every few training steps it may move a generation server's CPUs to the trainer
or back.

Exit codes: 0 the trainer finished; 1 a role failed, the run was cancelled, or the trainer stopped
it before its steps (trainer.signals' cap: the reason is printed); 2 the run could
not start as configured (a plan the backend cannot run, jobs of an earlier launch still
running); 130 interrupted.
"""
from __future__ import annotations

import json
import logging
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable

from tandem.services.protocol import ExpDir, LaunchStarted, generate_keys, worker_identity
from tandem.services.protocol.trackers import finish_trackers, tracker_hints

from .backends import Backend, Ended, LaunchError, RoleFailed
from .config import ConfigError, ExperimentConfig
from .continuation import OWN_LIMIT_SIGNAL, note_own_limit
from .controller_calls import register_server, tell_controller
from .learning import unfinished_warm_up
from .plan import PlanError
from .progress import Progress, mark_resumed, summarize
from .report import write_report
from .roles import Role, eval_output, eval_role, experiment_roles, waves
from .scaling import Scaler

log = logging.getLogger(__name__)
# Besides Ctrl-C: signals that stop a run cleanly. SIGUSR1 is slurm/train.sbatch's warning that
# the launcher's own job nears its limit: the run then continues in the job's next run
# (continuation.py, `requeue_own_job`).
STOPPING = (signal.SIGTERM, signal.SIGHUP, OWN_LIMIT_SIGNAL)

Join = Callable[[ExpDir, Role, bool], None]   # (exp, role that is up, restarted?)


def join_run(exp: ExpDir, role: Role, restarted: bool) -> None:
    """What a role that is up does to join the run: the controller, at a launch's start (not at
    a restart within it, when the servers it knows are alive), forgets the servers of an earlier
    launch; a generation server joins the rotation, again after each restart."""
    if role.kind == "controller" and not restarted:
        tell_controller(exp, LaunchStarted(launch_id=secrets.token_hex(4)))
    elif role.kind == "gen":
        register_server(exp, role)


def run_experiment(cfg: ExperimentConfig, exp: ExpDir, resume: bool, backend: Backend,
                   roles: list[Role] | None = None, join: Join | None = join_run,
                   elastic: Callable | None = None) -> int:
    """Run the experiment's roles on `backend` until the trainer finishes; returns the exit code.

    `roles` defaults to `experiment_roles` (tests give stand-ins); `join` is called for each
    role with a ready file once it is up and again after a restart (default `join_run`; None:
    nothing to join). `elastic(cfg, exp, backend, roles, join)` makes the run's elastic split,
    or None (default `launcher.elastic.elastic_for`: one when `launcher.elastic` is on; tests
    give one whose decisions they script)."""
    t0 = time.time()
    previous_signals = _sigterm_interrupts()
    status = "failed"
    try:
        backend.check_can_start()
        roles = roles if roles is not None else experiment_roles(cfg, exp, resume, backend.gen_host,
                                                                 backend.pick_port)
        # The key of each role it starts (services/protocol/keys.py): a rollout worker's is its own.
        generate_keys(exp.keys, [worker_identity(r.index) for r in roles if r.kind == "rollout"])
    except (LaunchError, PlanError, ConfigError) as e:
        print(f"tandem run: {e}", file=sys.stderr, flush=True)
        _restore(previous_signals)
        return 2
    if resume:   # where this launch's work starts in the run's stream (summary, report)
        mark_resumed(exp)
    progress = Progress(exp, cfg.trainer.total_steps, resume)
    if note := unfinished_warm_up(cfg.experiment.model):   # RL from it may learn nothing: say so first
        print(f"warning: {note}", flush=True)
    evaluating = cfg.rollout.eval_size > 0
    # A resumed run is the same run: its starting policy was evaluated by the first launch.
    evals: dict[str, dict | None] = {"before": _read_eval(exp, "before")} if resume else {}
    try:
        backend.prepare(roles)
        for wave in waves(roles):
            if wave[0].kind == "rollout" and evaluating and not resume:
                print("evaluating the starting policy ...", flush=True)
                evals["before"] = evaluate(backend, exp, "before")
            backend.start(wave)
            for role in wave:
                _join(join, exp, role, restarted=False)
        backend.running()
        print(f"run {cfg.experiment.name}: {len(roles)} roles up in {time.time() - t0:.0f}s "
              f"({backend.describe()}); logs in {exp.logs}", flush=True)
        if elastic is None:
            from .elastic import elastic_for as elastic
        split = elastic(cfg, exp, backend, roles, join or join_run)
        scaler = Scaler(cfg, exp, backend, roles, join or join_run, since=t0, step=lambda: progress.step)
        ticks = [scaler.tick] + ([split.tick] if split is not None else [])
        watch(backend, exp, join, progress, lambda: [tick() for tick in ticks])
        backend.stop([r.name for r in roles if r.kind == "rollout"])
        if evaluating:
            print("evaluating the trained policy ...", flush=True)
            evals["after"] = evaluate(backend, exp, "after")
        try:   # the trainer's tracker follower has stopped; what was logged since goes now
            finish_trackers(cfg, exp)
        except Exception as e:  # a tracker problem must not turn a finished run into a failure
            log.warning("could not forward the last records to the trackers: %s", e)
        summary = summarize(exp, evals, wall_s=time.time() - t0, model=cfg.experiment.model)
        print(json.dumps({k: summary[k] for k in ("steps", "eval", "wall_s")}, indent=1), flush=True)
        if summary["verdict"]:
            print(summary["verdict"], flush=True)
        try:
            png, page, _ = write_report(exp)
            print(f"report: {page} ({png})", flush=True)
        except Exception as e:  # a plotting problem must not turn a finished run into a failure
            log.warning("could not write the report: %s", e)
        for hint in tracker_hints(cfg.experiment.trackers, cfg.experiment.wandb, exp.root):
            print(hint, flush=True)
        status = "finished"   # every role ended as asked, the trainer too when its cap stopped the run
        if summary["stopped"]:
            print(f"tandem run: the trainer stopped the run after step {summary['steps']}: {summary['stopped']}",
                  file=sys.stderr, flush=True)
            return 1
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every role ...", flush=True)
        status = "interrupted"
        return 130
    except LaunchError as e:
        backend.failure = e   # how it ended: launcher/continuation.py decides whether to go on
        print(f"tandem run: {e}\nstopping every other role of the experiment ...", file=sys.stderr, flush=True)
        return 1
    finally:
        backend.close(status)
        _restore(previous_signals)


def watch(backend: Backend, exp: ExpDir, join: Join | None, progress: Progress,
          tick: Callable[[], None] | None = None) -> None:
    """Until the trainer exits; a role that ends otherwise was restarted (it rejoins) or is fatal.
    `tick` runs after each poll (`tandem scale` requests, the elastic split's decisions and moves)."""
    while True:
        time.sleep(backend.poll_s)
        if backend.cancelled():
            raise LaunchError("the experiment was cancelled (tandem cancel)")
        for end in backend.ended():
            name = end.role.name
            if end.role.kind == "trainer":
                progress.update()   # the steps it recorded since the last poll, the last one included
                if end.ok:
                    return
                raise RoleFailed(f"the trainer failed: {end.why}", end)   # `tandem run` says how to resume
            if end.restarted:
                print(f"{name} crashed and was restarted: {end.why}", flush=True)
                _join(join, exp, end.role, restarted=True)
            elif end.ok:
                print(f"{name} finished", flush=True)
            else:
                raise RoleFailed(f"{name} failed and may not be restarted (again): {end.why}", end)
        progress.update()
        if tick is not None:
            tick()


def evaluate(backend: Backend, exp: ExpDir, tag: str) -> dict | None:
    """Greedy accuracy of the policy the generation servers hold now (a `tandem eval` role).
    A failed evaluation is reported and leaves the figure empty; it does not end the run."""
    out = eval_output(exp, tag)
    out.unlink(missing_ok=True)
    end: Ended = backend.run_to_end(eval_role(exp, tag))
    if not end.ok or not out.exists():
        log.error("evaluation '%s' failed: %s", tag, end.why)
        return None
    return _read_eval(exp, tag)


def _read_eval(exp: ExpDir, tag: str) -> dict | None:
    try:
        return json.loads(eval_output(exp, tag).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _join(join: Join | None, exp: ExpDir, role: Role, restarted: bool) -> None:
    """Run the readiness hook; its failure is a launch failure (reported, then torn down)."""
    if join is None or not role.ready_file:
        return
    try:
        join(exp, role, restarted)
    except Exception as e:  # a timeout, a RemoteError from the controller, ...
        raise LaunchError(f"{role.name} is up but could not join the run: {type(e).__name__}: {e}") from e


def _sigterm_interrupts():
    """SIGTERM (scancel of a launcher started by slurm/train.sbatch, a shutdown, a supervisor),
    SIGUSR1 (train.sbatch: the launcher's job nears its time limit) and SIGHUP (its terminal closed, an ssh session dropped: the output goes on in
    `<exp>/logs/launcher.out`, console.py) become a KeyboardInterrupt, so the teardown in
    `finally` runs; main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        for sig in STOPPING:   # a second one must not cut the teardown short
            signal.signal(sig, signal.SIG_IGN)
        if signum == OWN_LIMIT_SIGNAL:
            note_own_limit()
        raise KeyboardInterrupt

    # A signal ignored when the launcher started stays ignored: `nohup tandem run ...` means the
    # run outlives its terminal.
    return {sig: signal.signal(sig, interrupt) for sig in STOPPING if signal.getsignal(sig) != signal.SIG_IGN}


def _restore(previous) -> None:
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)
