"""What each task of a Tandem SLURM job runs: the role as a child process of submitit's worker.

submitit pickles a `RoleCommand` and runs it in every task of the job (srun). It starts the role
(`tandem <role> ...`) with its console in `<exp>/logs/`, exports the torch.distributed variables
from SLURM's for the trainer (torchrun's convention: every rank sees the node's allocated GPUs in
CUDA_VISIBLE_DEVICES and picks its own with LOCAL_RANK), turns SLURM's time-limit warning
(SIGUSR2, which would kill an unprepared child) into a SIGTERM so the role checkpoints and exits
cleanly, and raises when the role fails or was stopped, so the job's SLURM state is FAILED or
CANCELLED rather than COMPLETED — the launcher's watcher relies on that. While the role runs it
watches its launcher's lease (launcher_watch.py): a launcher gone for `launcher_lease_s` gets the
role stopped (SIGTERM, SIGKILL after its grace) and the job ended, not left to its time limit.

A role stopped by the time-limit warning ends its job FAILED, before SLURM could call it
TIMEOUT; so the task leaves a note (`time_limit_note`) that the launcher reads to tell a job
that reached its limit (the run continues: launcher/continuation.py) from one that crashed.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tandem.services.protocol import write_json_atomic
from tandem.services.protocol.runtime import STOP_GRACE_S

from .launcher_watch import HEARTBEAT_FILE, Lease, heartbeat_interval

# In a role's argv, replaced by the name of the node the task runs on (an address others reach).
NODE_PLACEHOLDER = "{node}"


def console_name(name: str, rank: int | None) -> str:
    """`gen-3.console`; for a multi-task job one file per rank: `trainer-0.console`, `trainer-1...`."""
    if rank is None:
        return f"{name}.console"
    base = name.rsplit("-", 1)[0] if re.search(r"-\d+$", name) else name
    return f"{base}-{rank}.console"


class RoleCommand:
    """What each SLURM task runs (pickled by submitit): the role as a child process."""

    def __init__(self, name: str, command: list[str], exp_root: str, threads: int, distributed: bool,
                 lease_s: float = 0.0, grace_s: float = STOP_GRACE_S):
        self.name, self.command, self.exp_root = name, command, exp_root
        self.threads, self.distributed = threads, distributed
        self.lease_s, self.grace_s = lease_s, grace_s   # the launcher's lease; the role's stop time

    def __call__(self) -> int:
        threads = str(self.threads)
        node = os.environ.get("SLURMD_NODENAME", "") or os.uname().nodename
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "TANDEM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
               "TANDEM_ADVERTISE_HOST": node}
        command = [arg.replace(NODE_PLACEHOLDER, node) for arg in self.command]
        rank = None
        if self.distributed:
            import submitit

            dist = submitit.helpers.TorchDistributedEnvironment()
            env.update(MASTER_ADDR=dist.master_addr, MASTER_PORT=str(dist.master_port),
                       RANK=str(dist.rank), WORLD_SIZE=str(dist.world_size),
                       LOCAL_RANK=str(dist.local_rank), LOCAL_WORLD_SIZE=str(dist.local_world_size))
            rank = dist.rank
        logs = Path(self.exp_root) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        console_path = logs / console_name(self.name, rank)
        stopped: list[str] = []
        children: list[subprocess.Popen] = []

        def forward(signum, frame):
            stopped.append(signal.Signals(signum).name)
            for child in children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGUSR2, forward)
        with open(console_path, "ab") as console:
            # Where this task landed, for whoever compares the placement with the plan.
            console.write((f"[tandem-slurm] {self.name} job {os.environ.get('SLURM_JOB_ID', '?')} "
                           f"node {node} rank {rank if rank is not None else '-'} "
                           f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}\n").encode())
            console.flush()
            if stopped:   # cancelled before the role even started
                raise RuntimeError(f"{self.name} stopped by {stopped[0]} before it started")
            # The child ignores SLURM's early-warning USR2 (it would kill it); we turn it into SIGTERM.
            proc = subprocess.Popen(command, stdout=console, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env,
                                    preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
            children.append(proc)
        code = self._wait(proc, console_path, stopped)
        if stopped and stopped[0] == "SIGUSR2":
            write_json_atomic(time_limit_note(logs / "slurm", os.environ.get("SLURM_JOB_ID", "?"),
                                              os.environ.get("SLURM_PROCID", "0")),
                              {"role": self.name, "signal": "SIGUSR2", "time": time.time(), "exit_code": code})
        if code != 0 or stopped:
            if not stopped:
                why = f"exited with status {code}"
            elif stopped[0].startswith("SIG"):
                why = f"stopped by {stopped[0]} (cancelled or at its time limit)"
            else:
                why = f"stopped by {stopped[0]}"
            raise RuntimeError(f"{self.name} {why}; console {console_path}:\n{tail(console_path)}")
        return code


    def _wait(self, proc: subprocess.Popen, console_path: Path, stopped: list[str]) -> int:
        """The role's exit code; with a lease, stopping the role once its launcher is gone."""
        if not self.lease_s > 0:
            return proc.wait()
        lease = Lease(Path(self.exp_root) / "services" / HEARTBEAT_FILE, self.lease_s)
        while True:
            try:
                return proc.wait(timeout=heartbeat_interval(self.lease_s))
            except subprocess.TimeoutExpired:
                pass
            if lease.expired():
                break
        stopped.append(f"its launcher's lease (no heartbeat for {self.lease_s:g} s)")
        with open(console_path, "ab") as console:
            console.write((f"[tandem-slurm] the launcher renewed no lease for {self.lease_s:g} s "
                           f"(launcher.slurm.launcher_lease_s): it is gone; stopping {self.name}\n").encode())
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def time_limit_note(folder: Path, job_id: str, task: str | int) -> Path:
    """Where task `task` of job `job_id` notes that SLURM's time-limit warning stopped its role
    (`folder`: the run's submitit folder, `<exp>/logs/slurm/`)."""
    return Path(folder) / f"{job_id}_{task}_time_limit.json"


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (no console output)"
    return "\n".join("    " + line for line in text[-lines:])
