"""Weight sync of a LoRA run: the merged model vs the adapter alone (`trainer.lora.sync`, issue 35).

For each model, a torch-backend LoRA trainer (rank 16, alpha 32, adapters on all seven
projections, float32, as `trainer.lora` sets it up) publishes versions through the real disk
publisher (`<exp>/weights/v<N>/`: written in a temp directory, fsynced, renamed), and an embedded
server's model (float32, loaded from the base directory as `tandem gen serve` does) applies each
with the functions its `/update_weights_from_disk` route calls (read and validate, then copy in:
for an adapter, W0 + alpha/r B A per projection). Per version: bytes written (every file of
`v<N>/`), seconds to publish (the trainer's side) and seconds to apply (the server's side).
The adapters' B is random before each version (a trained adapter's size and merge cost, without
training), so every version changes every adapted weight.

Models: the tiny test model (4 layers, hidden 128) and a random Qwen2-shaped one, hidden 1024,
8 layers, intermediate 2816, 32K vocabulary (about 120M parameters, 0.5 GB in float32). Figures
are the median over VERSIONS versions (the adapter's first apply also copies the base weights
it merges onto; later ones do not).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: see benchmarks/script_path.py
    import script_path  # noqa: F401

import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import cli, print_table, write_results

RANK, ALPHA = 16, 32.0
VERSIONS = 3
MODELS = {
    "tiny": dict(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=512),
    "qwen2-1024x8": dict(layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=32768),
}
QUICK_MODELS = {"tiny": MODELS["tiny"]}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(model_dir: Path, sync: str, work: Path, versions: int) -> dict:
    """Publish and apply `versions` versions with `trainer.lora.sync: <sync>`."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.rollout.server import weights
    from tandem.trainer.config import LoraConfig, TrainerConfig
    from tandem.trainer.torch_backend import TorchBackend
    from tandem.trainer.weights.disk import DiskPublisher

    tcfg = TrainerConfig()
    tcfg.lora = LoraConfig(rank=RANK, alpha=ALPHA, sync=sync)
    trainer = TorchBackend(tcfg, model_dir, seed=0)
    server = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = weights.AdapterBase()
    publisher = DiskPublisher(work / f"weights-{sync}", keep=2)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for v in range(1, versions + 1):
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        t0 = time.perf_counter()
        pub = publisher.publish(trainer, v)
        t1 = time.perf_counter()
        # what /load_lora_adapter reads for an adapter, /update_weights_from_disk for a model
        update = (weights.load_adapter(server, pub.message.path, str(model_dir)) if sync == "adapter"
                  else weights.load_from_disk(server, pub.message.path))
        t2 = time.perf_counter()
        weights.apply(server, update, base)
        t3 = time.perf_counter()
        rows.append({"bytes": _dir_bytes(Path(pub.message.path)), "publish_s": t1 - t0, "read_s": t2 - t1,
                     "copy_s": t3 - t2, "apply_s": t3 - t1})
    params = sum(p.numel() for p in server.parameters())
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"sync": sync, "params": params, "versions": rows, **med}


def main(quick: bool = False) -> dict:
    import torch

    from tandem.rollout.tiny_model import init_tiny

    torch.set_num_threads(1)    # a trainer rank's and a server's default (trainer.threads, gen.threads)
    models = QUICK_MODELS if quick else MODELS
    versions = 2 if quick else VERSIONS
    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="lora-sync-") as tmp:
        for name, shape in models.items():
            model_dir = init_tiny(Path(tmp) / name, seed=0, **shape)
            full = measure(model_dir, "merged", Path(tmp) / name, versions)
            adapter = measure(model_dir, "adapter", Path(tmp) / name, versions)
            results[name] = {"params": full["params"], "merged": full, "adapter": adapter,
                             "bytes_ratio": adapter["bytes"] / full["bytes"],
                             "publish_ratio": adapter["publish_s"] / full["publish_s"],
                             "apply_ratio": adapter["apply_s"] / full["apply_s"]}
            for r in (full, adapter):
                rows.append([name, r["sync"], round(r["bytes"] / 1e6, 3), round(r["publish_s"], 3),
                             round(r["apply_s"], 3), round(r["bytes"] / full["bytes"], 4),
                             round(r["publish_s"] / full["publish_s"], 3), round(r["apply_s"] / full["apply_s"], 3)])
    print_table(f"LoRA weight sync per version, rank {RANK} on all seven projections, float32, disk "
                f"(median of {versions} versions, 1 thread)",
                ["model", "trainer.lora.sync", "MB written", "publish s", "server apply s", "bytes / merged",
                 "publish / merged", "apply / merged"], rows)
    headline = {"rank": RANK, "alpha": ALPHA, "versions": versions, "models": {k: dict(MODELS[k]) for k in models}}
    for k, v in results.items():   # flat figures per model (what docs/trainer.md cites)
        headline[f"{k}_params"] = v["params"]
        for sync in ("merged", "adapter"):
            r = v[sync]
            headline.update({f"{k}_{sync}_MB": round(r["bytes"] / 1e6, 3), f"{k}_{sync}_publish_s": round(r["publish_s"], 3),
                             f"{k}_{sync}_apply_s": round(r["apply_s"], 3)})
        headline.update({f"{k}_{m}": round(v[m], 4) for m in ("bytes_ratio", "publish_ratio", "apply_ratio")})
    headline["results"] = results
    if not quick:
        write_results("lora_sync", headline)
    return headline


if __name__ == "__main__":
    cli(main)
