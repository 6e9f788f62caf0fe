"""Which tests share a pytest-xdist worker when `make test` spreads the suite over several.

A work unit goes to one worker whole, in collection order. A unit is a test module (its module
fixtures, e.g. a training run several tests read, are built once), except where a whole directory
must stay on one worker: the local SLURM cluster (one per machine), the shared generation server
and the fetched SGLang wheel (session fixtures), and the reward tests, which look for leftover
sandbox processes machine-wide and would see another worker's.

Why a scheduler and not xdist's own `--dist loadgroup`: that renames each test's node id to
carry its group, and pytest 9 no longer lets a plugin rename one; the scheduler sees node ids
only, so the rule is by path.
"""
from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

SHARED_DIRS = ("tests/integration/slurm/", "tests/integration/reward/", "tests/integration/generation/",
               "tests/integration/contract/")


def work_unit(nodeid: str) -> str:
    """The directory of SHARED_DIRS the test is in, else its module."""
    return next((d for d in SHARED_DIRS if nodeid.startswith(d)), nodeid.split("::", 1)[0])


class ModuleAndSharedDirScheduling(LoadScopeScheduling):
    """xdist's loadscope with `work_unit` as the scope, and units in collection order (the unit
    tier first, see tests/conftest.py), never re-sorted by size as loadscope does by default."""

    def __init__(self, config, log=None):
        config.option.loadscopereorder = False
        super().__init__(config, log)

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)
