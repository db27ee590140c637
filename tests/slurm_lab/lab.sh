#!/usr/bin/env bash
# TraceML Slurm lab: a real multi-node Slurm cluster (stock Debian slurmctld/slurmd
# 22.05 + munge) on this one machine, for tests and CI.  See README.md next to this file.
#
#   lab.sh start [--mode loopback|netns] [--nodes N] [--gpus-per-node G]
#   lab.sh stop        # idempotent; kills only what start started
#   lab.sh status      # exit 0 when the lab is up, 3 when it is not
#   lab.sh selftest    # runs real jobs on the lab, exit 0 on success
#   lab.sh env         # prints `export SLURM_CONF=...` lines, for eval
#
# State directory: $SLURM_LAB_DIR (default /tmp/traceml-slurm-lab).  Logs: $SLURM_LAB_DIR/log/.
# Needs root.  netns mode also needs `ip` (iproute2) with veth and bridge support.
set -euo pipefail

LAB="${SLURM_LAB_DIR:-/tmp/traceml-slurm-lab}"
LAB="${LAB%/}"
MARKER="$LAB/.traceml-slurm-lab"   # only a directory carrying this is ever wiped
CONF="$LAB/etc/slurm.conf"
RUN="$LAB/run"
LOG="$LAB/log"
STATE="$LAB/state.env"
LOCK="$LAB.lock"

CTLD_PORT=16817
NETNS_SLURMD_PORT=16818
BRIDGE=slab-br0
NETNS_PREFIX=slab-n
VETH_PREFIX=slab-h
NET_PREFIX=10.77.0
LO_PREFIX=127.77.0
START_TIMEOUT="${SLURM_LAB_START_TIMEOUT:-60}"
SELFTEST_PORT="${SLURM_LAB_SELFTEST_PORT:-29765}"
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { printf '[slurm-lab] %s\n' "$*" >&2; }
die() { printf '[slurm-lab] ERROR: %s\n' "$*" >&2; exit 1; }

usage() {
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

check_lab_dir() {
    case $LAB in
        /?*/?*) ;;
        *) die "SLURM_LAB_DIR must be an absolute path below a top-level directory, not '$LAB'" ;;
    esac
    if [ -d "$LAB" ] && [ ! -e "$MARKER" ] && [ -n "$(ls -A "$LAB" 2>/dev/null)" ]; then
        die "$LAB exists, is not empty and was not made by lab.sh; refusing to use it (set SLURM_LAB_DIR)"
    fi
}

need_root() {
    [ "$(id -u)" = 0 ] || die "must run as root (slurmd/slurmctld run as root, and the lab uses namespaces)"
}

with_lock() {
    # Serialize start/stop/selftest of the same lab (e.g. parallel pytest workers).
    mkdir -p "$(dirname "$LOCK")"
    exec 9>"$LOCK"
    flock -w 300 9 || die "could not lock $LOCK within 300 s"
}

# ---------------------------------------------------------------- packages
have_slurm() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sbatch >/dev/null && command -v munged >/dev/null
}

