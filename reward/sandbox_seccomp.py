"""The sandbox's seccomp filter: no memory outside the sandbox's limits, no way out of them.

What a program can fill without it counting against any limit of a grader without a cgroup (the
harness's watch sees each process's anonymous and shared memory, the tmpfs is size-capped) is
closed here, at the system call:

- **Namespaces and mounts.** A user namespace gives a program every capability inside it: with
  `unshare(CLONE_NEWUSER | CLONE_NEWNS)` it mounted a tmpfs of its own and wrote 1,120 MiB into
  it past both the disk and the memory limit (issue 61). `unshare`, `setns`, `clone` with any
  `CLONE_NEW*` flag, the mount calls and `clone3` (whose flags sit in memory a filter cannot
  read; glibc falls back to `clone` when it is missing, as under Docker's filter) fail.
- **Memory that belongs to no process**: `memfd_create`, SysV shared memory, message queues and
  semaphore sets, POSIX message queues, `memfd_secret`, kernel keyrings (a key also outlives the
  task: with a root grader every task of a worker runs as the same user, so a later task could
  read it), `io_uring`, `io_setup`, `bpf`, `userfaultfd`, `perf_event_open`: nothing a graded
  program needs.
- **Kernel buffers**: sockets are Unix sockets only (no network exists in the sandbox anyway),
  and a request for bigger socket buffers (`SO_SNDBUF`, `SO_RCVBUF` and their `FORCE` forms) is
  ignored: each keeps the system's default (`net.core.wmem_default`), where `wmem_max` (4 MiB on
  many hosts) let each of 256 descriptors per process hold 8 MiB (1,100 MiB held with 10 MiB
  resident). A pipe keeps its default 64 KiB (`F_SETPIPE_SZ` fails). With the harness's
  descriptor limit, what sockets and pipes can hold is bounded (docs/reward.md, the limits).

System calls through another table (i386 `int 0x80` or x32 on x86-64) are refused whole, so none
of these can be reached by another number. A refused call fails with ENOSYS, as on a kernel
without it (EAFNOSUPPORT for another socket family, EPERM for a bigger pipe).

bubblewrap loads the filter (`--seccomp FD`: a classic BPF program, `struct sock_filter[]`)
just before it starts the harness, so the harness and everything the program starts run under
it. On an architecture not listed here no filter is loaded and `SECCOMP_FILTER` is None.
"""
from __future__ import annotations

import os
import platform
import struct

_REFUSED = ("add_key", "request_key", "keyctl", "memfd_create", "shmget", "io_uring_setup", "unshare", "setns",
            "clone3", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
            "fspick", "mount_setattr", "msgget", "semget", "mq_open", "memfd_secret", "io_setup", "bpf",
            "userfaultfd", "perf_event_open")
_CHECKED = ("clone", "socket", "setsockopt", "fcntl")
# The kernel's syscall tables of each architecture (`platform.machine()`): audit arch, numbers.
_ARCHES = {
    "x86_64": (0xC000003E, dict(zip(_REFUSED + _CHECKED, (
        248, 249, 250, 319, 29, 425, 272, 308, 435, 165, 166, 155, 428, 429, 430, 431, 432, 433, 442, 68, 64,
        240, 447, 206, 321, 323, 298, 56, 41, 54, 72), strict=True))),
    "aarch64": (0xC00000B7, dict(zip(_REFUSED + _CHECKED, (
        217, 218, 219, 279, 194, 425, 97, 268, 435, 40, 39, 41, 428, 429, 430, 431, 432, 433, 442, 186, 190,
        180, 447, 0, 280, 282, 241, 220, 198, 208, 25), strict=True))),
}
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_CLONE_NEW = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_AF_UNIX, _SOL_SOCKET, _F_SETPIPE_SZ = 1, 1, 1031
_BUFFER_OPTIONS = (7, 8, 32, 33)          # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE
_X32_BIT = 0x40000000
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_ENOSYS, _EAFNOSUPPORT, _EPERM = 38, 97, 1
_NR, _ARCH = 0, 4          # offsets in struct seccomp_data


def _arg(i: int) -> int:
    return 16 + 8 * i      # the low 32 bits of args[i] (both architectures are little-endian)


def _assemble(program: list) -> bytes:
    """BPF from (code, k, true label, false label) and ("label", name); a label is a jump target
    (the next instruction when None)."""
    at, n = {}, 0
    for insn in program:
        if insn[0] == "label":
            at[insn[1]] = n
        else:
            n += 1
    out, n = [], 0
    for insn in program:
        if insn[0] == "label":
            continue
        code, k, jt, jf = (*insn, None, None)[:4]
        n += 1
        out.append(struct.pack("HBBI", code, at[jt] - n if jt else 0, at[jf] - n if jf else 0, k))
    return b"".join(out)


def build_filter(machine: str) -> bytes | None:
    """The BPF program for `machine`, or None where its numbers are not known here."""
    if machine not in _ARCHES:
        return None
    arch, nr = _ARCHES[machine]
    deny = (_RET_K, _ERRNO | _ENOSYS)
    program = [(_LD_W_ABS, _ARCH), (_JEQ_K, arch, None, "deny"),
               (_LD_W_ABS, _NR), (_JGE_K, _X32_BIT, "deny", None)]
    program += [(_JEQ_K, nr[name], "deny", None) for name in _REFUSED]
    program += [(_JEQ_K, nr[name], name, None) for name in _CHECKED]
    program += [(_RET_K, _ALLOW),
                ("label", "clone"), (_LD_W_ABS, _arg(0)), (_JSET_K, _CLONE_NEW, "deny", "allow"),
                ("label", "socket"), (_LD_W_ABS, _arg(0)), (_JEQ_K, _AF_UNIX, "allow", None),
                (_RET_K, _ERRNO | _EAFNOSUPPORT),
                ("label", "setsockopt"), (_LD_W_ABS, _arg(1)), (_JEQ_K, _SOL_SOCKET, None, "allow"),
                (_LD_W_ABS, _arg(2)), *[(_JEQ_K, o, "ignore", None) for o in _BUFFER_OPTIONS], (_RET_K, _ALLOW),
                ("label", "ignore"), (_RET_K, _ERRNO | 0),       # errno 0: the call returns 0, doing nothing
                ("label", "fcntl"), (_LD_W_ABS, _arg(1)), (_JEQ_K, _F_SETPIPE_SZ, None, "allow"),
                (_RET_K, _ERRNO | _EPERM),
                ("label", "allow"), (_RET_K, _ALLOW),
                ("label", "deny"), deny]
    return _assemble(program)


SECCOMP_FILTER = build_filter(platform.machine())


def filter_fd() -> int | None:
    """A pipe's read end holding the filter, for bwrap's `--seccomp` (it reads it to the end);
    None when there is no filter for this machine."""
    if SECCOMP_FILTER is None:
        return None
    r, w = os.pipe()
    os.write(w, SECCOMP_FILTER)   # a few hundred bytes: never blocks
    os.close(w)
    return r
