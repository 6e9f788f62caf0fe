"""SGLang's own code, run from its wheel, judging what Tandem sends (a subprocess of the contract tests).

    python sglang_oracle.py --wheel W.whl --deps DIR COMMAND  < request.json  > answer.json
    python -m sglang_oracle --wheel W.whl --deps DIR COMMAND --request request.json --answer answer.json

Commands:
  routes       the HTTP route table of `sglang/srt/entrypoints/http_server.py` and the routers it
               includes: path, methods, `@auth_level`, the request class of the body, the query
               parameters, and the contract gates the endpoint calls (read with `ast`).
  check-calls  judges recorded HTTP calls: the route exists with that method; the body validates
               against the endpoint's request class; the bearer key passes SGLang's own
               `decide_request_auth` for the route's auth level under each deployment's keys;
               and the recorder's own replies are shaped like the release's (`/generate` decodes
               with `api_types.GenerateResponse`; other JSON replies use only keys the endpoint
               sends).
  decide-auth  SGLang's auth verdict (allowed, or 401/403) for probes of any path and key.
  check-argv   parses a launch argv with the real `ServerArgs.add_cli_args` parser.
  check-env    for SGLANG_* variables and values: defined by the release's `environ.py`? and the
               value its own parser reads.

How the request classes are checked, and why not by importing `io_struct`: importing
`sglang.srt.managers.io_struct` pulls the model-config registry (torchvision, IPython, tvm_ffi,
sentencepiece, Triton kernels registered with torch) — far beyond a light install. So the classes
are read from `io_struct.py` with `ast` (field names, annotations, defaults, base classes) and
rebuilt as msgspec Structs / dataclasses with the same fields; they are then validated exactly
as 0.5.23's FastAPI does it: a msgspec Struct through SGLang's own
`msgspec_struct_pydantic_core_schema` (imported from the wheel), a dataclass through pydantic,
both with `TypeAdapter.validate_python` on the decoded JSON. The `/generate` contract gate
(`api_contract.generate_contract_error` over the generated `sglang.api.v1.api_types`) is the real
code. Unknown body fields are reported even though FastAPI drops them silently: a field SGLang
ignores is a setting the client believes it made.

`sglang.srt.server_args` and `sglang.srt.utils` are the real modules, imported from the wheel
(zipimport: the wheel is a zip and is never unpacked).
Two things make that possible on a CPU machine: the package `__init__` (which imports the whole
frontend) is bypassed by registering `sglang` as a bare package whose path is the wheel, and
`triton` (a GPU compiler, >100 MB, imported by `utils/common.py` but not used to build the
parser) is replaced by SGLang's own import stub from `sglang/_platform_stubs.py` — the stub SGLang
itself installs where Triton does not exist.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import re
import sys
import types
import zipfile

from sglang_request_classes import class_fields, validate_body

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
VERBS = {"get", "post", "put", "delete", "patch", "head", "options"}
NOT_BODY = {"Request", "Response", "BackgroundTasks", "WebSocket", "HTTPConnection"}


# ---- the wheel as an import source ------------------------------------------------------------
def install_wheel(wheel: str, deps: str) -> None:
    sys.path.insert(0, deps)
    pkg = types.ModuleType("sglang")
    pkg.__path__ = [f"{wheel}/sglang"]
    sys.modules["sglang"] = pkg
    stubs = importlib.import_module("sglang._platform_stubs")
    if importlib.util.find_spec("triton") is None:
        sys.meta_path.insert(0, stubs._TritonFinder())
        stubs._make_mock("triton").__version__ = "0.0.0-stub"


class Source:
    """Files of the wheel, parsed once."""

    def __init__(self, wheel: str):
        self.zip = zipfile.ZipFile(wheel)
        self.trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self.trees:
            self.trees[path] = ast.parse(self.zip.read(path).decode(), path)
        return self.trees[path]

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            try:
                self.zip.getinfo(cand)
                return cand
            except KeyError:
                pass
        return None


def imports_of(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """local name -> (module, name) for every `from M import name [as local]`, at any depth."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                out[a.asname or a.name] = (node.module, a.name)
    return out


# ---- routes -----------------------------------------------------------------------------------
def _literal_path(node: ast.AST) -> tuple[str | None, str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, ""
    if (isinstance(node, ast.Call) and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)
            and ast.unparse(node.func) in ("os.environ.get", "os.getenv", "environ.get")):
        return node.args[1].value, f"default of {ast.unparse(node.args[0])}"
    return None, ""