install_packages() {
    have_slurm && return 0
    command -v apt-get >/dev/null || die "slurm/munge are not installed and apt-get is missing"
    log "installing ${PACKAGES[*]} with apt-get"
    # Keep the package scripts from starting the system slurm/munge services.
    local made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    local rc=0
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends "${PACKAGES[@]}" >"$LAB.apt.log" 2>&1; then
        log "apt-get install failed; running apt-get update and retrying"
        apt-get update >>"$LAB.apt.log" 2>&1 || true
        apt-get install -y --no-install-recommends "${PACKAGES[@]}" >>"$LAB.apt.log" 2>&1 || rc=$?
    fi
    [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    if [ "$rc" != 0 ] || ! have_slurm; then
        tail -n 30 "$LAB.apt.log" >&2 || true
        die "could not install ${PACKAGES[*]} (log: $LAB.apt.log)"
    fi
}

# ---------------------------------------------------------------- processes
# pid_alive PID NAME: PID exists and its comm is NAME (guards against pid reuse).
pid_alive() {
    local pid=$1 name=$2 comm
    [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [ "$comm" = "$name" ]
}

read_pid() { if [ -r "$1" ]; then tr -dc '0-9' <"$1" || true; fi; }

# Wait for PIDs to exit; SIGKILL whatever is left after $1 seconds.
wait_gone() {
    local grace=$1; shift
    local deadline=$((SECONDS + grace)) p left
    while :; do
        left=()
        for p in "$@"; do [ -d "/proc/$p" ] && left+=("$p"); done
        [ ${#left[@]} = 0 ] && return 0
        if [ $SECONDS -ge $deadline ]; then
            log "SIGKILL to pids still alive after ${grace}s: ${left[*]}"
            kill -KILL "${left[@]}" 2>/dev/null || true
            sleep 0.2
            return 0
        fi
        sleep 0.1
    done
}

# Pids of every process whose UTS namespace is the given one (a node's namespace).
pids_in_uts_ns() {
    local ns=$1 d p
    for d in /proc/[0-9]*; do
        p=${d#/proc/}
        [ "$(readlink "$d/ns/uts" 2>/dev/null || true)" = "$ns" ] && echo "$p"
    done
    return 0
}

# ---------------------------------------------------------------- stop
do_stop() {
    local root_uts pids=() f node ns p pid
    root_uts=$(readlink /proc/self/ns/uts || true)
    if [ ! -e "$MARKER" ] || { [ ! -d "$RUN" ] && [ ! -f "$LAB/created" ]; }; then
        log "no lab at $LAB (nothing to stop)"; return 0
    fi

    # 1. Each node: every process in the node's UTS namespace (slurmd, slurmstepd, job
    #    tasks, anything a job left behind).  The namespace was recorded at start.
    for f in "$RUN"/*.utsns; do
        [ -e "$f" ] || continue
        ns=$(cat "$f")
        if [ -z "$ns" ] || [ -z "$root_uts" ] || [ "$ns" = "$root_uts" ]; then
            log "refusing to kill by namespace $ns (not a node namespace)"; continue
        fi
        while read -r p; do [ -n "$p" ] && pids+=("$p"); done < <(pids_in_uts_ns "$ns")
    done
    # slurmd pid files too (e.g. a slurmd whose namespace was not recorded yet).
    for f in "$RUN"/slurmd-*.pid; do
        [ -e "$f" ] || continue
        pid=$(read_pid "$f")
        pid_alive "$pid" slurmd && pids+=("$pid")
    done
    # netns mode: whatever runs inside the lab's network namespaces.
    if [ -f "$LAB/created" ] && command -v ip >/dev/null; then
        while read -r kind name; do
            [ "$kind" = netns ] || continue
            while read -r p; do [ -n "$p" ] && pids+=("$p"); done < <(ip netns pids "$name" 2>/dev/null || true)
        done <"$LAB/created"
    fi
    # SIGTERM to the slurmd daemons; SIGKILL to the rest (slurmstepd and job processes
    # would take KillWait seconds to go, and the lab's state is thrown away anyway).
    # Never ourselves or our parents.
    local safe=() p
    for p in "${pids[@]+"${pids[@]}"}"; do
        [ "$p" = "$$" ] || [ "$p" = "$PPID" ] || [ "$p" = 1 ] || safe+=("$p")
    done
    for p in "${safe[@]+"${safe[@]}"}"; do
        if pid_alive "$p" slurmd; then kill -TERM "$p" 2>/dev/null || true; else kill -KILL "$p" 2>/dev/null || true; fi
    done

    # 2. slurmctld and munged, by pid file (munged ~2 s and slurmctld ~3 s to exit).
    local daemons=()
    pid=$(read_pid "$RUN/slurmctld.pid"); pid_alive "$pid" slurmctld && daemons+=("$pid")
    pid=$(read_pid "$RUN/munged.pid"); pid_alive "$pid" munged && daemons+=("$pid")
    if [ ${#daemons[@]} -gt 0 ]; then kill -TERM "${daemons[@]}" 2>/dev/null || true; fi
    wait_gone 8 "${safe[@]+"${safe[@]}"}" "${daemons[@]+"${daemons[@]}"}"

    # 3. Network objects this lab created (recorded in $LAB/created).
    if [ -f "$LAB/created" ] && command -v ip >/dev/null; then
        local kind name
        while read -r kind name; do
            case $kind in
                netns) ip netns del "$name" 2>/dev/null || true ;;
                link) ip link del "$name" 2>/dev/null || true ;;
            esac
        done < <(tac "$LAB/created")
        rm -f "$LAB/created"
    fi
    rm -rf "$RUN"
    [ -f "$STATE" ] && sed -i 's/^SLURM_LAB_RUNNING=.*/SLURM_LAB_RUNNING=0/' "$STATE"
    log "stopped (logs kept in $LOG)"
}

# ---------------------------------------------------------------- start
record() { echo "$*" >>"$LAB/created"; }

port_busy() { ss -Htln "sport = :$1" 2>/dev/null | grep -q .; }

write_config() {
    local mode=$1 nodes=$2 gpus=$3 ctl_addr=$4 cpus host i g
    cpus=$(nproc)
    host=$(hostname -s)
    mkdir -p "$LAB/etc" "$RUN" "$LOG" "$LAB/spool/ctld" "$LAB/fakedev"

    # munge key (munged insists on 0400/0600 and root ownership).
    head -c 1024 /dev/urandom >"$LAB/etc/munge.key"
    chmod 600 "$LAB/etc/munge.key"

    # Fake GPUs: Slurm wants a character device per GPU; symlinks to /dev/null pass.
    for ((g = 0; g < gpus; g++)); do ln -sfn /dev/null "$LAB/fakedev/nvidia$g"; done

    # Hosts file bind-mounted over /etc/hosts inside each node's mount namespace.
    {
        echo "127.0.0.1 localhost"
        echo "::1 localhost ip6-localhost ip6-loopback"
        echo "$ctl_addr $host slurm-lab-controller"
        for ((i = 1; i <= nodes; i++)); do echo "$(node_addr "$mode" "$i") node$i"; done
    } >"$LAB/etc/hosts"

    {
        cat <<EOF
# Generated by tests/slurm_lab/lab.sh ($mode mode, $nodes nodes, $gpus GPUs per node)
ClusterName=traceml-lab
SlurmctldHost=$host($ctl_addr)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$RUN/munge.socket
StateSaveLocation=$LAB/spool/ctld
SlurmdSpoolDir=$LAB/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
GresTypes=gpu
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0
SchedulerType=sched/backfill
MinJobAge=600
ReturnToService=2
SlurmctldTimeout=120
SlurmdTimeout=300
InactiveLimit=0
# Slurm's default: scancel, preemption and time limits SIGKILL 30 s after their SIGTERM, the
# bound docs/slurm.md promises the summary within (the lab had 5 s: a loaded CI machine's
# summary took longer, and the scancel test then found none)
KillWait=30
Waittime=0
EOF
        for ((i = 1; i <= nodes; i++)); do
            local gres=""
            [ "$gpus" -gt 0 ] && gres=" Gres=gpu:$gpus"
            echo "NodeName=node$i NodeHostname=node$i NodeAddr=$(node_addr "$mode" "$i") Port=$(node_port "$mode" "$i") CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1$gres State=UNKNOWN"
        done
        echo "PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"

    : >"$LAB/etc/gres.conf"
    if [ "$gpus" -gt 0 ]; then
        echo "NodeName=node[1-$nodes] Name=gpu File=$LAB/fakedev/nvidia[0-$((gpus - 1))]" >"$LAB/etc/gres.conf"
    fi
    # gres.conf is read from the directory of slurm.conf.
    cat >"$STATE" <<EOF
SLURM_LAB_RUNNING=1
SLURM_LAB_MODE=$mode
SLURM_LAB_NODES=$nodes
SLURM_LAB_GPUS_PER_NODE=$gpus
SLURM_LAB_HOST_ADDR=$ctl_addr
EOF
}

node_addr() { if [ "$1" = netns ]; then echo "$NET_PREFIX.$((10 + $2))"; else echo "$LO_PREFIX.$((10 + $2))"; fi; }
node_port() { if [ "$1" = netns ]; then echo "$NETNS_SLURMD_PORT"; else echo "$((16818 + $2))"; fi; }

setup_netns() {
    local nodes=$1 i ns veth peer
    command -v ip >/dev/null || die "netns mode needs 'ip' (iproute2)"
    ip link show "$BRIDGE" >/dev/null 2>&1 && die "bridge $BRIDGE already exists (another lab running? try: lab.sh stop, or ip link del $BRIDGE)"
    ip link add "$BRIDGE" type bridge || die "cannot create bridge $BRIDGE (no bridge support?)"
    record link "$BRIDGE"
    ip addr add "$NET_PREFIX.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for ((i = 1; i <= nodes; i++)); do
        ns=$NETNS_PREFIX$i veth=$VETH_PREFIX$i peer=slab-p$i
        ip netns list | grep -qw "^$ns" && die "netns $ns already exists (another lab running? try: lab.sh stop, or ip netns del $ns)"
        ip netns add "$ns"
        record netns "$ns"
        ip link add "$veth" type veth peer name "$peer" || die "cannot create veth pair (no veth support?)"
        record link "$veth"
        ip link set "$peer" netns "$ns"
        ip link set "$veth" master "$BRIDGE"
        ip link set "$veth" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$(node_addr netns "$i")/24" dev "$peer"
        ip -n "$ns" link set "$peer" up
    done
}

fail_start() {
    local f
    log "start failed: $*"
    for f in "$LOG"/slurmctld.log "$LOG"/slurmd-*.log "$LOG"/munged.log "$LOG"/*.out; do
        [ -s "$f" ] || continue
        echo "----- tail $f" >&2
        tail -n 15 "$f" >&2
    done
    timeout 5 sinfo -N -l >&2 2>&1 || true
    timeout 5 scontrol show node 2>&1 | grep -E 'NodeName|State|Reason' >&2 || true
    die "$* (logs: $LOG)"     # the EXIT trap of do_start stops what was started
}

# EXIT trap while starting: a start that fails half-way leaves nothing running.
start_exit() {
    local rc=$1
    trap - EXIT
    [ "$rc" = 0 ] && return 0
    log "start failed (exit $rc); stopping what was started"
    do_stop || true
    exit "$rc"
}

do_start() {
    local mode=loopback nodes=2 gpus=2
    while [ $# -gt 0 ]; do
        case $1 in
            --mode) mode=$2; shift 2 ;;
            --mode=*) mode=${1#*=}; shift ;;
            --nodes) nodes=$2; shift 2 ;;
            --nodes=*) nodes=${1#*=}; shift ;;
            --gpus-per-node) gpus=$2; shift 2 ;;
            --gpus-per-node=*) gpus=${1#*=}; shift ;;
            *) die "unknown start option: $1" ;;
        esac
    done
    case $mode in loopback | netns) ;; *) die "--mode must be loopback or netns, not '$mode'" ;; esac
    if ! [[ $nodes =~ ^[0-9]+$ ]] || [ "$nodes" -lt 1 ] || [ "$nodes" -gt 50 ]; then die "--nodes must be 1..50"; fi
    if ! [[ $gpus =~ ^[0-9]+$ ]] || [ "$gpus" -gt 16 ]; then die "--gpus-per-node must be 0..16"; fi

    local t0=$SECONDS
    do_stop >/dev/null 2>&1 || true       # idempotent: a previous lab goes first
    install_packages
    local p i
    for p in $CTLD_PORT; do port_busy "$p" && die "port $p is in use (another Slurm lab or slurmctld running?)"; done
    if [ "$mode" = loopback ]; then
        for ((i = 1; i <= nodes; i++)); do
            port_busy "$(node_port loopback "$i")" && die "port $(node_port loopback "$i") is in use"
        done
    fi

    # Fresh state every start (old logs, job state and configs go).
    mkdir -p "$LAB"
    touch "$MARKER"
    rm -rf "${LAB:?}/etc" "$LAB/spool" "$LOG" "$RUN" "$LAB/selftest" "$LAB/created"
    trap 'start_exit $?' EXIT
    trap 'exit 130' INT TERM
    local ctl_addr=127.0.0.1
    [ "$mode" = netns ] && ctl_addr=$NET_PREFIX.1
    write_config "$mode" "$nodes" "$gpus" "$ctl_addr"
    export SLURM_CONF=$CONF
    [ "$mode" = netns ] && setup_netns "$nodes"

    # munged with its own socket and key (the system munge is never used).
    munged --force --socket="$RUN/munge.socket" --key-file="$LAB/etc/munge.key" \
        --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" --seed-file="$RUN/munged.seed" \
        </dev/null >"$LOG/munged.out" 2>&1 9>&- || fail_start "munged did not start"
    local deadline=$((SECONDS + 10))
    until [ -S "$RUN/munge.socket" ]; do
        [ $SECONDS -ge $deadline ] && fail_start "munged socket $RUN/munge.socket did not appear"
        sleep 0.1
    done

    slurmctld -f "$CONF" </dev/null >"$LOG/slurmctld.out" 2>&1 9>&- || fail_start "slurmctld did not start"

    local i node cmd pid ns
    for ((i = 1; i <= nodes; i++)); do
        node=node$i
        mkdir -p "$LAB/spool/$node"
        cmd="hostname $node && mount --bind '$LAB/etc/hosts' /etc/hosts && exec slurmd -N $node -f '$CONF'"
        if [ "$mode" = netns ]; then
            # nsenter, not `ip netns exec`: that one remounts /sys, which hides
            # /sys/fs/cgroup, and slurmd 22.05 then fails ("Unable to initialize cgroup plugin").
            nsenter --net="/run/netns/$NETNS_PREFIX$i" unshare --uts --mount --propagation private sh -c "$cmd" \
                </dev/null >"$LOG/slurmd-$node.out" 2>&1 9>&- || fail_start "slurmd $node did not start"
        else
            unshare --uts --mount --propagation private sh -c "$cmd" \
                </dev/null >"$LOG/slurmd-$node.out" 2>&1 9>&- || fail_start "slurmd $node did not start"
        fi
    done
    # Record each node's UTS namespace: stop kills everything inside it.
    for ((i = 1; i <= nodes; i++)); do
        node=node$i
        deadline=$((SECONDS + 10))
        while :; do
            pid=$(read_pid "$RUN/slurmd-$node.pid")
            pid_alive "$pid" slurmd && break
            [ $SECONDS -ge $deadline ] && fail_start "slurmd $node wrote no pid file"
            sleep 0.1
        done
        ns=$(readlink "/proc/$pid/ns/uts")
        [ "$ns" != "$(readlink /proc/self/ns/uts)" ] || fail_start "slurmd $node is not in its own UTS namespace"
        echo "$ns" >"$RUN/$node.utsns"
    done

    # Wait until every node is idle.
    deadline=$((SECONDS + START_TIMEOUT))
    local out idle
    while :; do
        out=$(timeout 5 sinfo -h -N -o '%N %t' 2>&1 || true)
        idle=$(awk '$2 == "idle"' <<<"$out" | sort -u | wc -l)
        [ "$idle" -ge "$nodes" ] && break
        pid=$(read_pid "$RUN/slurmctld.pid")
        pid_alive "$pid" slurmctld || [ $((SECONDS - t0)) -lt 3 ] || fail_start "slurmctld exited"
        [ $SECONDS -ge $deadline ] && fail_start "nodes not idle after ${START_TIMEOUT}s: $(tr '\n' ' ' <<<"$out")"
        sleep 0.2
    done
    # slurmctld makes its first scheduling pass ~3 s after it starts; a job submitted
    # before that waits for it.  Wait for the pass (it logs its SchedulerParameters) so
    # that job latencies are the steady ~1 s from the first job on.  Not fatal.
    deadline=$((SECONDS + 10))
    until grep -q 'SchedulerParameters=' "$LOG/slurmctld.log" 2>/dev/null; do
        [ $SECONDS -ge $deadline ] && { log "note: no first scheduling pass seen yet; continuing"; break; }
        sleep 0.1
    done
    log "up: $mode mode, $nodes nodes ($(sinfo -h -N -o '%N' | sort -u | paste -sd ' ')), $gpus GPUs/node, in $((SECONDS - t0))s"
    log "clients: export SLURM_CONF=$CONF   (or: eval \"\$($0 env)\")"
    trap - EXIT INT TERM
}

# ---------------------------------------------------------------- status / env
load_state() {
    [ -f "$STATE" ] || return 1
    # shellcheck disable=SC1090
    . "$STATE"
    [ "${SLURM_LAB_RUNNING:-0}" = 1 ]
}

do_status() {
    if ! load_state; then echo "slurm lab at $LAB: not running"; return 3; fi
    echo "slurm lab at $LAB: $SLURM_LAB_MODE mode, $SLURM_LAB_NODES nodes, $SLURM_LAB_GPUS_PER_NODE GPUs/node"
    local ok=0 pid name f d
    for f in "$RUN"/munged.pid "$RUN"/slurmctld.pid "$RUN"/slurmd-*.pid; do
        [ -e "$f" ] || continue
        name=$(basename "$f" .pid); pid=$(read_pid "$f")
        case $name in slurmd-*) d=slurmd ;; *) d=$name ;; esac
        if pid_alive "$pid" "$d"; then echo "  $name: pid $pid"; else echo "  $name: DEAD"; ok=3; fi
    done
    SLURM_CONF=$CONF timeout 5 sinfo -N -o '  %N %t %G' 2>&1 || ok=3
    return $ok
}

do_env() {
    load_state || { log "no running lab at $LAB (run: $0 start)"; return 1; }
    printf 'export SLURM_CONF=%q\n' "$CONF"
    printf 'export SLURM_LAB_DIR=%q\n' "$LAB"
    printf 'export SLURM_LAB_MODE=%q\n' "$SLURM_LAB_MODE"
    printf 'export SLURM_LAB_NODES=%q\n' "$SLURM_LAB_NODES"
    printf 'export SLURM_LAB_GPUS_PER_NODE=%q\n' "$SLURM_LAB_GPUS_PER_NODE"
    printf 'export SLURM_LAB_HOST_ADDR=%q\n' "$SLURM_LAB_HOST_ADDR"
}

# ---------------------------------------------------------------- selftest
# wait_job ID TIMEOUT: poll until the job ends; print its exit code (128+signal if killed).
wait_job() {
    local id=$1 deadline=$((SECONDS + $2)) info state code
    while [ $SECONDS -lt $deadline ]; do
        info=$(timeout 10 scontrol -o show job "$id" 2>/dev/null || true)
        state=$(grep -o 'JobState=[A-Z_]*' <<<"$info" | cut -d= -f2 || true)
        case $state in
            PENDING | RUNNING | CONFIGURING | COMPLETING | SUSPENDED | REQUEUED* | RESIZING | "") sleep 0.2 ;;
            *)
                code=$(grep -o 'ExitCode=[0-9]*:[0-9]*' <<<"$info" | head -n 1 | cut -d= -f2)
                if [ "${code#*:}" != 0 ]; then echo $((128 + ${code#*:})); else echo "${code%%:*}"; fi
                return 0 ;;
        esac
    done
    return 1
}

do_selftest() {
    load_state || die "no running lab at $LAB (run: $0 start)"
    export SLURM_CONF=$CONF
    local nodes=$SLURM_LAB_NODES gpus=$SLURM_LAB_GPUS_PER_NODE d="$LAB/selftest" t0=$SECONDS rc
    rm -rf "$d"; mkdir -p "$d"
    # Drop job variables inherited from an enclosing allocation, if any.
    unset "${!SLURM_JOB@}" "${!SLURM_STEP@}" SLURM_NODEID SLURM_PROCID SLURM_NNODES SLURM_NTASKS 2>/dev/null || true

    # 1. One task per node; the wrapper runs on each node, so $SLURM_NODEID is per node.
    cat >"$d/task.sh" <<'EOF'
#!/bin/bash
echo "TASK host=$(hostname) nodeid=${SLURM_NODEID:-unset} gpus=${SLURM_GPUS_ON_NODE:-unset} procid=${SLURM_PROCID:-unset} cuda=${CUDA_VISIBLE_DEVICES:-unset}"
EOF
    cat >"$d/job.sh" <<EOF
#!/bin/bash
srun bash '$d/task.sh'
EOF
    local gres=() expect_gpus=unset
    if [ "$gpus" -gt 0 ]; then gres=("--gres=gpu:$gpus"); expect_gpus=$gpus; fi
    rc=0
    timeout 120 sbatch --wait --parsable --nodes="$nodes" --ntasks-per-node=1 "${gres[@]+"${gres[@]}"}" \
        -o "$d/job.out" -e "$d/job.out" "$d/job.sh" >"$d/sbatch.out" 2>&1 || rc=$?
    [ "$rc" = 0 ] || { cat "$d/sbatch.out" "$d/job.out" >&2 2>/dev/null; die "selftest: sbatch --wait exited $rc"; }
    local i line fail=0
    for ((i = 0; i < nodes; i++)); do
        line=$(grep "^TASK .* nodeid=$i " "$d/job.out" || true)
        case $line in
            *"host=node$((i + 1)) nodeid=$i gpus=$expect_gpus "*) echo "selftest: ok   $line" ;;
            *) echo "selftest: FAIL node $i: expected host=node$((i + 1)) nodeid=$i gpus=$expect_gpus, got: '${line:-no line}'"; fail=1 ;;
        esac
    done
    [ "$(grep -c '^TASK ' "$d/job.out")" = "$nodes" ] || { echo "selftest: FAIL expected $nodes TASK lines"; fail=1; }
    [ $fail = 0 ] || { cat "$d/job.out" >&2; die "selftest: per-node job values wrong (output: $d/job.out)"; }

    # 2. sbatch --wait returns the job's exit code.
    rc=0
    timeout 60 sbatch --wait --wrap 'exit 7' -o /dev/null >/dev/null 2>&1 || rc=$?
    [ "$rc" = 7 ] || die "selftest: 'sbatch --wait' of an 'exit 7' job returned $rc, expected 7"
    echo "selftest: ok   sbatch --wait of 'exit 7' returned 7"

    # 3. TCP: node 0's task listens on 0.0.0.0:PORT, node 1's task connects to the first
    #    hostname of the nodelist (what torchrun-style rendezvous does).
    local py
    py=$(command -v python3 || true)
    if [ "$nodes" -ge 2 ] && [ -n "$py" ]; then
        cat >"$d/tcp.py" <<'EOF'
import os, socket, subprocess, sys, time
port = int(sys.argv[1])
nid = int(os.environ["SLURM_NODEID"])
host = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                      capture_output=True, text=True, check=True).stdout.split()[0]
deadline = time.time() + 40
if nid == 0:
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port)); srv.listen(8); srv.settimeout(1)
    while time.time() < deadline:          # accept until the expected handshake arrives
        try:
            c, peer = srv.accept()
        except socket.timeout:
            continue
        c.settimeout(5)
        try:
            data = c.recv(16)
        except OSError:
            data = b""
        if data == b"ping":
            c.sendall(b"pong"); c.close()
            print(f"TCP server {socket.gethostname()} got ping from {peer[0]}"); sys.exit(0)
        c.close()
    print("TCP server: no ping before deadline"); sys.exit(1)
elif nid == 1:
    while time.time() < deadline:
        try:
            c = socket.create_connection((host, port), timeout=2)
        except OSError:
            time.sleep(0.1); continue
        c.sendall(b"ping"); c.settimeout(5)
        reply = c.recv(16)
        print(f"TCP client {socket.gethostname()} -> {host}:{port} reply={reply.decode()}")
        sys.exit(0 if reply == b"pong" else 1)
    print(f"TCP client: could not connect to {host}:{port}"); sys.exit(1)
EOF
        cat >"$d/tcp.sh" <<EOF
#!/bin/bash
srun --nodes=2 --ntasks=2 --ntasks-per-node=1 '$py' '$d/tcp.py' $SELFTEST_PORT
EOF
        # Submitted without --wait and polled: sbatch --wait sleeps 2 s, then 8 s, then 32 s.
        local id
        id=$(sbatch --parsable --nodes=2 --ntasks-per-node=1 -o "$d/tcp.out" -e "$d/tcp.out" "$d/tcp.sh") ||
            die "selftest: sbatch of the TCP job failed"
        rc=$(wait_job "$id" 120) || die "selftest: TCP job $id did not finish within 120 s"
        if [ "$rc" != 0 ] || ! grep -q 'reply=pong' "$d/tcp.out"; then
            cat "$d/tcp.out" >&2; die "selftest: TCP rendezvous between node 0 and node 1 failed (rc=$rc)"
        fi
        sed 's/^/selftest: ok   /' "$d/tcp.out"
    else
        echo "selftest: skip TCP rendezvous (needs >= 2 nodes and python3)"
    fi
    echo "selftest: PASSED ($SLURM_LAB_MODE mode, $nodes nodes, $gpus GPUs/node) in $((SECONDS - t0))s"
}

# ---------------------------------------------------------------- main
cmd=${1:-}
[ $# -gt 0 ] && shift
check_lab_dir
case $cmd in
    start) need_root; with_lock; do_start "$@" ;;
    stop) need_root; with_lock; do_stop ;;
    status) do_status ;;
    selftest) need_root; with_lock; do_selftest ;;
    env) do_env ;;
    -h | --help | help) usage ;;
    *) usage ;;
esac
