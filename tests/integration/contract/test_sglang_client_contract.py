"""Tandem's SGLang client side against the pinned release's own code (issue 13's contract test).

What the client sends is not listed here. The tests run the real code — every public method of
`AdminClient`, `GenerationClient.generate` through a server failure, an abort-mode interruption
and a reply whose tokens straddle an update, and the controller's health check and every
weight-sync method it has (`services.controller.weights.APPLIERS`) — against `RecordingSGLang`
(real HTTP on a local port) and hand every captured call to the oracle (`sglang_oracle.py`),
which judges it with the wheel of the release `setup.cfg` pins:

  (a) the route exists in `http_server.py` (or a router it includes) with that HTTP method;
  (b) the body validates against the endpoint's request class from `io_struct.py` the way
      FastAPI validates it (names known, required present, types compatible), and `/generate`
      passes the release's own contract gate (`api_types`);
  (d) the bearer key passes SGLang's `decide_request_auth` at the route's `@auth_level`, for a
      server with an API key and an admin key (what the launcher starts) and one with only an
      API key.

Why `io_struct` is read with `ast` rather than imported: see the oracle's docstring (importing it
needs torchvision, IPython, tvm_ffi, ... — not a light install). Each failure names the route,
field or key, the client method that sent it and the wheel file and line that decides.
Bumping the pin in `setup.cfg` re-runs all of this against the new wheel.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect

import pytest
from contract_recorder import RecordingSGLang

from tandem.rollout.client import AdminClient, GenerationClient, ServerRef
from tandem.rollout.client import admin as admin_module
from tandem.services.protocol import POLICY_ADAPTER

pytestmark = pytest.mark.timeout(600)

API_KEY, ADMIN_KEY = "contract-api-key", "contract-admin-key"
DEPLOYMENTS = {"api and admin keys": {"api_key": API_KEY, "admin_api_key": ADMIN_KEY},
               "api key only": {"api_key": API_KEY}}
# A value a caller would pass, per parameter name (of client methods and controller messages).
# A parameter without one fails the test: every argument must reach a checked request.
SAMPLES = {
    "model_path": "/exp/weights/v1", "path": "/exp/weights/v1", "weight_version": 1, "abort_all_requests": True,
    "load_format": "auto", "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
    "world_size": 2, "group_name": "tandem-weights", "backend": "nccl",
    "names": ["model.embed_tokens.weight", "lm_head.weight"], "dtypes": ["bfloat16", "bfloat16"],
    "shapes": [[64, 32], [64, 32]], "flush_cache": False, "rid": "0123456789abcdef", "abort_all": True,
    "new_version": 1, "lora_name": "policy", "lora_path": "/exp/weights/v1", "pinned": False,
}
ALTERNATIVES = {"mode": list(getattr(admin_module, "PAUSE_MODES", ("abort",)))}
CLIENT_ONLY = {"self", "timeout_s"}     # never sent to the server


def judge(wheel, recorders: list[RecordingSGLang]) -> list[str]:
    calls = [c for r in recorders for c in r.calls]
    answer = wheel.ask("check-calls", {"deployments": DEPLOYMENTS, "calls": [c.as_json() for c in calls]})
    out = []
    for call, verdict in zip(calls, answer["calls"], strict=True):
        out += [f"[{call.deployment}] {call.origin}: {p}" for p in verdict["problems"]]
    return out


def report(wheel, problems: list[str]) -> str:
    return (f"Tandem's SGLang client vs {wheel.name} (sglang=={wheel.version}, the pin in setup.cfg [gpu]):\n  "
            + "\n  ".join(problems))


async def _with_recorder(deployment: str, body) -> RecordingSGLang:
    rec = RecordingSGLang(deployment)
    await rec.start()
    try:
        await body(rec)
    finally:
        await rec.stop()
    return rec


def _key_param(params, *words) -> str | None:
    return next((p for p in params if all(w in p for w in words)), None)


# ---- AdminClient ------------------------------------------------------------------------------
def admin_invocations() -> tuple[list[tuple[str, dict]], list[str]]:
    """(method, kwargs) for every public coroutine method of AdminClient: once with its required
    arguments, once with every optional one too (once per alternative value); and the problems
    (parameters with no sample value)."""
    out, missing = [], []
    for name, fn in inspect.getmembers(AdminClient, inspect.iscoroutinefunction):
        if name.startswith("_") or name == "close":
            continue
        params = [p for p in inspect.signature(fn).parameters.values() if p.name not in CLIENT_ONLY]
        unknown = [p.name for p in params if p.name not in SAMPLES and p.name not in ALTERNATIVES]
        if unknown:
            missing.append(f"AdminClient.{name}: no sample value for parameter(s) {unknown}; add them to SAMPLES "
                           f"in {__name__} so the request they shape is checked")
            continue
        required = {p.name: SAMPLES.get(p.name, (ALTERNATIVES.get(p.name) or [None])[0])
                    for p in params if p.default is inspect.Parameter.empty}
        out.append((name, required))
        optional = [p.name for p in params if p.default is not inspect.Parameter.empty]
        if optional:
            alts = [ALTERNATIVES[n] for n in optional if n in ALTERNATIVES] or [[None]]
            alt_name = next((n for n in optional if n in ALTERNATIVES), None)
            for value in alts[0]:
                kw = {**required, **{n: SAMPLES[n] for n in optional if n in SAMPLES}}
                if alt_name:
                    kw[alt_name] = value
                out.append((name, kw))
    return out, missing


async def run_admin_client(rec: RecordingSGLang, keys: dict) -> list[str]:
    params = inspect.signature(AdminClient).parameters
    kw = {"api_key": keys["api_key"]}
    admin_param = _key_param(params, "admin")
    if admin_param and keys.get("admin_api_key"):
        kw[admin_param] = keys["admin_api_key"]
    invocations, problems = admin_invocations()
    async with AdminClient(rec.url, **kw) as admin:
        for name, args in invocations:
            rec.origin = f"AdminClient.{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
            # each call against a server in the state it expects: the adapter there to unload, not to load
            rec.adapters = {SAMPLES["lora_name"]: "/exp/weights/v0"} if name == "unload_lora_adapter" else {}
            try:
                await getattr(admin, name)(**args)
            except Exception as e:   # the recorder answers like 0.5.23: a raise is a client problem
                problems.append(f"{rec.origin} raised {type(e).__name__}: {e}")
    return problems


def test_every_admin_client_call_matches_the_pinned_release(sglang_wheel):
    recorders, problems = [], []
    for deployment, keys in DEPLOYMENTS.items():
        async def body(rec, keys=keys):
            problems.extend(f"[{rec.deployment}] {p}" for p in await run_admin_client(rec, keys))
        recorders.append(asyncio.run(_with_recorder(deployment, body)))
    assert all(r.calls for r in recorders), "AdminClient made no HTTP call"
    problems += judge(sglang_wheel, recorders)
    assert not problems, report(sglang_wheel, problems)


# ---- GenerationClient ---------------------------------------------------------------------------
async def run_generation_client(rec: RecordingSGLang, keys: dict) -> list[str]:
    from tandem.rollout.config import RolloutConfig

    fields = {f.name for f in dataclasses.fields(ServerRef)}
    kw = {"api_key": keys["api_key"]}
    admin_field = _key_param(fields, "admin")
    if admin_field and keys.get("admin_api_key"):
        kw[admin_field] = keys["admin_api_key"]
    client_kw = {"retry_delay_s": 0.0} if "retry_delay_s" in inspect.signature(GenerationClient).parameters else {}
    rc = RolloutConfig()
    # what the rollout worker passes (rollout/worker.py), with a seed and a small budget
    params = {"temperature": rc.temperature, "top_p": rc.top_p, "top_k": rc.top_k, "max_new_tokens": 8}
    problems = []
    # a LoRA run names its adapter in every request; a routing-replay run asks for routed experts
    for adapter, routed in ((None, None), (POLICY_ADAPTER, None), (None, (2, 2))):
        async with GenerationClient([ServerRef(rec.url, **kw)], **client_kw, adapter=adapter,
                                    routed_experts=routed) as client:
            for origin, script, sampling in (
                    ("GenerationClient.generate (a 503, an abort-mode interruption, a reply across an update)",
                     ["503", "abort", "span"], {**params, "sampling_seed": 1234}),
                    ("GenerationClient.generate (plain)", [], params)):
                origin += f" adapter={adapter!r} routed_experts={routed}"
                rec.origin, rec.generate_script = origin, list(script)
                try:
                    res = await client.generate([3, 4, 5, 6], sampling, sticky_key="group-1/0")
                    if len(res.output_ids) != sampling["max_new_tokens"]:
                        problems.append(f"{origin}: got {len(res.output_ids)} tokens, "
                                        f"wanted {sampling['max_new_tokens']}")
                    if routed and res.routed_experts.shape != (4 + len(res.output_ids) - 1, *routed):
                        problems.append(f"{origin}: routed experts of shape {res.routed_experts.shape}")
                except Exception as e:
                    problems.append(f"{origin} raised {type(e).__name__}: {e}")
    return problems


def test_every_generation_client_call_matches_the_pinned_release(sglang_wheel):
    recorders, problems = [], []
    for deployment, keys in DEPLOYMENTS.items():
        async def body(rec, keys=keys):
            problems.extend(f"[{rec.deployment}] {p}" for p in await run_generation_client(rec, keys))
        recorders.append(asyncio.run(_with_recorder(deployment, body)))
    paths = {c.path for r in recorders for c in r.calls}
    assert {"/generate", "/abort_request"} <= paths, f"the scripted failure did not reach the client: {paths}"
    named = {c.body.get("lora_path") for r in recorders for c in r.calls if c.path == "/generate"}
    assert named == {None, POLICY_ADAPTER}, f"requests named {named}"
    starts = {c.body.get("routed_experts_start_len") for r in recorders for c in r.calls if c.path == "/generate"}
    assert {None, 0} < starts, f"no resumed request asked for routed experts from where it stopped: {starts}"
    problems += judge(sglang_wheel, recorders)
    assert not problems, report(sglang_wheel, problems)


# ---- the controller -------------------------------------------------------------------------------
def _message_sample(msg_cls, version: int) -> tuple[object | None, list[str]]:
    values, missing = {}, []
    for f in dataclasses.fields(msg_cls):
        if f.name == "version":
            values[f.name] = version
        elif f.name in SAMPLES:
            values[f.name] = SAMPLES[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(f.name)
    if missing:
        return None, [f"{msg_cls.__name__}: no sample value for field(s) {missing}; add them to SAMPLES"]
    return msg_cls(**values), []


async def run_controller(rec: RecordingSGLang, keys: dict, root) -> list[str]:
    from tandem.services.config import ControllerConfig
    from tandem.services.controller.server import Controller
    from tandem.services.controller.weights import APPLIERS
    from tandem.services.protocol import ExpDir, MetricsWriter, RegisterServer, generate_keys

    exp = ExpDir(root)
    exp.root.mkdir(parents=True)
    generate_keys(exp.keys)
    (exp.keys / "contract-api-key").write_text(API_KEY + "\n")
    reg = {"address": rec.url, "api_key_ref": "contract-api-key", "tp_size": 1}
    if keys.get("admin_api_key"):
        (exp.keys / "contract-admin-key").write_text(ADMIN_KEY + "\n")
        reg["admin_key_ref"] = "contract-admin-key"
    fields = {f.name for f in dataclasses.fields(RegisterServer)}
    problems = [f"RegisterServer has no field {k!r}: the controller cannot be told this server's {k}"
                for k in reg if k not in fields]
    cfg_fields = {f.name for f in dataclasses.fields(ControllerConfig)}
    cfg = ControllerConfig(**{k: v for k, v in {"groups_per_step": 1, "max_staleness": 0, "health_interval_s": 3600.0, "http_timeout_s": 5.0,
                                                "update_timeout_s": 10.0, "broadcast_backend": "nccl"}.items()
                              if k in cfg_fields})
    c = Controller(cfg, exp)
    c.restore()
    c.metrics = MetricsWriter(exp, "controller")

    async def settle():
        while c._tasks:
            await asyncio.gather(*list(c._tasks))

    try:
        rec.origin = "controller: register_server + health check"
        c.register_server(RegisterServer(**{k: v for k, v in reg.items() if k in fields}))
        await settle()
        for i, applier in enumerate(APPLIERS, start=1):
            msg, missing = _message_sample(applier.message, i)
            problems += missing
            if msg is None:
                continue
            rec.origin = f"controller: {applier.message.OP} (v{i}, {applier.__name__})"
            ack = await c.weights_published(msg)
            if not ack.ok:
                problems.append(f"{rec.origin}: the update failed against the recorder: {c.last_sync.get('failed')}")
            await settle()
            rec.origin = f"controller: health check after v{i}"
            await c._check(c.registry.servers[rec.url])
            await settle()
    finally:
        if getattr(c, "_http", None) is not None:
            await c._http.close()
        c.metrics.close()
    return problems


def test_every_controller_call_matches_the_pinned_release(sglang_wheel, tmp_path):
    recorders, problems = [], []
    for i, (deployment, keys) in enumerate(DEPLOYMENTS.items()):
        async def body(rec, keys=keys, i=i):
            problems.extend(f"[{rec.deployment}] {p}" for p in await run_controller(rec, keys, tmp_path / f"exp{i}"))
        recorders.append(asyncio.run(_with_recorder(deployment, body)))
    assert all(r.calls for r in recorders), "the controller made no HTTP call"
    problems += judge(sglang_wheel, recorders)
    assert not problems, report(sglang_wheel, problems)
