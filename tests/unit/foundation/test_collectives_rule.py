"""Every torch.distributed collective goes through `services.protocol.collectives` (issue 31).

Why: NCCL refuses CPU tensors and gloo accepts them, so a collective called directly on a tensor
that happens to live on the CPU passes every CPU test and fails on the first GPU run (the
trainer's `_reduce_stats` did, at step 1). `collectives` puts tensors on the group's device; this
test reads the source of every module of the project's packages with `ast` (importing nothing)
and fails on any collective called, or imported by name, anywhere else. Tests are not checked:
their workers play the other end of a group (a stand-in server, a reference sum).
"""
from __future__ import annotations

import ast
from pathlib import Path

from test_import_cycles import PACKAGES, project_modules

REPO = Path(__file__).resolve().parents[3]
ALLOWED = {"tandem.services.protocol.collectives"}
# torch.distributed's collectives and point-to-point calls (object variants included).
COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
    "isend", "irecv", "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
    "gather_object", "scatter_object_list", "send_object_list", "recv_object_list",
    "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced",
}
DIST_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")


def _dist_aliases(tree: ast.AST) -> set[str]:
    """Names bound to torch.distributed in this module (`import torch.distributed as dist`, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in DIST_MODULES and a.asname:
                    names.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names.update(a.asname or a.name for a in node.names if a.name == "distributed")
    return names


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def violations(path: Path, root: Path) -> list[str]:
    """`file:line: what` for each collective called or imported outside `collectives`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(root).as_posix()
    aliases = _dist_aliases(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in DIST_MODULES:
            out += [f"{where}:{node.lineno}: imports {node.module}.{a.name}"
                    for a in node.names if a.name in COLLECTIVES]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in COLLECTIVES:
            owner = _dotted(node.func.value)
            if owner in aliases or owner in DIST_MODULES:
                out.append(f"{where}:{node.lineno}: {owner}.{node.func.attr}(...)")
    return out


def test_collectives_are_called_only_through_the_collectives_module():
    modules = project_modules(REPO, PACKAGES)
    assert "tandem.services.protocol.collectives" in modules and "tandem.trainer.loop" in modules
    found = [v for name, path in sorted(modules.items()) if name not in ALLOWED
             for v in violations(path, REPO)]
    assert not found, ("call these through services.protocol.collectives (it puts tensors on the "
                       "group's device; NCCL refuses CPU tensors):\n" + "\n".join(found))


def test_the_reader_finds_each_way_of_calling_a_collective(tmp_path):
    """The checker can fail: every spelling is caught, non-collectives and other objects are not."""
    (tmp_path / "bad.py").write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "import torch.distributed as td\n"
        "from torch import distributed\n"
        "from torch.distributed import all_gather_object\n\n"
        "def f(t, pg):\n"
        "    dist.all_reduce(t)\n"
        "    torch.distributed.broadcast(t, src=0, group=pg)\n"
        "    td.barrier()\n"
        "    distributed.send(t, dst=1)\n"
        "    dist.get_rank(), dist.is_initialized()\n"
        "    pg.broadcast(t)\n")
    found = violations(tmp_path / "bad.py", tmp_path)
    assert [v.split(":")[1] for v in found] == ["5", "8", "9", "10", "11"], found
