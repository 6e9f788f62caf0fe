"""The sandbox's seccomp filter: no kernel keyrings, no memory outside any process, no foreign tables.

A kernel keyring outlives the process that filled it: the user keyring belongs to the user id,
and with a root grader every task of a worker runs as the same sandbox user, so a key one
program stores (`add_key`) a later task of that worker could read (`keyctl`), a channel between
tasks that no mount or PID namespace closes. Nothing a graded program needs uses keyrings, so
`add_key`, `request_key` and `keyctl` fail with ENOSYS (as on a kernel built without keys).
`memfd_create` and `shmget` make memory that belongs to no process's address space (and so to
no per-process limit: a grader without a cgroup could not bound it), and `io_uring_setup` opens
a way to run operations that this filter never sees: they fail the same way.
System calls through another table (i386 `int 0x80` or x32 on x86-64) are refused whole, so
the three cannot be reached by another number.

bubblewrap loads the filter (`--seccomp FD`: a classic BPF program, `struct sock_filter[]`)
just before it starts the harness, so the harness and everything the program starts run under
it. On an architecture not listed here no filter is loaded and `SECCOMP_FILTER` is None.
"""
from __future__ import annotations

import os
import platform
import struct

# (audit arch, numbers of add_key, request_key, keyctl, memfd_create, shmget, io_uring_setup)
# by `platform.machine()` (the kernel's syscall tables of each architecture).
_ARCHES = {
    "x86_64": (0xC000003E, (248, 249, 250, 319, 29, 425)),
    "aarch64": (0xC00000B7, (217, 218, 219, 279, 194, 425)),
}
_X32_BIT = 0x40000000
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_ENOSYS = 38
_NR, _ARCH = 0, 4          # offsets in struct seccomp_data


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def build_filter(machine: str) -> bytes | None:
    """The BPF program for `machine`, or None where its numbers are not known here."""
    if machine not in _ARCHES:
        return None
    arch, denied = _ARCHES[machine]
    deny = _RET_K, _ERRNO | _ENOSYS
    body = [_insn(_LD_W_ABS, _NR), _insn(_JGE_K, _X32_BIT, jt=len(denied) + 1)]
    body += [_insn(_JEQ_K, nr, jt=len(denied) - j) for j, nr in enumerate(denied)]
    body += [_insn(_RET_K, _ALLOW), _insn(*deny)]
    # Another arch: jump over the whole body to a second deny.
    return b"".join([_insn(_LD_W_ABS, _ARCH), _insn(_JEQ_K, arch, jf=len(body)), *body, _insn(*deny)])


SECCOMP_FILTER = build_filter(platform.machine())


def filter_fd() -> int | None:
    """A pipe's read end holding the filter, for bwrap's `--seccomp` (it reads it to the end);
    None when there is no filter for this machine."""
    if SECCOMP_FILTER is None:
        return None
    r, w = os.pipe()
    os.write(w, SECCOMP_FILTER)   # a few dozen bytes: never blocks
    os.close(w)
    return r
