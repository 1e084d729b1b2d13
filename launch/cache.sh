#!/usr/bin/env bash
# cache.sh - run a training job on this machine around one shmcache session, then show the cache.
#
# The recipe of MindSpore's cache.sh, without a server: shmcache needs none. The session is
# created by the launcher if it does not exist and kept afterwards, so the next run finds the
# cache warm; --destroy drops it at the end. See launch/README.md.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: launch/cache.sh [-n N] [-s SESSION] [--size MIB] [--spill-dir DIR] [--destroy]
                       [--] script.py [script args...]

Runs `python -m shmcache.launch --nproc N --session SESSION ... script.py args...` (the session
is created if missing and kept for the next run), then prints `shmcache stat SESSION`.

  -n, --nproc N        processes on this machine: a number, or auto (one per GPU). Default 1
  -s, --session NAME   the session. Default: $SHMCACHE_SESSION, else "default"
      --size MIB       memory cap of each cache in MiB. Default: automatic
      --spill-dir DIR  spill to DIR when memory is full (turns spilling on)
      --destroy        destroy the session, and everything cached in it, after the statistics
  -h, --help           this help

Environment: PYTHON (default python3), SHMCACHE_DIR (the namespace), SHMCACHE_SPILL_DIR.
The job sees CACHE_SH_PRINTS_STAT=1: a script that prints `shmcache stat` at its end (as
examples/train.py does) can leave it to this script, so the table appears once.
Exit status: the launcher's (see `python -m shmcache.launch -h`).

Example:
  launch/cache.sh -n 4 -s imagenet --size 65536 train.py --epochs 10
USAGE
}

die() {
    echo "cache.sh: $*" >&2
    exit 2
}

PYTHON=${PYTHON:-python3}
NPROC=1
SESSION=${SHMCACHE_SESSION:-default}
DESTROY=0
launcher_opts=()

while [ $# -gt 0 ]; do
    case $1 in
        -h | --help) usage; exit 0 ;;
        -n | --nproc) [ $# -ge 2 ] || die "$1 needs a value, e.g. $1 4"; NPROC=$2; shift 2 ;;
        -s | --session) [ $# -ge 2 ] || die "$1 needs a name"; SESSION=$2; shift 2 ;;
        --size) [ $# -ge 2 ] || die "--size needs a number of MiB"; launcher_opts+=(--size "$2"); shift 2 ;;
        --spill-dir)
            [ $# -ge 2 ] || die "--spill-dir needs a directory"
            launcher_opts+=(--spilling --spill-dir "$2")
            shift 2 ;;
        --destroy) DESTROY=1; shift ;;
        --) shift; break ;;
        -*) die "unknown option $1; see -h (options of the script go after the script)" ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || die "no script given; usage: launch/cache.sh [options] script.py [args...] (see -h)"

# This script prints the statistics once the job is done: tell the job not to (examples/*.py).
export CACHE_SH_PRINTS_STAT=1
status=0
"$PYTHON" -m shmcache.launch --nproc "$NPROC" --session "$SESSION" \
    ${launcher_opts[@]+"${launcher_opts[@]}"} -- "$@" || status=$?

echo "== shmcache stat $SESSION =="
# A failure to print statistics must not hide the job's own status.
"$PYTHON" -m shmcache stat "$SESSION" || echo "cache.sh: 'shmcache stat $SESSION' failed" >&2

if [ "$DESTROY" = 1 ]; then
    "$PYTHON" -m shmcache destroy "$SESSION" || echo "cache.sh: 'shmcache destroy $SESSION' failed" >&2
fi
exit "$status"
