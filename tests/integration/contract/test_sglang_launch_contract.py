"""The SGLang launch the generation role builds, read by the pinned release's own code.

The argv comes from the real launcher code (`rollout.sglang_role.server_spec` from a `gen`
section, then `rollout.sglang_launch.sglang_argv`; and a spec with every option the argv builder
can emit) and is parsed by 0.5.23's `ServerArgs.add_cli_args` parser, after its own
`ConfigArgumentMerger` has merged the `--config` key file in, exactly as `prepare_server_args`
does: nothing may be unknown, nothing may fail to parse, and the values that matter (keys, TP
size, ports, start-up weight version) must arrive. The module it runs (`-m sglang.launch_server`)
must exist in the wheel. The environment the launcher adds must hold only variables the release's
`environ.py` defines, with values its own parser reads. Importing `server_args` is feasible on a
CPU (see `sglang_oracle.py`), so the real parser is used, not an `ast` reading of it.
"""
from __future__ import annotations

import dataclasses
import types
import zipfile

import pytest

from tandem.rollout import sglang_launch
from tandem.rollout.sglang_launch import SGLangServerSpec, sglang_argv

pytestmark = pytest.mark.timeout(300)

API_KEY, ADMIN_KEY = "contract-api-key", "contract-admin-key"
# Non-default values for every SGLangServerSpec field, so every flag it can emit is emitted.
SPEC_SAMPLES = {"model_path": "/models/policy", "host": "10.0.0.2", "port": 30123, "tp_size": 2, "base_gpu_id": 2,
                "mem_fraction_static": 0.7, "weight_version": 3, "dtype": "bfloat16", "random_seed": 11,
                "context_length": 4096, "max_running_requests": 48, "nccl_port": 31123, "trust_remote_code": True,
                "deterministic_inference": True, "log_level": "info", "extra_args": ["--disable-radix-cache"],
                "lora_paths": ["policy=/exp/adapter-v0"], "return_routed_experts": True}
SPEC_NOT_FLAGS = {"python", "key_config", "api_key"}     # the interpreter; keys are checked separately


def _key_file(tmp_path) -> str | None:
    if hasattr(sglang_launch, "write_key_config"):
        return str(sglang_launch.write_key_config(tmp_path / "keys.yaml", API_KEY, ADMIN_KEY))
    return None


def launches(tmp_path) -> list[tuple[str, SGLangServerSpec, dict]]:
    """(label, spec, values the parsed namespace must hold)."""
    keys = _key_file(tmp_path)
    key_expect = {"api_key": API_KEY, "admin_api_key": ADMIN_KEY} if keys else {}
    out = []
    try:
        from tandem.rollout.config import GenConfig
        from tandem.rollout.sglang_role import server_spec
    except ImportError:
        server_spec = None
    if server_spec is not None:
        gen = dataclasses.replace(GenConfig(), backend="sglang", tp_size=2, mem_fraction_static=0.75, seed=5,
                                  **({"deterministic_inference": True}
                                     if "deterministic_inference" in {f.name for f in dataclasses.fields(GenConfig)}
                                     else {}))
        args = types.SimpleNamespace(model="/models/policy", host="0.0.0.0", rank=1, weight_version=3,
                                     lora_paths=["policy=/exp/adapter-v0"])
        spec = server_spec(args, gen, 30001, 31001, keys)
        out.append(("the generation role's launch (rollout.sglang_role.server_spec)", spec,
                    {"model_path": "/models/policy", "tp_size": 2, "port": 30001, "nccl_port": 31001,
                     "weight_version": "3", "random_seed": 6, "mem_fraction_static": 0.75, "enable_lora": True,
                     "lora_paths": ["policy=/exp/adapter-v0"], **key_expect}))
    fields = {f.name: f for f in dataclasses.fields(SGLangServerSpec)}
    unsampled = [n for n in fields if n not in SPEC_SAMPLES and n not in SPEC_NOT_FLAGS]
    assert not unsampled, (f"SGLangServerSpec fields {unsampled} have no sample value in SPEC_SAMPLES "
                           f"({__name__}): the flags they emit would go unchecked")
    kw = {n: v for n, v in SPEC_SAMPLES.items() if n in fields}
    if "key_config" in fields:
        kw["key_config"] = keys
    out.append(("every option SGLangServerSpec can emit", SGLangServerSpec(**kw),
                {"tp_size": 2, "base_gpu_id": 2, "port": 30123, "nccl_port": 31123, "weight_version": "3",
                 "context_length": 4096, "max_running_requests": 48, "enable_lora": True,
                 "lora_paths": ["policy=/exp/adapter-v0"], **key_expect}))
    return out


