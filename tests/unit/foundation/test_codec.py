"""Every schema round-trips (arrays included); garbage never raises out of `decode`."""
from __future__ import annotations

import dataclasses
import types
import typing

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.services.protocol import REGISTRY, Envelope, ProtocolError, Trajectory, decode, encode


def sample(tp, depth=0):
    """A non-default value of type `tp`, so a round trip that drops a field would show."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return sample(next(a for a in typing.get_args(tp) if a is not type(None)), depth)
    if origin is typing.Literal:
        return typing.get_args(tp)[-1]
    if origin is list:
        return [sample(typing.get_args(tp)[0], depth + 1) for _ in range(2)]
    if origin is dict:
        return {"k": sample(typing.get_args(tp)[1], depth + 1)}
    if tp is np.ndarray:
        return np.arange(7, dtype=np.int32) * 3
    if dataclasses.is_dataclass(tp):
        return build(tp, depth + 1)
    return {int: 42, float: 2.5, str: "xyz", bool: True, bytes: b"\x00\xff", dict: {"a": [1, 2]},
            list: [1, "a"]}[tp]


def build(cls, depth=0):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: sample(hints[f.name], depth) for f in dataclasses.fields(cls)})


def same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.mark.parametrize("op", sorted(REGISTRY))
def test_every_schema_round_trips(op):
    msg = build(REGISTRY[op])
    env = decode(encode(msg, req_id=99))
    assert isinstance(env, Envelope), env
    assert env.op == op and env.req_id == 99
    assert same(msg, env.body)


def test_arrays_travel_as_raw_bytes_not_int_lists():
    n = 32768
    t = Trajectory(group_id="g", sample_idx=3, group_size=8, prompt_ids=np.arange(100, dtype=np.int32),
                   output_ids=np.arange(n, dtype=np.int32), output_logprobs=-np.ones(n, np.float32),
                   output_versions=np.zeros(n, np.int32), admit_version=2, reward=5.0,
                   finish_reason="stop", task="math", timings={"gen_s": 1.5})
    frame = encode(t)
    assert len(frame) < 3 * 4 * n + 2000  # ~4 bytes per element, no per-int msgpack overhead
    raw = msgpack.unpackb(frame)
    assert isinstance(raw["body"]["output_ids"]["data"], bytes)
    assert raw["body"]["output_ids"]["dtype"] == "<i4"
    back = decode(frame).body
    assert same(t, back)


def test_big_endian_arrays_are_sent_little_endian():
    t = build(Trajectory)
    t.output_ids = np.arange(5, dtype=">i4")
    back = decode(encode(t)).body
    assert back.output_ids.dtype == np.dtype("<i4") and back.output_ids.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("mutate,code", [
    (lambda b: b.update(output_ids={"dtype": "<i4", "shape": [10], "data": b"\0" * 8}), "bad_body"),
    (lambda b: b.update(output_ids={"dtype": "O", "shape": [1], "data": b"\0"}), "bad_body"),
    (lambda b: b.update(reward="high"), "bad_body"),
    (lambda b: b.update(admit_version=True), "bad_body"),
    (lambda b: b.pop("group_id"), "bad_body"),
    (lambda b: b.update(surprise=1), "bad_body"),
])
def test_wrong_types_are_error_values(mutate, code):
    raw = msgpack.unpackb(encode(build(Trajectory), 4))
    mutate(raw["body"])
    err = decode(msgpack.packb(raw))
    assert isinstance(err, ProtocolError) and err.code == code and err.req_id == 4
    assert "trajectory" in err.message


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_raise(data):
    assert isinstance(decode(data), (Envelope, ProtocolError))


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(REGISTRY)), st.dictionaries(st.text(max_size=12), json_like, max_size=6),
       st.integers(-2**63, 2**63 - 1))
def test_well_framed_garbage_bodies_never_raise(op, body, req_id):
    frame = msgpack.packb({"v": 1, "op": op, "id": req_id, "body": body}, use_bin_type=True)
    assert isinstance(decode(frame), (Envelope, ProtocolError))


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=400))
def test_truncated_frames_are_errors(cut):
    frame = encode(build(Trajectory), 1)
    out = decode(frame[: max(0, len(frame) - cut)])
    assert isinstance(out, ProtocolError)
