"""Sub-commands this package adds to `tandem` (see launcher.cli).

`tandem model init-tiny DIR` writes the tiny test/default model; `tandem gen serve` runs the
embedded generation server. Heavy imports (torch, transformers, aiohttp) happen inside the
handlers so `tandem --help` stays fast.
"""
from __future__ import annotations

from pathlib import Path

from tandem.rollout.tiny_model import ARCHS


def _init_tiny(args) -> int:
    from tandem.rollout.tiny_model import init_tiny
    out = init_tiny(args.dir, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    kv_heads=args.kv_heads, intermediate=args.intermediate,
                    max_position=args.max_position, vocab=args.vocab, seed=args.seed, arch=args.arch,
                    experts=args.experts, top_k=args.top_k, moe_intermediate=args.moe_intermediate)
    print(f"wrote a tiny {'Qwen2' if args.arch == 'qwen2' else 'Qwen3-MoE'} model to {out}")
    return 0


def _add_model_commands(sub) -> None:
    p = sub.add_parser("model", help="create model directories")
    msub = p.add_subparsers(dest="model_cmd", required=True, metavar="{init-tiny}")
    c = msub.add_parser("init-tiny", help="write a tiny random Qwen2 (or Qwen3-MoE) model with a character tokenizer")
    c.add_argument("dir", type=Path, help="output directory (created)")
    c.add_argument("--layers", type=int, default=4)
    c.add_argument("--hidden", type=int, default=128)
    c.add_argument("--heads", type=int, default=4)
    c.add_argument("--kv-heads", type=int, default=2)
    c.add_argument("--intermediate", type=int, default=512)
    c.add_argument("--max-position", type=int, default=512, help="context length")
    c.add_argument("--vocab", type=int, default=0,
                   help="minimum vocabulary size (padded with reserved special tokens)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--arch", choices=ARCHS, default="qwen2",
                   help="dense Qwen2, or Qwen3-MoE (every layer sparse; --experts, --top-k, --moe-intermediate)")
    c.add_argument("--experts", type=int, default=8, help="qwen3_moe: experts per layer")
    c.add_argument("--top-k", type=int, default=2, help="qwen3_moe: experts per token")
    c.add_argument("--moe-intermediate", type=int, default=256, help="qwen3_moe: each expert's intermediate size")
    c.set_defaults(func=_init_tiny)


def _gen_serve(args) -> int:
    from tandem.rollout.server.main import serve_from_args
    return serve_from_args(args)


def _add_gen_commands(sub):
    p = sub.add_parser("gen", help="generation servers")
    gsub = p.add_subparsers(dest="gen_cmd", required=True, metavar="{serve,sglang}")
    c = gsub.add_parser("serve", help="run the embedded (CPU or CUDA) SGLang-compatible generation server")
    c.add_argument("--model", required=True, help="Hugging Face model directory")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    c.add_argument("--api-key-file", type=Path, default=None,
                   help="file holding the bearer key clients must send (none: no key checked)")
    c.add_argument("--admin-api-key-file", type=Path, default=None,
                   help="file holding the admin key: when set, only it unlocks pause/continue/abort/flush "
                        "and weight updates, and the API key is refused there (SGLang's --admin-api-key)")
    c.add_argument("--exp", default=None,
                   help="experiment directory: read the `gen` config section, log there and "
                        "publish the address in <exp>/services/gen-<rank>.json")
    c.add_argument("--rank", type=int, default=0, help="server index within the experiment")
    c.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: $TANDEM_THREADS, which the local launcher sizes to the "
                        "server's CPU pool, else gen.threads, else 1)")
    c.add_argument("--max-running", type=int, default=None,
                   help="most sequences decoded together (default: gen.max_running_requests)")
    from tandem.rollout.config import DEVICES
    c.add_argument("--device", choices=DEVICES, default=None,
                   help="where the model runs (default: gen.device, auto = cuda when torch sees a GPU)")
    c.add_argument("--weight-version", default="0",
                   help="weight_version reported until the first update (the policy version)")
    c.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (/load_lora_adapter; requests name one in lora_path)")
    c.add_argument("--lora-paths", nargs="*", default=None, metavar="NAME=PATH",
                   help="LoRA adapter directories served from the start (turns --enable-lora on)")
    c.set_defaults(func=_gen_serve)
    return gsub


def register(sub) -> None:
    """Add this package's sub-commands to the `tandem` parser."""
    _add_model_commands(sub)
    gsub = _add_gen_commands(sub)
    # `tandem gen sglang`: the supervised SGLang server of gen.backend: sglang (rollout/sglang_role.py).
    from tandem.rollout.sglang_role import add_parser as add_sglang_parser
    add_sglang_parser(gsub)
