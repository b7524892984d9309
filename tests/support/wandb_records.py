"""Read back what an offline W&B run wrote: the records of its ``run-ID.wandb`` file.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version) and then
LevelDB's log format -- 32 KiB blocks of chunks, each with a 7-byte header (CRC32, length,
type: 1 full, 2 first, 3 middle, 4 last) -- whose records are ``wandb_internal_pb2.Record``
protobufs. wandb 0.31 has no Python reader of its own (its core is in Go), so the tests use
this one.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

HEADER = 7
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # zero padding
            continue
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def read_records(path: str | Path) -> list:
    """The Record protobufs of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for payload in _payloads(Path(path).read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def history(path: str | Path) -> list[dict]:
    """The history rows (``run.log`` calls, committed per step): {key: value}, with ``_step``."""
    rows = []
    for r in read_records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in r.history.item
                }
            )
    return rows


def run_ids(path: str | Path) -> set[str]:
    """The run ids the file's run records name."""
    return {r.run.run_id for r in read_records(path) if r.WhichOneof("record_type") == "run"}