def test_the_launch_argv_parses_with_the_releases_own_parser(sglang_wheel, tmp_path):
    problems = []
    modules = set(zipfile.ZipFile(sglang_wheel.path).namelist())
    for label, spec, expect in launches(tmp_path):
        argv = sglang_argv(spec)
        assert argv[1] == "-m", argv
        module_file = argv[2].replace(".", "/") + ".py"
        if module_file not in modules:
            problems.append(f"{label}: `-m {argv[2]}`: {module_file} is not in the wheel")
        if any(a in argv for a in ("--api-key", "--admin-api-key")) or any(k in argv for k in (API_KEY, ADMIN_KEY)):
            problems.append(f"{label}: a key is on the command line (visible in ps): {argv}")
        ans = sglang_wheel.ask("check-argv", {"argv": argv[3:]})
        if ans["error"]:
            problems.append(f"{label}: the release's parser refuses the argv: {ans['error']}\n    argv: {argv[3:]}")
            continue
        if ans["unknown"]:
            problems.append(f"{label}: flags unknown to ServerArgs.add_cli_args (sglang/srt/server_args.py): "
                            f"{ans['unknown']}")
        for dest, want in expect.items():
            got = ans["values"].get(dest, "(not set)")
            if got != want:
                problems.append(f"{label}: ServerArgs.{dest} parses as {got!r}, the launcher meant {want!r}")
    assert not problems, (f"launch argv vs {sglang_wheel.name} (sglang=={sglang_wheel.version}):\n  "
                          + "\n  ".join(problems))


def test_the_lora_target_modules_are_the_releases(sglang_wheel):
    """trainer.lora.target_modules is checked against SGLANG_LORA_TARGETS (launcher/config.py):
    the list must be the release's SUPPORTED_LORA_TARGET_MODULES (utils/common.py)."""
    import ast
    with zipfile.ZipFile(sglang_wheel.path) as z:
        tree = ast.parse(z.read("sglang/srt/utils/common.py"))
    found = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "SUPPORTED_LORA_TARGET_MODULES" for t in n.targets)]
    assert found, "sglang/srt/utils/common.py has no SUPPORTED_LORA_TARGET_MODULES"
    assert tuple(found[0]) == sglang_launch.SGLANG_LORA_TARGETS, (found[0], sglang_launch.SGLANG_LORA_TARGETS)


def test_the_launch_environment_is_the_releases(sglang_wheel):
    env_fn = getattr(sglang_launch, "sglang_env", None)
    if env_fn is None:
        pytest.skip("rollout.sglang_launch has no sglang_env(): the launcher sets no SGLang variables")
    added = {k: v for k, v in env_fn({}).items() if k.startswith("SGLANG_")}
    ans = sglang_wheel.ask("check-env", {"env": added})
    problems = [f"{name}={added[name]!r}: " + ("not defined in sglang/srt/environ.py" if not v["known"]
                                                else f"its parser fails: {v['error']}")
                for name, v in ans.items() if not v["known"] or "error" in v]
    health = getattr(sglang_launch, "HEALTH_GENERATION_ENV", None)
    if health and health in ans and ans[health].get("parsed") != "False":
        problems.append(f"{health}={added.get(health)!r} reads as {ans[health].get('parsed')} in the release: "
                        f"/health would still run a generation (http_server.py `health_generate`)")
    assert not problems, f"launch environment vs {sglang_wheel.name}:\n  " + "\n  ".join(problems)


def test_the_pin_is_stated_once(sglang_wheel):
    """setup.cfg's [gpu] extra is the pin; a copy of it in the code must agree with it."""
    stated = getattr(sglang_launch, "SGLANG_VERSION", None)
    assert stated in (None, sglang_wheel.version), (
        f"rollout/sglang_launch.py SGLANG_VERSION = {stated!r} but setup.cfg [gpu] pins sglang=={sglang_wheel.version}")