def _kw(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _body_and_query(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> tuple[str | None, list[str]]:
    args = fn.args.args + fn.args.kwonlyargs
    defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + list(fn.args.defaults) + list(fn.args.kw_defaults)
    body, query = None, []
    for a, d in zip(args, defaults, strict=True):
        ann = a.annotation
        dflt = ast.unparse(d.func) if isinstance(d, ast.Call) else ""
        if isinstance(ann, ast.Subscript) and ast.unparse(ann.value) == "Annotated":
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            marks = " ".join(ast.unparse(e) for e in elts[1:])
            if "Body(" in marks:
                body = ast.unparse(elts[0])
                continue
            if "Query(" in marks:
                query.append(a.arg)
                continue
        if dflt in ("Depends", "Header", "Cookie"):
            continue
        if dflt == "Query":
            query.append(a.arg)
            continue
        name = ast.unparse(ann) if ann is not None else ""
        if name in NOT_BODY or not name:
            continue
        if re.fullmatch(r"[A-Z]\w*", name) and d is None:
            body = name          # a class-typed parameter without default: FastAPI reads the body
        else:
            query.append(a.arg)  # scalars with defaults are query parameters
    return body, query


def _routes_of(src: Source, path: str, owners: set[str], prefix: str = "") -> list[dict]:
    tree = src.tree(path)
    imports = imports_of(tree)
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        level, entries = "NORMAL", []
        for dec in fn.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            func = dec.func
            if isinstance(func, ast.Name) and func.id == "auth_level" and dec.args:
                level = ast.unparse(dec.args[0]).split(".")[-1]
            elif isinstance(func, ast.Attribute) and ast.unparse(func.value) in owners:
                if func.attr in VERBS:
                    methods = [func.attr.upper()]
                elif func.attr == "api_route":
                    m = _kw(dec, "methods")
                    methods = [e.value.upper() for e in m.elts] if isinstance(m, (ast.List, ast.Tuple)) else ["GET"]
                else:
                    continue
                p, note = _literal_path(dec.args[0] if dec.args else _kw(dec, "path"))
                if p is not None:
                    entries.append((prefix + p, methods, note, dec.lineno))
        if not entries:
            continue
        body, query = _body_and_query(fn)
        params = {n for p, *_ in entries for n in re.findall(r"\{(\w+)", p)}
        query = [q for q in query if q not in params]
        gates = sorted({n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                        and imports.get(n.func.id, ("",))[0].endswith("api_contract")})
        body_module = imports.get(body, (None,))[0] if body else None
        for p, methods, note, line in entries:
            out.append({"path": p, "methods": methods, "endpoint": fn.name, "auth_level": level,
                        "body_class": body, "body_module": body_module, "query": query,
                        "gates": [[imports[g][0], g] for g in gates], "file": path, "line": line, "note": note})
    return out


def route_table(src: Source) -> list[dict]:
    tree = src.tree(HTTP_SERVER)
    imports = imports_of(tree)
    routes = _routes_of(src, HTTP_SERVER, {"app"})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "app.include_router" and node.args
                and isinstance(node.args[0], ast.Name) and node.args[0].id in imports):
            module, name = imports[node.args[0].id]
            file = src.module_file(module)
            if file is None:
                raise SystemExit(f"{HTTP_SERVER}:{node.lineno}: router module {module} not in the wheel")
            pref = _kw(node, "prefix")
            routes += _routes_of(src, file, {name}, pref.value if isinstance(pref, ast.Constant) else "")
    return routes


def match_route(routes: list[dict], path: str) -> list[dict]:
    def rx(p: str) -> str:
        out = re.sub(r"\{(\w+):path\}", r"(?P<\1>.+)", p)
        return "^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", out) + "$"
    return [r for r in routes if re.match(rx(r["path"]), path)]


# ---- reply shapes (a check of the test's recorder) ---------------------------------------------
LOAD_SNAPSHOT = ("sglang.srt.managers.load_snapshot", "LoadSnapshot")
# `build_server_info` merges the scheduler's hand-shake info into /server_info.
SCHEDULER_INFO = ("sglang/srt/managers/scheduler.py", "get_init_info")


def _literal_keys(fn: ast.AST) -> set[str]:
    """String keys of the dict literals in `fn`, and of `x["key"] = ...` assignments."""
    keys = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Dict):
            keys |= {k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif (isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.slice, ast.Constant)
              and isinstance(n.slice.value, str)):
            keys.add(n.slice.value)
    return keys


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def reply_keys(src: Source, route: dict) -> set[str]:
    """Top-level keys a JSON-object reply of `route` can carry: the literal keys of its endpoint
    (and of the same-file functions it calls), plus, where it returns `build_server_info(...)`,
    every `ServerArgs` field (server_args.resolved_dict) and the scheduler's hand-shake keys."""
    fns = _functions(src.tree(route["file"]))
    keys: set[str] = set()
    todo, seen = [route["endpoint"]], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in fns:
            continue
        seen.add(name)
        keys |= _literal_keys(fns[name])
        for n in ast.walk(fns[name]):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                if n.func.id == "build_server_info":
                    from sglang.srt.arg_groups.arg_utils import record_fields
                    from sglang.srt.server_args import ServerArgs
                    keys |= {f.name for f in record_fields(ServerArgs)} | {"launch_command", "kv_events"}
                    keys |= _literal_keys(_functions(src.tree(SCHEDULER_INFO[0]))[SCHEDULER_INFO[1]])
                elif n.func.id == "msgspec_to_builtins" and route.get("body_class"):
                    keys |= set(class_fields(src, route["body_module"], _output_class(src, route))["fields"])
                elif n.func.id in fns:
                    todo.append(n.func.id)
    return keys


