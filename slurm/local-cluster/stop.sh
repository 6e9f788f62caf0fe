#!/usr/bin/env bash
# Stop the local cluster started by start.sh: cancel every job, then stop slurmd (n1, n2),
# slurmctld, slurmdbd, mariadbd and munged. Idempotent; packages and configs stay installed so
# the next start.sh takes about two seconds.
set -uo pipefail

STATE="${TANDEM_SLURM_STATE:-/var/lib/tandem-slurm}"
say() { echo "local-cluster: $*"; }

[[ $(id -u) == 0 ]] || { echo "local-cluster: error: must run as root" >&2; exit 1; }

# stop_all NAME=PIDFILE...: SIGTERM them together, wait up to 10 s, then SIGKILL what is left.
stop_all() {
    local pids=() files=() item name file pid
    for item in "$@"; do
        name=${item%%=*}; file=${item#*=}
        [[ -s $file ]] || continue
        pid=$(cat "$file")
        if kill -0 "$pid" 2>/dev/null; then
            say "stopping $name (pid $pid)"
            kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
        fi
        files+=("$file")
    done
    for pid in "${pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && { say "pid $pid did not stop; killing it"; kill -KILL "$pid" 2>/dev/null; }
    done
    rm -f "${files[@]}"
}

# Jobs first: with proctrack/linuxproc a job's processes outlive a stopped slurmd.
if [[ -s $STATE/run/slurmctld.pid ]] && kill -0 "$(cat "$STATE/run/slurmctld.pid")" 2>/dev/null; then
    jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    if [[ -n ${jobs// } ]]; then
        say "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null
        for _ in $(seq 100); do [[ -z $(squeue -h -o %A 2>/dev/null) ]] && break; sleep 0.2; done
        [[ -z $(squeue -h -o %A 2>/dev/null) ]] || say "warning: jobs still listed: $(squeue -h -o '%A %T' | tr '\n' ';')"
    fi
fi

stop_all "slurmd n1=$STATE/run/slurmd-n1.pid" "slurmd n2=$STATE/run/slurmd-n2.pid" \
    "slurmctld=$STATE/run/slurmctld.pid"
# slurmdbd after slurmctld, which flushes its last accounting records to it.
stop_all "slurmdbd=$STATE/run/slurmdbd.pid"
if command -v mariadb-admin >/dev/null && mariadb-admin ping >/dev/null 2>&1; then
    say "stopping mariadbd"
    mariadb-admin shutdown 2>/dev/null || true
fi
stop_all "munged=/run/munge/munged.pid"
say "stopped"
