"""msgpack framing for every Tandem message: an envelope plus a schema-checked body.

A frame is a msgpack map `{"v": PROTOCOL_VERSION, "op": str, "id": int, "body": map}`. Bodies
are dataclasses registered with `@message(op)`; fields typed `np.ndarray` travel as
`{"dtype", "shape", "data"}` with raw little-endian bytes, never as lists of Python ints.

`decode` never raises on bad input: garbage, truncated frames, unknown ops and wrong types come
back as a `ProtocolError` value, so a server loop can answer it and keep serving.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
# Frames larger than this are refused before unpacking (a 32K-token trajectory is ~400 KB).
MAX_FRAME_BYTES = 64 * 1024 * 1024
# Array dtypes allowed on the wire (little-endian).
WIRE_DTYPES = {"<i4", "<i8", "<f4", "<f8", "|u1", "|b1", "<f2", "<u4", "<u2"}

REGISTRY: dict[str, type] = {}
# One packer for every frame (msgpack.packb makes a new one per call: about a microsecond).
_pack = msgpack.Packer(use_bin_type=True).pack


def message(op: str):
    """Register a dataclass as the body schema of `op`."""
    def wrap(cls):
        cls = dataclass(cls) if not dataclasses.is_dataclass(cls) else cls
        if op in REGISTRY and REGISTRY[op] is not cls:
            raise RuntimeError(f"op {op!r} registered twice ({REGISTRY[op].__name__}, {cls.__name__})")
        REGISTRY[op] = cls
        cls.OP = op
        return cls
    return wrap


@dataclass
class ProtocolError:
    """A decode or validation failure, as a value. `code` is stable, `message` is for humans."""
    code: str
    message: str
    req_id: int | None = None
    op: str | None = None


@dataclass
class Envelope:
    op: str
    req_id: int
    body: Any


class _Invalid(Exception):
    pass


def _fields(cls) -> tuple[tuple[tuple[str, Any, bool], ...], frozenset[str]]:
    """(name, type hint, required) of each field of a message class, and the names, worked out
    once per class: every message is encoded and decoded through them (the controller's
    admission rate rests on it)."""
    cached = cls.__dict__.get("_wire_fields")
    if cached is None:
        hints = typing.get_type_hints(cls)
        fields = tuple((f.name, hints[f.name], f.default is dataclasses.MISSING
                        and f.default_factory is dataclasses.MISSING) for f in dataclasses.fields(cls))
        cached = fields, frozenset(name for name, _, _ in fields)
        cls._wire_fields = cached
    return cached


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})
_ENVELOPE = frozenset({"v", "op", "id", "body"})


def _to_wire(value: Any) -> Any:
    """A message (or any value in one) as msgpack-ready maps, lists and scalars. Scalars are
    passed through without a call and a message class's field names are looked up once: the
    controller encodes one reply per admission."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if isinstance(value, (list, tuple)):
        return [v if type(v) in _SCALARS else _to_wire(v) for v in value]
    names = kind.__dict__.get("_wire_names")
    if names is None and dataclasses.is_dataclass(kind):
        names = kind._wire_names = tuple(name for name, _, _ in _fields(kind)[0])
    if names is not None:
        out = {}
        for name in names:
            v = getattr(value, name)
            out[name] = v if type(v) in _SCALARS else _to_wire(v)
        return out
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
        return {"dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _array_from_wire(raw: Any, path: str) -> np.ndarray:
    if not isinstance(raw, dict) or set(raw) != {"dtype", "shape", "data"}:
        raise _Invalid(f"{path}: expected an array {{dtype, shape, data}}")
    dtype, shape, data = raw["dtype"], raw["shape"], raw["data"]
    if dtype not in WIRE_DTYPES:
        raise _Invalid(f"{path}: dtype {dtype!r} not allowed")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise _Invalid(f"{path}: bad shape {shape!r}")
    if not isinstance(data, bytes):
        raise _Invalid(f"{path}: data must be bytes")
    dt = np.dtype(dtype)
    if int(np.prod(shape, dtype=np.int64)) * dt.itemsize != len(data):
        raise _Invalid(f"{path}: {len(data)} bytes do not fill shape {shape} of {dtype}")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def _check(value: Any, tp: Any, path: str) -> Any:
    """Validate (and build) `value` against type `tp`; raise _Invalid naming `path`."""
    if tp is Any:
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(f"{path}: expected an integer, got {type(value).__name__}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _Invalid(f"{path}: expected str, got {type(value).__name__}")
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check(value, a, path)
            except _Invalid as e:
                errors.append(str(e))
        raise _Invalid(errors[0] if len(errors) == 1 else f"{path}: matches none of {tp}")
    if origin is typing.Literal:
        if value not in get_args(tp):
            raise _Invalid(f"{path}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _Invalid(f"{path}: expected a list, got {type(value).__name__}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_check(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _Invalid(f"{path}: expected a map, got {type(value).__name__}")
        ktp, vtp = get_args(tp) or (Any, Any)
        return {_check(k, ktp, f"{path}.<key>"): _check(v, vtp, f"{path}.{k}") for k, v in value.items()}
    if tp is np.ndarray:
        return _array_from_wire(value, path)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Invalid(f"{path}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(f"{path}: expected an integer, got {type(value).__name__}")
        return value
    if tp in (dict, list):
        if not isinstance(value, tp):
            raise _Invalid(f"{path}: expected a {'map' if tp is dict else 'list'}, got {type(value).__name__}")
        return value
    if tp in (str, bytes, bool):
        if not isinstance(value, tp):
            raise _Invalid(f"{path}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    if tp is type(None):
        if value is not None:
            raise _Invalid(f"{path}: expected nil")
        return None
    raise _Invalid(f"{path}: unsupported schema type {tp!r}")


def _build(cls, raw: Any, path: str):
    if not isinstance(raw, dict):
        raise _Invalid(f"{path or cls.__name__}: expected a map, got {type(raw).__name__}")
    fields, names = _fields(cls)
    if not raw.keys() <= names:
        unknown = set(raw) - names
        raise _Invalid(f"{path or cls.__name__}: unknown field(s) {sorted(map(str, unknown))}")
    kwargs = {}
    for name, hint, required in fields:
        if name in raw:
            kwargs[name] = _check(raw[name], hint, f"{path}.{name}" if path else name)
        elif required:
            raise _Invalid(f"{f'{path}.{name}' if path else name}: required field missing")
    return cls(**kwargs)


def encode(body: Any, req_id: int = 0, op: str | None = None) -> bytes:
    """Frame a registered message (or a ProtocolError) as bytes."""
    if isinstance(body, ProtocolError):
        op, payload = "error", {"code": body.code, "message": body.message}
    else:
        op = op or getattr(body, "OP", None)
        if op is None:
            raise TypeError(f"{type(body).__name__} is not a registered message")
        payload = _to_wire(body)
    return _pack({"v": PROTOCOL_VERSION, "op": op, "id": req_id, "body": payload})


def decode(frame: bytes) -> Envelope | ProtocolError:
    """Parse and validate a frame; every failure is returned as a ProtocolError."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        return ProtocolError("bad_frame", f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        return ProtocolError("too_large", f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=MAX_FRAME_BYTES)
    except Exception as e:  # msgpack raises a variety of errors on garbage; all mean "bad frame"
        return ProtocolError("bad_frame", f"not a msgpack frame: {type(e).__name__}: {e}"[:300])
    if not isinstance(raw, dict) or not raw.keys() >= _ENVELOPE:
        return ProtocolError("bad_envelope", "expected a map with v, op, id, body")
    req_id = raw["id"] if isinstance(raw["id"], int) and not isinstance(raw["id"], bool) else None
    op = raw["op"] if isinstance(raw["op"], str) else None
    if req_id is None or op is None:
        return ProtocolError("bad_envelope", "op must be a string and id an integer")
    if raw["v"] != PROTOCOL_VERSION:
        return ProtocolError("bad_version", f"protocol version {raw['v']!r}, expected {PROTOCOL_VERSION}",
                             req_id, op)
    if op == "error":
        b = raw["body"]
        if isinstance(b, dict) and isinstance(b.get("code"), str) and isinstance(b.get("message"), str):
            return Envelope(op, req_id, ProtocolError(b["code"], b["message"], req_id))
        return ProtocolError("bad_body", "error body needs code and message strings", req_id, op)
    cls = REGISTRY.get(op)
    if cls is None:
        return ProtocolError("unknown_op", f"unknown op {op!r}", req_id, op)
    try:
        return Envelope(op, req_id, _build(cls, raw["body"], ""))
    except _Invalid as e:
        return ProtocolError("bad_body", f"{op}: {e}", req_id, op)
    except (TypeError, ValueError) as e:
        return ProtocolError("bad_body", f"{op}: {e}", req_id, op)
