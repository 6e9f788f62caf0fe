"""`tandem run` on the local backend with a two-rank trainer: the same run as with one rank.

Two real runs of the tiny embedded experiment on the CPU, every role a real process: one with
`launcher.cpus.trainer_ranks: 1`, one with 2 (the torch backend's data parallelism over gloo,
the ranks started by the local supervisor with torch.distributed's variables). The batches are
the same in both: eta 0 admits exactly B groups per version, the one rollout worker walks the
same seeded prompt order, and `gen.deterministic_inference` seeds every sample from the
experiment seed and its group/sample id (the embedded server draws each seeded row from its own
generator), so the two runs generate the same tokens; group baselines and advantage
normalisation are off so the (always wrong) tiny model's rewards give a non-zero gradient. Each
step's loss, gradient norm, policy ratio and token count must then agree, as two data-parallel
ranks agree with one in tests/integration/trainer/test_trainer_loop.py; step 2's generation and
gradient start from step 1's update, so they check that update too.

With at least 3 CPUs the ranks are pinned (generation on CPU 0, rank 0 on CPU 1, rank 1 on CPU
2) and the test reads from /proc, while the run goes, that every thread of each rank ran on its
own set; a 2-CPU machine has no disjoint CPU left for a second rank (the plan refuses it), so
there the runs float (`launcher.cpus.pin: false`) and that check is skipped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_run import leftovers

from tandem.launcher.placement import available_cpus
from tandem.services.protocol import ExpDir, read_metrics

pytestmark = pytest.mark.timeout(600)
PINNED = len(available_cpus()) >= 3
CPUS = '{gen: "0", train: "1-2", services: "0"}' if PINNED else "{pin: false}"
CONFIG = """\
experiment: {{name: {name}, model: {model}, exp_dir: {exp_dir}, seed: 3}}
launcher: {{backend: local, cpus: {cpus}}}
controller: {{max_staleness: 0}}
gen: {{num_servers: 1, threads: 1, deterministic_inference: true}}
rollout: {{dataset: "synthetic:math", n_samples: 2, max_prompt_tokens: 160, max_new_tokens: 24, concurrency: 4}}
reward: {{task: math, num_workers: 1}}
# Two minibatches of one group (two samples: one for each rank); the second one trains on the
# policy the first updated, so the loss depends on that update.
trainer: {{groups_per_step: 2, total_steps: 2, checkpoint_every: 0, max_tokens_per_mb: 184, ppo_n_minibatches: 2,
          group_baseline: false, normalize_advantages: false, optim: {{lr: 0.01}}}}
"""


def _status_field(task: Path, name: str) -> str:
    for line in (task / "status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def _rank_cpu_sets(exp_root: Path) -> dict[int, set[str]]:
    """Trainer ranks of this experiment now running: rank -> Cpus_allowed_list of each thread
    (of those that have started threads)."""
    out: dict[int, set[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        proc = Path("/proc") / pid
        try:
            argv = proc.joinpath("cmdline").read_bytes().split(b"\0")
            if b"trainer" not in argv or str(exp_root).encode() not in argv:
                continue
            env = dict(kv.split(b"=", 1) for kv in proc.joinpath("environ").read_bytes().split(b"\0") if b"=" in kv)
            tasks = list(proc.joinpath("task").iterdir())
            if len(tasks) < 2:
                # Not yet started its threads: it may be in the instant between its exec and the
                # supervisor's sched_setaffinity (`tandem` pins itself before any thread starts).
                continue
            out[int(env.get(b"RANK", b"0"))] = {_status_field(task, "Cpus_allowed_list") for task in tasks}
        except (OSError, ValueError):
            continue   # exited meanwhile
    return out


def _run(tmp_path: Path, model: Path, ranks: int) -> tuple[ExpDir, dict[int, set[str]]]:
    """One `tandem run` to its end; the CPU sets its trainer ranks were seen on while it ran."""
    name = f"ranks{ranks}"
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(CONFIG.format(name=name, model=model, exp_dir=tmp_path / name, cpus=CPUS))
    exp = ExpDir(tmp_path / name)
    seen: dict[int, set[str]] = {}
    with open(tmp_path / f"{name}.out", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tandem.launcher.cli", "run", str(cfg),
                                 f"launcher.cpus.trainer_ranks={ranks}"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + 400
        while proc.poll() is None:
            for rank, sets in _rank_cpu_sets(exp.root).items():
                seen.setdefault(rank, set()).update(sets)
            if time.monotonic() > deadline:
                proc.send_signal(signal.SIGTERM)   # the launcher stops every role, then exits
                proc.wait(60)
                break
            time.sleep(0.2)
    text = (tmp_path / f"{name}.out").read_text()
    assert proc.wait() == 0, text[-4000:]
    assert leftovers(exp) == []
    return exp, seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("ranks")
    return _run(tmp, tiny_model_dir, 1), _run(tmp, tiny_model_dir, 2)


def test_two_trainer_ranks_train_the_same_batches_to_the_same_losses(runs):
    (one, _), (two, _) = runs
    a, b = read_metrics(one, "trainer", "step"), read_metrics(two, "trainer", "step")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert {r["train_world_size"] for r in a} == {1} and {r["train_world_size"] for r in b} == {2}
    for x, y in zip(a, b, strict=True):
        # the same batch: the same groups, tokens and rewards ...
        assert x["group_ids"] == y["group_ids"] and x["n_seqs"] == y["n_seqs"] == 4
        assert x["valid_tokens"] == y["valid_tokens"] and x["reward_mean"] == y["reward_mean"]
        # the second minibatch's policy ratio is off 1: the loss depends on the first update
        assert abs(x["ratio_mean"] - 1) > 1e-3
        # ... trained to the same numbers, whether by one rank or two
        for key in ("loss", "grad_norm", "ratio_mean", "entropy", "clip_fraction"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-7), (x["step"], key)
    # every rank wrote its own log and console, as SLURM's tasks do
    assert sorted(p.name for p in two.logs.glob("trainer-*.console")) == ["trainer-0.console", "trainer-1.console"]


@pytest.mark.skipif(not PINNED, reason="needs 3 CPUs: generation, and one for each of the two trainer ranks")
def test_each_trainer_rank_ran_on_its_own_cpu_set(runs):
    (_, one_seen), (two, two_seen) = runs
    assert one_seen == {0: {"1-2"}}            # one rank: the whole training pool
    assert two_seen == {0: {"1"}, 1: {"2"}}    # two ranks: one CPU each, every thread of each
    placement = next(r for r in read_metrics(two, "launcher") if r.get("event") == "cpu_placement")
    assert placement["trainer_ranks"] == ["1", "2"] and placement["gen"] == "0"
