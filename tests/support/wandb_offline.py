"""Reading an offline W&B run back in a test: the records of `<dir>/run-<id>.wandb`.

The file is W&B's transaction log: a 7-byte header (":W&B", magic, version), then LevelDB-log
style blocks of 32 KiB, each record chunk behind a 7-byte header (crc32, length, type: 1 full,
2 first, 3 middle, 4 last) and holding a serialized `wandb_internal_pb2.Record`.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, out, buf = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:              # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        buf += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def history(path: str | Path) -> list[dict]:
    """The logged rows, {name: value}, W&B's own `_step`, `_timestamp`, `_runtime` left out."""
    rows = []
    for r in records(path):
        if r.HasField("history"):
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def run_record(path: str | Path):
    """The run's header record (id, project, display name, config)."""
    return next(r.run for r in records(path) if r.HasField("run"))


def config(path: str | Path) -> dict:
    """The run's config as given to wandb.init ({key: value})."""
    return {i.key: json.loads(i.value_json) for i in run_record(path).config.update if not i.key.startswith("_")}
