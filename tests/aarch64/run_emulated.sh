#!/usr/bin/env bash
# Run shmcache's tests on aarch64 under emulation: a Debian bookworm arm64 root (debootstrap) run
# by qemu-user-static through binfmt_misc, with aarch64 wheels of the dependencies and posix_ipc
# built from source inside the root. Without torch by default: PyPI's aarch64 torch 2.13.0 is the
# CUDA build (it will not import without its several GB of nvidia-* packages) and the CPU build is
# on download.pytorch.org; pass the test files that do not import torch (the layers below it, see
# tests/unit/test_layers.py), or put a CPU aarch64 torch wheel in $ARM64_WHEELS and set ARM64_TORCH=1.
#
# Emulation cannot show weak memory ordering (qemu-user runs guest loads and stores on the host's
# x86 ordering); it shows what else is x86-only: syscall numbers (membarrier, prctl), page size and
# struct layouts assumptions, native wheels. See README "Platforms".
#
#   sudo tests/aarch64/run_emulated.sh tests/unit/cache/test_store.py tests/crash
#   sudo tests/aarch64/run_emulated.sh tests/unit/cache/test_store.py -k batch
#
# Needs root (debootstrap, chroot, mounts) and network for apt and pip the first time; the root and
# the wheels are kept (ARM64_ROOT, default /var/tmp/shmcache-arm64) so later runs start at once.
# The log of the run is printed and kept in $ARM64_ROOT.log.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
ROOT=${ARM64_ROOT:-/var/tmp/shmcache-arm64}
WHEELS=${ARM64_WHEELS:-$ROOT.wheels}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH=${TORCH_VERSION:-2.13.0}
[ $# -gt 0 ] || { echo "name the test files or folders to run" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, chroot, mounts)" >&2; exit 2; }

command -v qemu-aarch64-static >/dev/null && command -v debootstrap >/dev/null \
    || apt-get install -y qemu-user-static debootstrap binfmt-support
[ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64

if [ ! -x "$ROOT/usr/bin/python3" ]; then
    debootstrap --arch=arm64 --include=python3,python3-venv,python3-pip,python3-dev,gcc,libc6-dev,procps \
        bookworm "$ROOT" "$MIRROR"
fi

if [ ! -e "$WHEELS/.done" ]; then  # aarch64 wheels, fetched by the host's pip (fast, no emulation)
    mkdir -p "$WHEELS"
    P=(--only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64
       --platform manylinux_2_17_aarch64 --platform any --python-version 3.11 --implementation cp -d "$WHEELS")
    python3 -m pip download "${P[@]}" --no-deps "torch==$TORCH"  # not its nvidia-* (CUDA) packages
    python3 -m pip download "${P[@]}" numpy zstandard filelock tqdm pytest pytest-timeout typing_extensions \
        sympy networkx jinja2 fsspec pillow redis async-timeout setuptools wheel
    python3 -m pip download --no-binary :all: --no-deps -d "$WHEELS" "posix_ipc>=1.1"
    touch "$WHEELS/.done"
fi

mkdir -p "$ROOT/repo" "$ROOT/wheels" "$ROOT/dev/shm" "$ROOT/proc"
cleanup() { for m in repo wheels dev/shm proc; do umount -l "$ROOT/$m" 2>/dev/null || true; done; }  # lazy: a child may linger
trap cleanup EXIT
mount --bind "$REPO" "$ROOT/repo"
mount --bind "$WHEELS" "$ROOT/wheels"
mount -t tmpfs -o size=2g tmpfs "$ROOT/dev/shm"
mount -t proc proc "$ROOT/proc"

IN=(chroot "$ROOT" /usr/bin/env -i PATH=/venv/bin:/usr/bin:/bin HOME=/root)  # none of the host's pip settings
if [ ! -e "$ROOT/venv/.done" ]; then
    "${IN[@]}" /bin/sh -ec '
        [ -x /venv/bin/python ] || python3 -m venv /venv
        pip install -q --no-index --find-links /wheels setuptools wheel
        pip install -q --no-index --find-links /wheels --no-build-isolation posix_ipc
        if [ "${ARM64_TORCH:-0}" = 1 ]; then pip install -q --no-index --find-links /wheels --no-deps torch; fi
        pip install -q --no-index --find-links /wheels numpy zstandard filelock tqdm pytest pytest-timeout \
            pillow redis fsspec typing_extensions sympy networkx jinja2
        touch /venv/.done'
fi

chroot "$ROOT" /bin/sh -c 'uname -m; /venv/bin/python -c "import platform, mmap; print(platform.machine(), mmap.PAGESIZE)"'
# -p no:cacheprovider: the repo is bind-mounted; timeouts: emulation is 10-50x slower
"${IN[@]}" PYTHONPATH=/repo /bin/sh -c "cd /repo && exec python -m pytest -p no:cacheprovider -o timeout=1800 -q -rfEs $*" \
    2>&1 | tee "$ROOT.log"
exit "${PIPESTATUS[0]}"
