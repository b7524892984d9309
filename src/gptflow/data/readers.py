"""Documents in, documents out: small functions over iterators, in bounded memory.

* :func:`collect_local_documents` turns files (one document each) into a JSONL shard, the one
  input format of tokenization (as for Megatron's ``preprocess_data.py``).
* :func:`iter_jsonl_batches` streams a JSONL file as batches of raw lines with their line
  numbers, so parsing can happen in worker processes and errors can name the line.
* :func:`parse_jsonl_batch` turns such a batch into texts, or names the bad line.

Dropped documents are counted by reason, never silently lost.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write


def collect_local_documents(
    files: list[Path], root: Path, out: str | os.PathLike, key: str = "text"
) -> dict:
    """Write one JSON line ``{key: text, "source": relative path}`` per non-empty UTF-8 file.

    Returns counts: documents, bytes (UTF-8 text), files, dropped by reason.
    """
    dropped: Counter[str] = Counter()
    documents = 0
    text_bytes = 0
    with atomic_write(out, "w") as f:
        for path in files:
            data = path.read_bytes()
            if not data.strip():
                dropped["empty"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                dropped["not_utf8"] += 1
                continue
            rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
            f.write(json.dumps({key: text, "source": rel}, ensure_ascii=False))
            f.write("\n")
            documents += 1
            text_bytes += len(data)
    return {
        "files": len(files),
        "documents": documents,
        "bytes": text_bytes,
        "dropped": dict(sorted(dropped.items())),
    }


def iter_jsonl_batches(
    path: str | os.PathLike, batch_bytes: int = 1 << 20
) -> Iterator[tuple[int, list[bytes]]]:
    """Yield ``(first_line_number, [raw lines])`` batches of about `batch_bytes` each."""
    batch: list[bytes] = []
    size = 0
    first = 1
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not batch:
                first = lineno
            batch.append(line)
            size += len(line)
            if size >= batch_bytes:
                yield first, batch
                batch, size = [], 0
    if batch:
        yield first, batch


def parse_jsonl_batch(
    path: str, first_line: int, lines: list[bytes], key: str
) -> tuple[list[str], Counter[str]]:
    """Texts of a batch of JSONL lines. Blank lines are skipped and counted; a line that is not
    a JSON object with a string under `key` raises an error naming file and line."""
    texts: list[str] = []
    dropped: Counter[str] = Counter()
    loads = json.loads
    for offset, line in enumerate(lines):
        if not line.strip():
            dropped["blank_line"] += 1
            continue
        try:
            obj = loads(line)
        except ValueError as e:
            raise GptflowError(
                f"{path}:{first_line + offset}: invalid JSON ({e}); fix or remove the line"
            ) from None
        if not isinstance(obj, dict) or key not in obj:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise GptflowError(
                f"{path}:{first_line + offset}: no key '{key}' (found {keys}); set the JSON key "
                f"(--json-key / tokenize.json_key) to the field holding the text"
            )
        text = obj[key]
        if not isinstance(text, str):
            raise GptflowError(
                f"{path}:{first_line + offset}: '{key}' is {type(text).__name__}, not a string"
            )
        texts.append(text)
    return texts, dropped
