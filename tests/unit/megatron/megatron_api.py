"""Every use of megatron-core in the project's source, read with `ast` and checked against the
installed release (imported by test_megatron_api_contract.py).

Nothing here lists megatron names: the calls, their keyword arguments and the attributes used
are read from `trainer/megatron/*.py`. A receiver's class is known when the project says it:
a parameter annotated with a megatron class (gpu.py annotates every GPU-only receiver), or a
local assigned from a megatron class or from a megatron function whose return annotation is
a class. Each use becomes one `Use`; `check()` returns what does not fit the installed package.
"""
from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch

PLACEHOLDER = object()


@dataclass
class Use:
    """One call, attribute access or method override that reaches into megatron-core."""
    where: str                      # file:line in the project
    kind: str                       # "call", "attribute" or "override"
    target: str                     # dotted megatron name (".method" on a class for receivers)
    obj: object = None              # the resolved megatron object (the class for attributes)
    n_positional: int | None = 0    # None when the call unpacks *args
    keywords: tuple[str, ...] = ()
    open_kwargs: bool = False       # the call unpacks **kwargs
    bound_self: bool = False        # a method called on an instance: self is implied
    problem: str | None = None      # set when the name itself could not be resolved


@dataclass
class _Value:
    """What an expression evaluates to, as far as the reader can tell."""
    obj: object                     # a module, class or function ...
    dotted: str
    instance: bool = False          # ... or an instance of the class `obj`


@dataclass
class _Module:
    path: Path
    imports: dict[str, _Value | str] = field(default_factory=dict)   # str = why unresolvable
    import_lines: dict[str, int] = field(default_factory=dict)


def _import(dotted: str) -> object:
    """What `from <parent> import <name>` gives: the parent's attribute (a package may export
    a function under its submodule's name), else the submodule."""
    parent, _, name = dotted.rpartition(".")
    module = importlib.import_module(parent)
    if hasattr(module, name):
        return getattr(module, name)
    return importlib.import_module(dotted)


def _read_imports(tree: ast.AST, mod: _Module) -> None:
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            pairs = [(a.asname or a.name, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            pairs = [(a.asname or a.name, a.name) for a in node.names if a.name.startswith("megatron")]
        for alias, dotted in pairs:
            try:
                mod.imports[alias] = _Value(_import(dotted), dotted)
            except ImportError as e:  # e.g. modules that import transformer_engine at import time
                mod.imports[alias] = f"{dotted}: {type(e).__name__}: {e}"
            mod.import_lines[alias] = node.lineno


def _return_class(fn) -> type | None:
    try:
        ann = inspect.signature(fn, eval_str=True).return_annotation
    except Exception:  # unresolvable annotations (optional dependencies): type unknown
        return None
    return ann if inspect.isclass(ann) and ann is not inspect.Signature.empty else None


class _Reader:
    def __init__(self, mod: _Module, rel: str):
        self.mod, self.rel, self.uses = mod, rel, []

    def where(self, node) -> str:
        return f"{self.rel}:{node.lineno}"

    def resolve(self, node, env: dict[str, _Value]) -> _Value | None:
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            got = self.mod.imports.get(node.id)
            if isinstance(got, str):
                self.uses.append(Use(self.where(node), "attribute", node.id, problem=got))
                return None
            return got
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value, env)
            if base is None:
                return None
            dotted = f"{base.dotted}.{node.attr}"
            self.uses.append(Use(self.where(node), "attribute", dotted, obj=base.obj,
                                 bound_self=base.instance, keywords=(node.attr,)))
            if base.instance or not hasattr(base.obj, node.attr):
                return None  # an instance attribute's type is not known; a missing one is reported
            return _Value(getattr(base.obj, node.attr), dotted)
        if isinstance(node, ast.Call):
            fn = self.resolve(node.func, env)
            if fn is None or fn.instance:
                return None
            if inspect.isclass(fn.obj):
                return _Value(fn.obj, fn.dotted, instance=True)
            cls = _return_class(fn.obj) if callable(fn.obj) else None
            return _Value(cls, f"{fn.dotted}()", instance=True) if cls is not None else None
        return None

    def typed(self, annotation, env) -> _Value | None:
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotation = ast.parse(annotation.value, mode="eval").body
        v = self.resolve(annotation, env)
        if v is not None and not v.instance and inspect.isclass(v.obj):
            return _Value(v.obj, v.dotted, instance=True)
        return None

    def scope(self, fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Module,
              env: dict[str, _Value] | None = None) -> dict[str, _Value]:
        env = dict(env or {})
        if not isinstance(fn, ast.Module):
            a = fn.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                if (t := self.typed(arg.annotation, env)) is not None:
                    env[arg.arg] = t
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                v = self.resolve(node.value, env)
                if v is not None and v.instance:
                    env[node.targets[0].id] = v
        return env

    def calls(self, fn, env) -> None:
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute):  # reads and assignments: the name must exist
                self.resolve(node, env)
            if not isinstance(node, ast.Call):
                continue
            starred = any(isinstance(a, ast.Starred) for a in node.args)
            kw = tuple(k.arg for k in node.keywords if k.arg is not None)
            open_kwargs = any(k.arg is None for k in node.keywords)
            npos = None if starred else len(node.args)
            if isinstance(node.func, ast.Attribute) and (base := self.resolve(node.func.value, env)) \
                    is not None and base.instance:  # a method of a typed receiver
                name = node.func.attr
                self.uses.append(Use(self.where(node), "call", f"{base.dotted}.{name}",
                                     getattr(base.obj, name, None), npos, kw, open_kwargs, bound_self=True))
                continue
            callee = self.resolve(node.func, env)
            if callee is None:
                continue
            if callee.instance:  # calling a module instance runs its forward()
                target = getattr(callee.obj, "forward" if issubclass(callee.obj, torch.nn.Module) else "__call__")
                self.uses.append(Use(self.where(node), "call", f"{callee.dotted}.forward", target, npos, kw,
                                     open_kwargs, bound_self=True))
            elif callable(callee.obj):
                self.uses.append(Use(self.where(node), "call", callee.dotted, callee.obj, npos, kw, open_kwargs))

    def overrides(self, cls: ast.ClassDef, env) -> None:
        bases = [b for b in (self.resolve(x, env) for x in cls.bases) if b is not None and inspect.isclass(b.obj)]
        for base in bases:
            for item in cls.body:
                if isinstance(item, ast.FunctionDef):
                    self.uses.append(Use(self.where(item), "override", f"{base.dotted}.{item.name}",
                                         base.obj, keywords=tuple(a.arg for a in item.args.args)))