def _output_class(src: Source, route: dict) -> str:
    """The reply class of an endpoint that answers `msgspec_to_builtins(result)`: its request
    class's `...ReqOutput` counterpart, through aliases (`LoadLoRAAdapterReqOutput = ... =
    LoRAUpdateOutput` in io_struct.py)."""
    name = route["body_class"].replace("ReqInput", "ReqOutput")
    tree = src.tree(src.module_file(route["body_module"]))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            return node.value.id
    return name


def check_reply(src: Source, route: dict, reply) -> list[str]:
    if route["path"] == "/generate":
        from sglang.api.v1.api_types import GenerateResponse, JsonContractError
        try:
            GenerateResponse.from_json_value(reply)
        except JsonContractError as e:
            return [f"its /generate reply does not decode as the release's GenerateResponse: {e}"]
        return []
    if not isinstance(reply, dict):
        return []
    out = [f"its {route['path']} reply has key `{k}`, which {route['file']} `{route['endpoint']}` never sends"
           for k in sorted(set(reply) - reply_keys(src, route))]
    if isinstance(reply.get("loads"), list):
        snap = class_fields(src, *LOAD_SNAPSHOT)["fields"]
        out += [f"its {route['path']} load entry has key `{k}`, not a field of {LOAD_SNAPSHOT[1]} ({LOAD_SNAPSHOT[0]})"
                for entry in reply["loads"] for k in sorted(set(entry) - set(snap))]
    return out


# ---- commands ---------------------------------------------------------------------------------
def check_calls(src: Source, req: dict) -> dict:
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    routes = route_table(src)
    out = []
    for call in req["calls"]:
        problems, notes = [], []
        where = f"{call['method']} {call['path']}"
        found = match_route(routes, call["path"])
        route = next((r for r in found if call["method"] in r["methods"]), None)
        if not found:
            problems.append(f"{where}: no such route in {HTTP_SERVER} (nor in the routers it includes)")
        elif route is None:
            methods = sorted({m for r in found for m in r["methods"]})
            problems.append(f"{where}: the route exists with methods {methods} only "
                            f"({found[0]['file']}:{found[0]['line']})")
        if route is not None:
            at = f"{route['file']}:{route['line']} `{route['endpoint']}`"
            body = call.get("body")
            if body is not None and "json" not in (call.get("content_type") or ""):
                problems.append(f"{where}: body sent as {call.get('content_type')!r}, not application/json")
            for key in call.get("query") or {}:
                if key not in route["query"]:
                    problems.append(f"{where}: query parameter `{key}` is not one of {route['query']} ({at})")
            if route["body_class"]:
                try:
                    cls = class_fields(src, route["body_module"], route["body_class"])
                except KeyError as e:
                    problems.append(f"{where}: cannot read request class {route['body_class']}: {e}")
                    cls = None
                if cls is not None:
                    cwhere = f"{route['body_class']} ({cls['file']}:{cls['line']})"
                    if body is None:
                        problems.append(f"{where}: sends no JSON body but {at} requires a {cwhere} body "
                                        f"(FastAPI answers 422)")
                    elif not isinstance(body, dict):
                        problems.append(f"{where}: body is {type(body).__name__}, {cwhere} is a JSON object")
                    else:
                        for key in body:
                            if key not in cls["fields"]:
                                problems.append(f"{where}: field `{key}` is not a field of {cwhere}; "
                                                f"SGLang drops it silently")
                        for err in validate_body(cls, route["body_class"], body):
                            problems.append(f"{where}: {cwhere}: {err}")
            elif call.get("body") not in (None, {}):
                notes.append(f"{where}: {at} reads no body; the body sent is ignored")
            for module, fn in route["gates"]:
                err = getattr(importlib.import_module(module), fn)(body)
                if err:
                    problems.append(f"{where}: rejected by 0.5.x's contract gate {module}.{fn}: {err}")
            dep = req["deployments"][call["deployment"]]
            decision = decide_request_auth(method=call["method"], path=call["path"],
                                           authorization_header=call.get("authorization"),
                                           api_key=dep.get("api_key"), admin_api_key=dep.get("admin_api_key"),
                                           auth_level=AuthLevel[route["auth_level"]])
            if not decision.allowed:
                sent = _which_key(call.get("authorization"), dep)
                problems.append(f"{where} is {route['auth_level']} ({at}); with a server configured as "
                                f"{call['deployment']!r} ({', '.join(k for k in ('api_key', 'admin_api_key') if dep.get(k)) or 'no keys'}) "
                                f"SGLang answers {decision.error_status_code}: the caller sent {sent}")
        if route is not None and call.get("reply") is not None:
            problems += [f"({req.get('replier', 'the test recorder')}) {p}" for p in check_reply(src, route, call["reply"])]
        out.append({"problems": problems, "notes": notes})
    return {"calls": out}


