"""The slurm backend's SGLang server jobs: `tandem gen sglang` on gen.tp_size GPUs, ports picked on
the node, no key on the command (building the role specs binds a socket to pick free ports).
"""
from __future__ import annotations

from launcher.config import load_config
from launcher.slurm_requests import job_requests


def _cfg(exp, *overrides):
    return load_config(None, ["experiment.name=req", f"experiment.exp_dir={exp.root}", "experiment.model=/m",
                              "launcher.backend=slurm", *overrides])


def test_sglang_servers_are_sglang_jobs_on_their_gpus(exp):
    """gen.backend: sglang: each gen job runs `tandem gen sglang` (which starts SGLang's launcher)
    on gen.tp_size GPUs, picking its HTTP and NCCL ports on its node; no key is on the command."""
    from launcher.run import write_gen_keys

    write_gen_keys(exp)
    cfg = _cfg(exp, "launcher.nodes=2", "launcher.gpus_per_node=4", "gen.backend=sglang", "gen.tp_size=2")
    reqs = {r.name: r for r in job_requests(cfg, exp, False)}
    gens = [r for n, r in reqs.items() if n.startswith("gen-")]
    assert len(gens) == 3 and cfg.gen.num_servers == 3      # 6 of 8 GPUs at 3:1, TP 2
    for g in gens:
        cmd = g.command
        assert cmd[cmd.index("launcher.cli") + 1:][:2] == ["gen", "sglang"]
        assert (cmd[cmd.index("--port") + 1], cmd[cmd.index("--nccl-port") + 1]) == ("0", "0")
        assert cmd[cmd.index("--host") + 1] == "{node}" and g.gpus_per_node == 2 and g.kind == "gen"
        assert g.threads == 4       # CPUs for 2 schedulers, the tokenizer and the detokenizer
        assert cmd[cmd.index("--admin-api-key-file") + 1] == str(exp.keys / "gen-admin-api-key")
        keys = [(exp.keys / n).read_text().strip() for n in ("gen-api-key", "gen-admin-api-key")]
        assert not any(k in " ".join(cmd) for k in keys)