def collect(package_dir: Path, root: Path) -> list[Use]:
    """Every megatron use in the package's modules (file:line relative to `root`)."""
    uses: list[Use] = []
    for path in sorted(Path(package_dir).glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        mod = _Module(path)
        _read_imports(tree, mod)
        reader = _Reader(mod, str(path.relative_to(root)))
        scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]
        # In a method of a subclass of a megatron class, `self` is an instance of that base.
        self_of = {}
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            bases = [b for b in (reader.resolve(x, {}) for x in cls.bases) if b is not None and inspect.isclass(b.obj)]
            for item in cls.body if bases else ():
                self_of[id(item)] = {"self": _Value(bases[0].obj, bases[0].dotted, instance=True)}
        for scope in scopes:
            env = reader.scope(scope, self_of.get(id(scope)))
            body = scope.body if isinstance(scope, ast.Module) else [scope]
            for stmt in body:
                if isinstance(scope, ast.Module) and isinstance(stmt, ast.FunctionDef | ast.ClassDef):
                    continue  # functions are their own scopes
                reader.calls(stmt, env)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                reader.overrides(node, {})
        for alias, got in mod.imports.items():
            problem = got if isinstance(got, str) else None
            uses.append(Use(f"{reader.rel}:{mod.import_lines[alias]}", "import",
                            got.dotted if not problem else alias, problem=problem))
        uses += reader.uses
    # An attribute read as part of a call is checked as the call; keep one record per site.
    seen, out = set(), []
    for u in uses:
        key = (u.where, u.kind, u.target)
        if key not in seen:
            seen.add(key)
            out.append(u)
    return out


def _has_attribute(obj, name: str, instance: bool) -> bool:
    if hasattr(obj, name):
        return True
    if instance and inspect.isclass(obj):  # attributes set in __init__ (self.name = ...)
        fields = getattr(obj, "__dataclass_fields__", {})
        if name in fields:
            return True
        for klass in obj.__mro__:
            try:
                if f"self.{name} =" in inspect.getsource(klass) or f"self.{name}:" in inspect.getsource(klass):
                    return True
            except (OSError, TypeError):
                continue
    return False


def check(use: Use) -> str | None:
    """None when the use fits the installed megatron-core; else what is wrong."""
    if use.problem:
        return use.problem
    if use.kind == "import":
        return None
    if use.kind == "attribute":
        (name,) = use.keywords
        return None if _has_attribute(use.obj, name, use.bound_self) else f"{use.target}: no such attribute"
    if use.kind == "override":
        name = use.target.rsplit(".", 1)[1]
        base = getattr(use.obj, name, None)
        if base is None:
            return f"{use.target}: overrides nothing (the base class has no {name})"
        want = [p for p in inspect.signature(base).parameters]
        return None if list(use.keywords) == want else f"{use.target}: parameters {list(use.keywords)} != {want}"
    if use.obj is None:
        return f"{use.target}: no such method"
    try:
        sig = inspect.signature(use.obj)
    except (TypeError, ValueError):
        return None  # C builtins without a signature: nothing to bind against
    args = [PLACEHOLDER] * ((use.n_positional or 0) + (1 if use.bound_self else 0))
    kwargs = dict.fromkeys(use.keywords, PLACEHOLDER)
    try:
        if use.n_positional is None or use.open_kwargs:
            sig.bind_partial(*args, **kwargs)
        else:
            sig.bind(*args, **kwargs)
    except TypeError as e:
        return f"{use.target}{sig}: {e}"
    return None