def decide_auth(src: Source, req: dict) -> dict:
    """SGLang's verdict for each probe {method, path, authorization, deployment}: the route's level
    (a path or method no route serves is NORMAL, as `_get_auth_level_from_app_and_scope` does),
    and None or the refusal status from `decide_request_auth`."""
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    routes = route_table(src)
    out = []
    for probe in req["probes"]:
        route = next((r for r in match_route(routes, probe["path"]) if probe["method"] in r["methods"]), None)
        level = route["auth_level"] if route else "NORMAL"
        dep = req["deployments"][probe["deployment"]]
        d = decide_request_auth(method=probe["method"], path=probe["path"],
                                authorization_header=probe.get("authorization"), api_key=dep.get("api_key"),
                                admin_api_key=dep.get("admin_api_key"), auth_level=AuthLevel[level])
        out.append({"level": level, "route": bool(route), "refused": None if d.allowed else d.error_status_code,
                    "where": f"{route['file']}:{route['line']}" if route else ""})
    return {"verdicts": out}


def _which_key(header: str | None, dep: dict) -> str:
    if not header:
        return "no Authorization header"
    token = header.split(" ", 1)[-1]
    for k in ("admin_api_key", "api_key"):
        if dep.get(k) and token == dep[k]:
            return f"the {k}"
    return "a key the server does not have"


def check_argv(req: dict) -> dict:
    """Parse `req["argv"]` (what follows `-m sglang.launch_server`) as 0.5.x's
    `prepare_server_args` does: a `--config` YAML is merged in by the release's own
    `ConfigArgumentMerger`, then the `ServerArgs.add_cli_args` parser reads the result."""
    import contextlib
    import io

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False, add_help=False)
    ServerArgs.add_cli_args(parser)
    argv = list(req["argv"])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if "--config" in argv:
                from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
                argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
            ns, unknown = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e} {err.getvalue().strip()}".strip(), "unknown": [], "values": {},
                "merged": argv}
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    values = {a.dest: getattr(ns, a.dest) for a in parser._actions if given & set(a.option_strings)}
    return {"error": None, "unknown": unknown, "values": json.loads(json.dumps(values, default=str)),
            "merged": argv}


def check_env(req: dict) -> dict:
    """For each SGLANG_* variable and value: unknown to the release's `environ.py`, or the value
    its own parser reads from it (repr), or the parser's error."""
    import os

    from sglang.srt.environ import envs

    out = {}
    for name, value in req["env"].items():
        if not hasattr(envs, name):
            out[name] = {"known": False}
            continue
        os.environ[name] = value
        try:
            out[name] = {"known": True, "parsed": repr(getattr(envs, name).get())}
        except Exception as e:
            out[name] = {"known": True, "error": f"{type(e).__name__}: {e}"}
    return out


def oracle_parser() -> argparse.ArgumentParser:
    """The arguments every oracle of this directory takes: the wheel, its light dependencies,
    and where the JSON request comes from and the answer goes (Wheel.run gives files)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel", required=True)
    ap.add_argument("--deps", required=True)
    ap.add_argument("--request", help="a JSON file (default: standard input)")
    ap.add_argument("--answer", help="where the JSON answer goes (default: standard output)")
    return ap


def read_request(a: argparse.Namespace) -> dict:
    return json.loads((open(a.request).read() if a.request else sys.stdin.read()) or "{}")


def write_answer(a: argparse.Namespace, answer: dict) -> None:
    with open(a.answer, "w") if a.answer else contextlib.nullcontext(sys.stdout) as out:
        json.dump(answer, out)


def main() -> None:
    ap = oracle_parser()
    ap.add_argument("command", choices=["routes", "check-calls", "decide-auth", "check-argv", "check-env"])
    a = ap.parse_args()
    req = read_request(a)
    install_wheel(a.wheel, a.deps)
    src = Source(a.wheel)
    if a.command == "routes":
        ans = {"routes": route_table(src)}
    elif a.command == "check-calls":
        ans = check_calls(src, req)
    elif a.command == "decide-auth":
        ans = decide_auth(src, req)
    elif a.command == "check-argv":
        ans = check_argv(req)
    else:
        ans = check_env(req)
    write_answer(a, ans)


if __name__ == "__main__":
    main()
