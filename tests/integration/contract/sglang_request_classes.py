"""SGLang's request classes read from its source with `ast`, and validated as its FastAPI does.

Part of the contract tests' oracle (`sglang_oracle.py`, which says why `io_struct` is read and not
imported). A class is rebuilt from its field names, annotations and defaults (base classes of the
same file first) as a msgspec Struct or a dataclass; a body is then validated with pydantic's
`TypeAdapter.validate_python` — for a Struct through SGLang's own
`msgspec_struct_pydantic_core_schema`, which is how 0.5.x's endpoints read them. Names an
annotation uses that are not builtins or `typing` become `Any` (so only the fields Tandem sends,
whose annotations are plain, are checked in depth).
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import types
import typing


# ---- request classes --------------------------------------------------------------------------
class _Unresolved:
    """Stands for a name an annotation uses that this checker does not evaluate (-> typing.Any)."""

    def __init__(self, name: str, seen: set):
        self.name, self.seen = name, seen
        seen.add(name)

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unresolved(f"{self.name}.{item}", self.seen)

    def __call__(self, *a, **k):
        return self

    def __getitem__(self, item):
        return self


class _Names(dict):
    def __init__(self, seen: set):
        super().__init__()
        self.seen = seen

    def __missing__(self, key):
        if key in TYPING_NAMES:
            return TYPING_NAMES[key]
        if isinstance(getattr(builtins, key, None), type):
            return getattr(builtins, key)
        return _Unresolved(key, self.seen)


TYPING_NAMES = {n: getattr(typing, n) for n in ("Any", "Optional", "Union", "List", "Dict", "Tuple", "Set",
                                                "Literal", "Annotated", "Sequence", "Mapping")}


def eval_annotation(text: str, seen: set):
    """The annotation as a type; names it cannot resolve become `Any` (and are added to `seen`)."""
    mine: set = set()
    try:
        value = eval(text, {"__builtins__": {}}, _Names(mine))  # noqa: S307
    except Exception:
        seen.add(text)
        return typing.Any
    seen |= mine
    return _strip_unresolved(value) if mine else value


def _strip_unresolved(tp):
    if isinstance(tp, _Unresolved):
        return typing.Any
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is None or not args:
        return tp
    if origin is types.UnionType:
        return typing.Union[tuple(_strip_unresolved(a) for a in args)]  # noqa: UP007 (built at run time)
    if origin is typing.Annotated:
        return _strip_unresolved(args[0])
    try:
        fixed = tuple(_strip_unresolved(a) for a in args)
        return tp.copy_with(fixed) if hasattr(tp, "copy_with") else origin[fixed]
    except Exception:
        return typing.Any


def _has_default(value: ast.AST | None) -> bool:
    if value is None:
        return False
    if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in ("field", "Field"):
        if value.args and not (isinstance(value.args[0], ast.Constant) and value.args[0].value is Ellipsis):
            return True
        return any(k.arg in ("default", "default_factory") for k in value.keywords)
    return True


def class_fields(src, module: str, name: str) -> dict:
    """Fields of class `name` of `module` (base classes of the same file first), read with ast from
    `src` (the oracle's view of the wheel: `module_file(module)`, `tree(path)`)."""
    file = src.module_file(module)
    if file is None:
        raise KeyError(f"module {module} is not in the wheel")
    tree = src.tree(file)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if name not in classes:
        raise KeyError(f"{file}: no class {name}")
    kind, fields = "plain", {}

    def visit(cls: ast.ClassDef) -> None:
        nonlocal kind
        for base in cls.bases:
            b = ast.unparse(base)
            if b in classes:
                visit(classes[b])
            elif b.endswith("Struct"):
                kind = "msgspec"
            elif b.endswith("BaseModel"):
                kind = "pydantic"
        if any(ast.unparse(d).split("(")[0].endswith("dataclass") for d in cls.decorator_list):
            kind = "dataclass"
        for st in cls.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                ann = ast.unparse(st.annotation)
                if ann.startswith(("ClassVar", "typing.ClassVar")):
                    continue
                fields[st.target.id] = {"annotation": ann, "required": not _has_default(st.value),
                                        "line": st.lineno}

    visit(classes[name])
    return {"kind": kind, "fields": fields, "file": file, "line": classes[name].lineno}


def validate_body(cls: dict, name: str, body: dict) -> list[str]:
    """Validate `body` as 0.5.23's FastAPI validates the endpoint's parameter of this class."""
    import msgspec
    import pydantic

    seen: set = set()
    specs = [(f, eval_annotation(info["annotation"], seen), info["required"]) for f, info in cls["fields"].items()]
    if cls["kind"] == "msgspec":
        from sglang.srt.utils.msgspec_utils import msgspec_struct_pydantic_core_schema
        dyn = msgspec.defstruct(name, [(f, t) if req else (f, t, None) for f, t, req in specs], kw_only=True)
        dyn.__get_pydantic_core_schema__ = classmethod(lambda c, source, handler:
                                                       msgspec_struct_pydantic_core_schema(c, handler))
    elif cls["kind"] == "dataclass":
        dyn = dataclasses.make_dataclass(name, [(f, t) if req else (f, t, dataclasses.field(default=None))
                                                for f, t, req in specs], kw_only=True)
    else:
        dyn = pydantic.create_model(name, **{f: (t, ... if req else None) for f, t, req in specs})
    try:
        pydantic.TypeAdapter(dyn).validate_python(body)
    except pydantic.ValidationError as e:
        errs = [err for err in e.errors() if not str(err["loc"][:1]).startswith("('is-instance[")] or e.errors()
        out = []
        for err in errs:
            loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-after[", "is-instance["))]
            out.append(f"field `{'.'.join(loc) or '(body)'}`: {err['msg']} (sent {err.get('input')!r})")
        return out
    return []
