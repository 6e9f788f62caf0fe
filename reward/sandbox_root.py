"""What a sandboxed program sees of the host: the interpreter, the libraries it loads, nothing else.

Binding the host's `/` read-only and dropping to another uid hides only what others cannot
read; a dataset, an experiment directory or a checkout with the usual permissions stays
readable, and a program that searches the filesystem for its own tests and prints the expected
output stored there passes them all. So bubblewrap builds a fresh root instead (its own tmpfs)
holding only, read-only:

- the interpreter's prefix (`sys.base_prefix`: the executable, libpython, the standard library),
  its `site-packages` emptied (a tmpfs over it: what is installed there is not the task's);
- the shared libraries the interpreter and the standard library's extension modules load (found
  with `ldd` once per process), each alone at the path the loader looks for it. Binding 43 files
  one by one cost ~7.6 ms of every start (a mount each), so they are gathered once, as hard
  links (copies across filesystems), in a folder per library set under the user's cache
  (`library_stage`), and that folder's `lib`, `lib64`, ... are bound whole: two mounts;
- the packages a task may import (`reward.sandbox_packages`), each bound alone (with its
  `<name>.libs` folder of bundled libraries, if any) under `PACKAGES_INSIDE`, which the harness
  puts on `sys.path`;

plus what bwrap makes fresh: a minimal `/dev`, the `/proc` of the program's own PID namespace,
a tmpfs `/tmp` and the private working directory. Nothing else of the host exists in there.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGES_INSIDE = "/opt/tandem-packages"
# Searched when `ldd` is missing: then whole library folders are shown instead of single files.
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")


@functools.cache
def shared_libraries(prefix: str = sys.base_prefix) -> tuple[tuple[str, str], ...]:
    """(file on the host, path inside) of every library the interpreter and its extension
    modules link, outside the prefix; () when `ldd` is unavailable."""
    if shutil.which("ldd") is None:
        return ()
    binaries = [os.path.realpath(sys.executable),
                *glob.glob(os.path.join(prefix, "lib", "python*", "lib-dynload", "*.so"))]
    found: dict[str, str] = {}
    for chunk in (binaries[i:i + 64] for i in range(0, len(binaries), 64)):
        r = subprocess.run(["ldd", *chunk], capture_output=True, text=True, check=False)
        for line in r.stdout.splitlines():
            words = line.split()
            # "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
            path = words[2] if len(words) >= 3 and words[1] == "=>" else words[0] if words else ""
            if path.startswith("/") and not path.startswith(prefix + os.sep) and os.path.exists(path):
                found[path] = os.path.realpath(path)
    return tuple(sorted((host, inside) for inside, host in found.items()))


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "sandbox-libraries"


@functools.cache
def library_stage(prefix: str = sys.base_prefix) -> str | None:
    """A folder holding `shared_libraries()` at their inside paths (`<stage>/lib/x86_64-linux-gnu/
    libc.so.6`), built once per library set (its name hashes the files' paths, sizes and mtimes,
    so an upgraded libc gets a new one); None when it cannot be built (then each file is bound)."""
    libs = shared_libraries(prefix)
    if not libs:
        return None
    key = hashlib.sha256(repr([(h, i, os.stat(h).st_size, os.stat(h).st_mtime_ns) for h, i in libs])
                         .encode()).hexdigest()[:16]
    final = _cache_root() / key
    if final.is_dir():
        return str(final)
    building = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        building = tempfile.mkdtemp(dir=final.parent, prefix=".building-")
        for host, inside in libs:
            target = Path(building + inside)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(host, target)
            except OSError:
                shutil.copy2(host, target)
        for folder in [building, *(str(p) for p in Path(building).rglob("*") if p.is_dir())]:
            os.chmod(folder, 0o755)      # the sandbox's user walks it (mkdtemp made it 0700)
        os.rename(building, final)
    except OSError as e:
        if building:
            shutil.rmtree(building, ignore_errors=True)
        if final.is_dir():               # another worker built it first
            return str(final)
        log.warning("cannot gather the sandbox's libraries under %s (%s): binding them one by one",
                    final.parent, e)
        return None
    return str(final)


def package_binds(names: list[str]) -> list[tuple[str, str]]:
    """(folder on the host, path inside) of each allowed package, as this interpreter finds it.
    An unknown name is a configuration error, raised with the name."""
    out = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not (spec.submodule_search_locations or spec.origin):
            raise ValueError(f"reward.sandbox_packages: {name!r} is not importable by the reward service")
        where = Path(next(iter(spec.submodule_search_locations)) if spec.submodule_search_locations
                     else spec.origin)
        out.append((str(where), f"{PACKAGES_INSIDE}/{where.name}"))
        bundled = where.parent / f"{name}.libs"
        if bundled.is_dir():
            out.append((str(bundled), f"{PACKAGES_INSIDE}/{bundled.name}"))
    return out


@functools.cache
def bwrap_root_args(packages: tuple[str, ...] = (), prefix: str = sys.base_prefix) -> tuple[str, ...]:
    """bwrap arguments for the fresh root described above; the same for every task of a
    process, so built (and any warning logged) once."""
    stage = library_stage(prefix)
    libraries = shared_libraries(prefix) if stage is None else \
        [(os.path.join(stage, top), "/" + top) for top in sorted(os.listdir(stage))]
    binds = [*libraries, (prefix, prefix), *package_binds(packages)]
    try_binds = []
    if not shared_libraries(prefix):
        log.warning("no ldd: the code sandbox shows the host's library folders %s", ", ".join(LIBRARY_DIRS))
        try_binds = [(d, d) for d in LIBRARY_DIRS]
    # The folders leading to each mount point, made enterable by the program's user (bwrap
    # would create them 0700, as root); they hold nothing but the way down.
    parents = sorted({str(p) for _, inside in binds for p in Path(inside).parents if str(p) != "/"},
                     key=lambda p: (p.count("/"), p))
    args = [arg for d in parents for arg in ("--perms", "0755", "--dir", d)]
    args += [arg for host, inside in binds for arg in ("--ro-bind", host, inside)]
    for site in glob.glob(os.path.join(prefix, "lib", "python*", "site-packages")):
        args += ["--tmpfs", site]
    return tuple(args + [arg for host, inside in try_binds for arg in ("--ro-bind-try", host, inside)])
