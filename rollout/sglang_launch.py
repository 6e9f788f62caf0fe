"""The GPU path: the command line that starts one SGLang server for a generation GPU group.

On a cluster each generation server is `python -m sglang.launch_server` on `tp_size` GPUs
starting at `base_gpu_id`; it serves the same HTTP API as the embedded server, so nothing else
changes. This only builds the argv (SGLang itself cannot run on a CPU-only machine, so it is
tested here on its argv alone); the launcher runs it and publishes the address.
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field


@dataclass
class SGLangServerSpec:
    model_path: str
    host: str = "0.0.0.0"
    port: int = 30000
    tp_size: int = 1
    base_gpu_id: int = 0
    mem_fraction_static: float = 0.8
    api_key: str | None = None
    # The policy version the server starts with (reported as weight_version in every reply).
    weight_version: int | str = 0
    dtype: str = "bfloat16"
    random_seed: int = 0
    context_length: int | None = None
    max_running_requests: int | None = None
    # Rendezvous port for the server's own NCCL group (must differ between servers on a node).
    nccl_port: int | None = None
    trust_remote_code: bool = False
    log_level: str = "warning"
    extra_args: list[str] = field(default_factory=list)
    python: str = sys.executable

    def problems(self) -> list[str]:
        out = []
        if not self.model_path:
            out.append("model_path is empty")
        if self.tp_size < 1:
            out.append(f"tp_size must be >= 1, got {self.tp_size}")
        if self.base_gpu_id < 0:
            out.append(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if not (0 < self.mem_fraction_static < 1):
            out.append(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if not (0 < self.port < 65536):
            out.append(f"port must be in 1..65535, got {self.port}")
        return out


def sglang_argv(spec: SGLangServerSpec) -> list[str]:
    """`python -m sglang.launch_server ...` for `spec`; raises ValueError naming bad fields."""
    bad = spec.problems()
    if bad:
        raise ValueError("SGLang server spec: " + "; ".join(bad))
    argv = [spec.python, "-m", "sglang.launch_server",
            "--model-path", str(spec.model_path),
            "--host", spec.host, "--port", str(spec.port),
            "--tp-size", str(spec.tp_size), "--base-gpu-id", str(spec.base_gpu_id),
            "--mem-fraction-static", str(spec.mem_fraction_static),
            "--dtype", spec.dtype, "--random-seed", str(spec.random_seed),
            "--weight-version", str(spec.weight_version),
            "--log-level", spec.log_level]
    if spec.api_key:
        argv += ["--api-key", spec.api_key]
    if spec.context_length:
        argv += ["--context-length", str(spec.context_length)]
    if spec.max_running_requests:
        argv += ["--max-running-requests", str(spec.max_running_requests)]
    if spec.nccl_port:
        argv += ["--nccl-port", str(spec.nccl_port)]
    if spec.trust_remote_code:
        argv.append("--trust-remote-code")
    return argv + list(spec.extra_args)


def servers_for_node(model_path: str, gpus: list[int], tp_size: int, *, host: str, base_port: int,
                     **kw) -> list[SGLangServerSpec]:
    """One spec per `tp_size` consecutive GPUs of a node (ports base_port, base_port+1, ...)."""
    if tp_size < 1 or len(gpus) % tp_size:
        raise ValueError(f"{len(gpus)} generation GPUs cannot be split into tensor-parallel groups of {tp_size}")
    return [SGLangServerSpec(model_path=model_path, host=host, port=base_port + i, tp_size=tp_size,
                             base_gpu_id=gpus[i * tp_size], nccl_port=base_port + 1000 + i, **kw)
            for i in range(len(gpus) // tp_size)]


def shell_command(spec: SGLangServerSpec) -> str:
    """The argv as one shell-quoted line (for sbatch scripts and logs; the key is masked)."""
    argv = sglang_argv(spec)
    if spec.api_key:
        argv[argv.index("--api-key") + 1] = "$TANDEM_GEN_API_KEY"
    return " ".join(a if a == "$TANDEM_GEN_API_KEY" else shlex.quote(a) for a in argv)
