"""The GPU path: how one SGLang server is started for a generation GPU group.

On a cluster (and on a local GPU machine) each generation server is
`python -m sglang.launch_server` on `tp_size` GPUs; it serves the HTTP API the embedded server
imitates, so nothing else changes. This module only *describes* the launch — argv, environment,
and the file the keys travel in — so the contract test can parse the very argv with SGLang's own
`ServerArgs` parser; `rollout/sglang_role.py` runs it.

Facts of the pinned release (SGLang 0.5.23, read from its wheel) this relies on:
- `--api-key` / `--admin-api-key` exist only as options (no environment variable), but every
  option can come from a YAML file named by `--config` (server_args.py `prepare_server_args`,
  utils/server_args_config_parser.py). The keys therefore go into a 0600 YAML file and the
  command line carries only its path, so they never show in `ps` / `/proc/<pid>/cmdline`.
- `/health` runs a one-token generation unless `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` is
  false (environ.py, http_server.py `health_generate`); such a probe waits behind a paused
  scheduler, so the servers are started with it off and `/health` only says "up".
- `/ready` answers 200 once warm-up finished and generation is not paused, without generating
  (http_server.py `ready`): the launch waits on it.
- `--weight-version` is a string, default "default"; Tandem starts it at the policy version.
- `--enable-deterministic-inference` is what makes `sampling_seed` reproducible.
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The release the `[gpu]` extra pins and every contract test reads.
SGLANG_VERSION = "0.5.23"
INSTALL_HINT = (f"install the GPU extra on the generation nodes: pip install 'tandem[gpu]' "
                f"(it pins sglang=={SGLANG_VERSION})")
# SGLang reads it at start-up (environ.py); "false" makes /health answer without generating.
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
# Polled until 200 before a server is announced; never runs a generation.
READY_PATH = "/ready"
# Flags that must never be on a command line (they would be readable by every local user).
SECRET_FLAGS = ("--api-key", "--admin-api-key")
# The modules SGLang 0.5.23 puts LoRA adapters on (utils/common.py SUPPORTED_LORA_TARGET_MODULES;
# the contract test compares): an adapter on another module cannot be loaded.
SGLANG_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
                       "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                       "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud")


@dataclass
class SGLangServerSpec:
    model_path: str
    host: str = "0.0.0.0"
    port: int = 30000
    tp_size: int = 1
    # First GPU of the group among the visible ones (0 when CUDA_VISIBLE_DEVICES names the group).
    base_gpu_id: int = 0
    mem_fraction_static: float = 0.8
    # A 0600 YAML file holding `api-key` / `admin-api-key` (see write_key_config), or None.
    key_config: str | None = None
    # The policy version the server starts with (reported as weight_version).
    weight_version: int | str = 0
    # None: SGLang's own choice ("auto": the checkpoint's dtype).
    dtype: str | None = None
    random_seed: int = 0
    context_length: int | None = None
    max_running_requests: int | None = None
    # Rendezvous port of the server's own NCCL group (must differ between servers on a node).
    nccl_port: int | None = None
    trust_remote_code: bool = False
    deterministic_inference: bool = False
    # LoRA adapters served from the start, as SGLang's `--lora-paths` takes them (`NAME=PATH`);
    # any turns `--enable-lora` on, and the first sets the adapters' rank and target modules.
    lora_paths: list[str] = field(default_factory=list)
    # Return each request's routed experts (rollout routing replay, trainer.records_routing):
    # SGLang 0.5.23 captures them only when launched with --enable-return-routed-experts and
    # otherwise answers return_routed_experts with nothing.
    return_routed_experts: bool = False
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
        secret = [a for a in self.extra_args if a.split("=", 1)[0] in SECRET_FLAGS]
        if secret:
            out.append(f"extra_args (gen.sglang_args) must not carry {', '.join(secret)}: the launcher "
                       f"passes the experiment's keys in a 0600 file (--config), never on the command line")
        return out


def sglang_argv(spec: SGLangServerSpec) -> list[str]:
    """`python -m sglang.launch_server ...` for `spec`; raises ValueError naming bad fields.
    Holds no secret: the keys are in `spec.key_config`."""
    bad = spec.problems()
    if bad:
        raise ValueError("SGLang server spec: " + "; ".join(bad))
    argv = [spec.python, "-m", "sglang.launch_server",
            "--model-path", str(spec.model_path),
            "--host", spec.host, "--port", str(spec.port),
            "--tp-size", str(spec.tp_size), "--base-gpu-id", str(spec.base_gpu_id),
            "--mem-fraction-static", str(spec.mem_fraction_static),
            "--random-seed", str(spec.random_seed),
            "--weight-version", str(spec.weight_version),
            "--log-level", spec.log_level]
    if spec.key_config:
        argv += ["--config", str(spec.key_config)]
    if spec.dtype:
        argv += ["--dtype", spec.dtype]
    if spec.context_length:
        argv += ["--context-length", str(spec.context_length)]
    if spec.max_running_requests:
        argv += ["--max-running-requests", str(spec.max_running_requests)]
    if spec.nccl_port:
        argv += ["--nccl-port", str(spec.nccl_port)]
    if spec.trust_remote_code:
        argv.append("--trust-remote-code")
    if spec.deterministic_inference:
        argv.append("--enable-deterministic-inference")
    if spec.lora_paths:
        argv += ["--enable-lora", "--lora-paths", *spec.lora_paths]
    if spec.return_routed_experts:
        argv.append("--enable-return-routed-experts")
    return argv + list(spec.extra_args)


def key_config(api_key: str | None, admin_api_key: str | None) -> dict[str, str]:
    """The `--config` YAML mapping: option names as SGLang's config merger turns them into flags
    (`api-key: K` becomes `--api-key K` inside the server process)."""
    out = {}
    if api_key:
        out["api-key"] = api_key
    if admin_api_key:
        out["admin-api-key"] = admin_api_key
    return out


def write_key_config(path: str | os.PathLike, api_key: str | None, admin_api_key: str | None) -> Path:
    """Write the keys' YAML file readable by its owner only (created 0600, never wider)."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(key_config(api_key, admin_api_key), f)
    os.replace(tmp, path)
    return path


