"""Fixture corpora in every real format the catalog uses, built from real text (the Python
standard library's docs), with the documents each file holds."""

from __future__ import annotations

import gzip
import io
import json
import lzma
import tarfile
import zipfile
from pathlib import Path

MODULES = [
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "doctest",
    "email",
    "enum",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "http",
    "imaplib",
    "inspect",
    "ipaddress",
    "json",
    "logging",
    "mailbox",
    "mimetypes",
    "numbers",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "platform",
    "plistlib",
    "poplib",
    "pprint",
    "profile",
    "pydoc",
    "queue",
    "random",
    "re",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "typing",
    "unittest",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
]


def documents(n: int = 40) -> list[str]:
    """n real, varied text documents: docstrings of standard-library modules."""
    import importlib

    docs = [importlib.import_module(m).__doc__ or "" for m in MODULES]
    return [d for d in docs if len(d) > 200][:n]


def jsonl(docs: list[str], key: str = "text") -> bytes:
    return b"".join(
        json.dumps({key: d, "meta": {"i": i}}).encode() + b"\n" for i, d in enumerate(docs)
    )


def write_all(root: Path, docs: list[str]) -> dict[str, list[str]]:
    """Write one file per format under `root`; returns {relative path: its documents}."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    a, b, c = (
        docs[: len(docs) // 3],
        docs[len(docs) // 3 : 2 * len(docs) // 3],
        docs[2 * len(docs) // 3 :],
    )
    made: dict[str, list[str]] = {}

    enwik = "\n".join(docs).encode()
    with zipfile.ZipFile(root / "enwik8.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", enwik)  # like enwik8.zip: one member, one document
    made["enwik8.zip"] = ["\n".join(docs)]

    (root / "train").mkdir(exist_ok=True)
    cctx = zstandard.ZstdCompressor(level=3)
    (root / "train/00.jsonl.zst").write_bytes(cctx.compress(jsonl(a)))
    (root / "train/01.jsonl.zst").write_bytes(cctx.compress(jsonl(b)))
    made["train/00.jsonl.zst"], made["train/01.jsonl.zst"] = a, b

    (root / "oscar-1GB.jsonl.xz").write_bytes(lzma.compress(jsonl(c)))
    made["oscar-1GB.jsonl.xz"] = c

    (root / "c4-train.00000-of-00001.json.gz").write_bytes(gzip.compress(jsonl(b)))
    made["c4-train.00000-of-00001.json.gz"] = b

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in [
            ("docs/part.jsonl", jsonl(a)),
            ("docs/readme.txt", c[0].encode()),
            ("skip/x.bin", b"\0"),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    (root / "docs.tar.gz").write_bytes(buf.getvalue())
    made["docs.tar.gz"] = [*a, c[0]]  # with member "docs/*"

    pq.write_table(
        pa.table({"text": c, "id": list(range(len(c)))}), root / "data.parquet", row_group_size=3
    )
    made["data.parquet"] = c

    (root / "book.txt").write_text(a[0])
    made["book.txt"] = [a[0]]
    return made
