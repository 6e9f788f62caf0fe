#!/usr/bin/env bash
# A real SLURM cluster on this machine: two virtual nodes (n1, n2) on 127.0.0.1 with fake GPUs,
# accounting through slurmdbd + MariaDB. For Tandem's tests and for trying the cluster path on a
# laptop (Debian/Ubuntu, as root, no systemd needed).
#
# Idempotent: installs only what is missing, starts only what is not running, then waits until
# `sinfo` shows both nodes idle. Run it again at any time; stop everything with stop.sh.
#
# Environment (all optional):
#   TANDEM_SLURM_STATE   spool, logs, pid files, fake GPU devices   (/var/lib/tandem-slurm)
#   TANDEM_SLURM_GPUS    fake GPUs per node                          (8)
#   TANDEM_SLURM_CPUS    CPUs each virtual node declares             (16)
#   TANDEM_SLURM_FORCE=1 overwrite an /etc/slurm/slurm.conf that this script did not write
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="${TANDEM_SLURM_STATE:-/var/lib/tandem-slurm}"
GPUS="${TANDEM_SLURM_GPUS:-8}"
CPUS="${TANDEM_SLURM_CPUS:-16}"
MEM_MB=16000
CLUSTER=tandem
PARTITION=tandem
CTLD_PORT=7017
N1_PORT=7018
N2_PORT=7019
DBD_PORT=7031
DB_NAME=tandem_slurm_acct
DB_USER=tandem_slurm
DB_PASS=tandem-local-only
CONF_DIR=/etc/slurm
MARKER="# Tandem local cluster"
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)

say() { echo "local-cluster: $*"; }
die() { echo "local-cluster: error: $*" >&2; exit 1; }

# Succeeds while the process named in a pid file is alive.
alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s.
wait_for() {
    local limit=$1 what=$2; shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            die "$what not ready after ${limit}s (logs: $STATE/log/)"
        fi
        sleep 0.2
    done
}

[[ $(id -u) == 0 ]] || die "must run as root (it installs packages and starts daemons)"

install_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null || die "apt-get not found; install ${missing[*]} by hand"
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    # policy-rc.d 101: package scripts must not start daemons; this script starts them.
    local policy=/usr/sbin/policy-rc.d created_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; created_policy=1
    fi
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || {
        ((created_policy)) && rm -f "$policy"; die "apt-get install ${missing[*]} failed"; }
    ((created_policy)) && rm -f "$policy"
    return 0
}

render() {  # render TEMPLATE DEST
    sed -e "s|@STATE@|$STATE|g" -e "s|@HOST@|$(hostname -s)|g" -e "s|@CLUSTER@|$CLUSTER|g" \
        -e "s|@PARTITION@|$PARTITION|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@N1_PORT@|$N1_PORT|g" \
        -e "s|@N2_PORT@|$N2_PORT|g" -e "s|@DBD_PORT@|$DBD_PORT|g" -e "s|@CPUS@|$CPUS|g" \
        -e "s|@GPUS@|$GPUS|g" -e "s|@LAST_GPU@|$((GPUS - 1))|g" -e "s|@MEM_MB@|$MEM_MB|g" \
        -e "s|@DB_NAME@|$DB_NAME|g" -e "s|@DB_USER@|$DB_USER|g" -e "s|@DB_PASS@|$DB_PASS|g" \
        "$HERE/$1" >"$2.tmp"
    mv "$2.tmp" "$2"
}

write_config() {
    mkdir -p "$CONF_DIR" "$STATE"/{ctld,run,log} "$STATE"/slurmd-n{1,2}
    if [[ -e $CONF_DIR/slurm.conf ]] && ! head -1 "$CONF_DIR/slurm.conf" | grep -q "^$MARKER" \
        && [[ ${TANDEM_SLURM_FORCE:-0} != 1 ]]; then
        die "$CONF_DIR/slurm.conf exists and was not written by this script; set TANDEM_SLURM_FORCE=1 to replace it"
    fi
    render slurm.conf.in "$CONF_DIR/slurm.conf"
    render gres.conf.in "$CONF_DIR/gres.conf"
    (umask 077; render slurmdbd.conf.in "$CONF_DIR/slurmdbd.conf")
    chmod 600 "$CONF_DIR/slurmdbd.conf"
    # Fake GPU device files: slurm only needs paths it can stat.
    for n in n1 n2; do
        mkdir -p "$STATE/gpu/$n"
        for ((i = 0; i < GPUS; i++)); do ln -sfn /dev/null "$STATE/gpu/$n/nvidia$i"; done
    done
    # The virtual node names resolve to this machine (job node lists, MASTER_ADDR).
    grep -qE '^127\.0\.0\.1[[:space:]].*\bn1\b.*\bn2\b' /etc/hosts \
        || echo "127.0.0.1 n1 n2 $MARKER" >>/etc/hosts
}

start_munge() {
    [[ -s /etc/munge/munge.key ]] || { say "creating the munge key"; mungekey --create --keyfile /etc/munge/munge.key; }
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge; chown munge:munge /run/munge /var/lib/munge /var/log/munge
    if ! alive /run/munge/munged.pid; then
        say "starting munged"
        runuser -u munge -- /usr/sbin/munged --force
    fi
    wait_for 20 munged bash -c 'munge -n | unmunge'
}

start_mariadb() {
    if ! mariadb-admin ping >/dev/null 2>&1; then
        say "starting mariadbd"
        mkdir -p /run/mysqld; chown mysql:mysql /run/mysqld
        [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
        setsid /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 \
            >>"$STATE/log/mariadbd.log" 2>&1 </dev/null &
        wait_for 60 mariadbd mariadb-admin ping
    fi
    mariadb -e "CREATE DATABASE IF NOT EXISTS $DB_NAME;
        CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
        GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';"
}

start_slurmdbd() {
    if ! alive "$STATE/run/slurmdbd.pid"; then
        say "starting slurmdbd"
        /usr/sbin/slurmdbd
    fi
    wait_for 60 slurmdbd sacctmgr -n list cluster
    if [[ -z $(sacctmgr -n -P list cluster "$CLUSTER" format=Cluster) ]]; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
}

start_slurm() {
    if ! alive "$STATE/run/slurmctld.pid"; then
        say "starting slurmctld"
        /usr/sbin/slurmctld
    fi
    wait_for 30 slurmctld scontrol ping
    for n in n1 n2; do
        if ! alive "$STATE/run/slurmd-$n.pid"; then
            say "starting slurmd $n"
            /usr/sbin/slurmd -N "$n"
        fi
    done
}

nodes_idle() {
    local states
    states=$(sinfo -h -N -p "$PARTITION" -o '%N %t' | sort -u)
    [[ $states == *"n1 idle"* && $states == *"n2 idle"* ]]
}

wait_nodes() {
    local deadline=$((SECONDS + 60))
    until nodes_idle; do
        # A node left down/drained by an earlier stop comes back once its slurmd is up.
        if sinfo -h -N -p "$PARTITION" -o '%t' | grep -qE 'down|drain|fail'; then
            scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
        fi
        ((SECONDS < deadline)) || die "nodes not idle after 60s: $(sinfo -N -h -o '%N %t %E' | tr '\n' ';') (logs: $STATE/log/)"
        sleep 0.3
    done
}

install_packages
write_config
start_munge
start_mariadb
start_slurmdbd
start_slurm
wait_nodes
say "up: partition '$PARTITION', nodes n1 n2 with $CPUS CPUs and $GPUS fake GPUs each (logs in $STATE/log)"