def sglang_env(base: dict[str, str] | None = None, cuda_visible_devices: str | None = None) -> dict[str, str]:
    """The server's environment: `base` (default os.environ), its GPUs when given (otherwise the
    inherited CUDA_VISIBLE_DEVICES — SLURM's allocation, or the local launcher's plan), and a
    `/health` that does not queue a generation behind a paused scheduler."""
    env = dict(os.environ if base is None else base)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    env[HEALTH_GENERATION_ENV] = "false"
    return env


def sglang_missing() -> str | None:
    """Why `python -m sglang.launch_server` cannot start with this interpreter, or None."""
    import importlib.util

    # Located without importing it (sglang's __init__ pulls in torch and the whole frontend).
    spec = importlib.util.find_spec("sglang")
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    if any((Path(p) / "launch_server.py").is_file() for p in places):
        return None
    return (f"gen.backend: sglang needs the `sglang` package in {sys.executable}, which cannot import "
            f"sglang.launch_server; {INSTALL_HINT}")


def servers_for_node(model_path: str, gpus: list[int], tp_size: int, *, host: str, base_port: int,
                     **kw) -> list[SGLangServerSpec]:
    """One spec per `tp_size` consecutive GPUs of a node (ports base_port, base_port+1, ...)."""
    if tp_size < 1 or len(gpus) % tp_size:
        raise ValueError(f"{len(gpus)} generation GPUs cannot be split into tensor-parallel groups of {tp_size}")
    return [SGLangServerSpec(model_path=model_path, host=host, port=base_port + i, tp_size=tp_size,
                             base_gpu_id=gpus[i * tp_size], nccl_port=base_port + 1000 + i, **kw)
            for i in range(len(gpus) // tp_size)]


def shell_command(spec: SGLangServerSpec) -> str:
    """The argv as one shell-quoted line (logs, sbatch scripts); it holds no key to mask."""
    return " ".join(shlex.quote(a) for a in sglang_argv(spec))
