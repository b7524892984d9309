"""The Megatron / GPT-NeoX ``MMIDIDX`` indexed dataset: a ``PREFIX.bin`` + ``PREFIX.idx`` pair.

Byte layout (all little-endian, tightly packed; identical in Megatron-LM core and GPT-NeoX):

``PREFIX.bin``
    The token ids of every sequence, concatenated, in the dataset dtype. No header, no padding.

``PREFIX.idx``
    ====== ============ ========================================================================
    offset size         field
    ====== ============ ========================================================================
    0      9            magic ``b"MMIDIDX\\x00\\x00"``
    9      8  ``<Q``    version, always 1
    17     1  ``<B``    dtype code of ``.bin`` (8 = uint16 when vocab < 65500, else 4 = int32)
    18     8  ``<Q``    N, the number of sequences
    26     8  ``<Q``    D, the length of the document index = documents + 1
    34     4N int32     sequence lengths in tokens
    34+4N  8N int64     byte offset of each sequence in ``.bin``
    34+12N 8D int64     document index: document j is sequences [doc[j], doc[j+1]); doc[0]=0, doc[-1]=N
    ====== ============ ========================================================================

In GPT preprocessing every document is one sequence (its tokens plus EOD), so the document index
is ``0..N``. An empty document is kept as a zero-sequence document (a repeated document-index
entry), as Megatron's ``tools/preprocess_data.py`` does. Dtype codes 6 and 7 mean different
float types in the two projects and are refused; token data only ever uses 8 or 4.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from gptflow.errors import GptflowError
from gptflow.fsutil import publish, temp_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # magic 9 + version 8 + dtype code 1 + N 8 + D 8
UINT16_VOCAB_LIMIT = 65500  # Megatron's DType.optimal_dtype: uint16 iff cardinality < 65500

DTYPE_BY_CODE: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    8: np.uint16,
}
CODE_BY_DTYPE = {np.dtype(v): k for k, v in DTYPE_BY_CODE.items()}
AMBIGUOUS_CODES = {
    6: "float64 in Megatron, float32 in GPT-NeoX",
    7: "float32 in Megatron, float64 in GPT-NeoX",
}


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Token dtype for a tokenizer of `vocab_size` ids (unpadded, added tokens included)."""
    return np.dtype(np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32)


class IndexedDatasetWriter:
    """Streams documents into ``PREFIX.bin`` and writes ``PREFIX.idx`` at `finalize()`.

    Both files are written under temporary names and renamed into place only when complete;
    an exception inside ``with IndexedDatasetWriter(...)`` removes the temporaries.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_BY_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self._bin_tmp = temp_path(bin_path(self.prefix))
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finalize/abort
        self._lengths: list[np.ndarray] = []
        self._doc_seq_counts: list[np.ndarray] = []
        self._sha = hashlib.sha256()
        self.documents = 0
        self.sequences = 0
        self.tokens = 0

    def add_documents(self, docs: list[np.ndarray]) -> None:
        """Append documents, each one sequence; an empty array is an empty document."""
        if docs:
            lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
            self.add_flat(np.concatenate(docs), lengths)

    def add_flat(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one concatenated token array and their lengths (a zero
        length is an empty document)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(
                f"lengths sum to {int(lengths.sum())} but there are {len(tokens)} tokens"
            )
        if not len(lengths):
            return
        data = np.ascontiguousarray(tokens, dtype=self.dtype.newbyteorder("<"))
        self._bin.write(data)  # the array's buffer: no bytes copy
        self._sha.update(data)
        nonempty = lengths > 0
        self.sequences += int(nonempty.sum())
        self._lengths.append(lengths[nonempty].astype(np.int32))
        self._doc_seq_counts.append(nonempty.astype(np.int64))
        self.documents += len(lengths)
        self.tokens += len(tokens)

    @property
    def bin_sha256(self) -> str:
        """sha256 of the ``.bin`` bytes written so far (computed while writing)."""
        return self._sha.hexdigest()

    def add_document(self, tokens: np.ndarray) -> None:
        self.add_documents([np.asarray(tokens)])

    def finalize(self) -> None:
        """Write the index and publish both files (``.bin`` first, then ``.idx``)."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        seq_counts = (
            np.concatenate(self._doc_seq_counts) if self._doc_seq_counts else np.zeros(0, np.int64)
        )
        idx_tmp = temp_path(idx_path(self.prefix))
        try:
            write_index(idx_tmp, self.dtype, lengths, seq_counts)
            publish(self._bin_tmp, bin_path(self.prefix))
            publish(idx_tmp, idx_path(self.prefix))
        except BaseException:
            idx_tmp.unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        if not self._bin.closed:
            self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_index(
    path: str | os.PathLike, dtype: np.dtype, lengths: np.ndarray, doc_seq_counts: np.ndarray
) -> None:
    """Write an ``.idx`` for sequences of `lengths`, grouped into documents of `doc_seq_counts`."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_index = np.zeros(len(doc_seq_counts) + 1, dtype=np.int64)
    np.cumsum(doc_seq_counts, out=doc_index[1:])
    if doc_index[-1] != len(lengths):
        raise AssertionError("document index does not cover every sequence")
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_BY_DTYPE[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_index.astype("<i8").tobytes())
        f.flush()
        os.fsync(f.fileno())


class IndexedDataset:
    """Read-only, memory-mapped view of a ``PREFIX.bin``/``PREFIX.idx`` pair.

    Checks what Megatron's reader asserts (magic, version, dtype, document index covering the
    sequences) and also that ``.idx`` and ``.bin`` have the sizes the header implies, so a
    truncated file fails here with its name instead of at some later sample.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = Path(prefix)
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not p.is_file():
                raise GptflowError(
                    f"{p}: no such file; tokenize the data first (or fix the prefix)"
                )
        size = ipath.stat().st_size
        with open(ipath, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or header[:9] != MAGIC:
            raise GptflowError(f"{ipath}: not a Megatron MMIDIDX index (bad magic); re-tokenize it")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise GptflowError(f"{ipath}: index version {version}, expected {VERSION}")
        code = header[17]
        if code in AMBIGUOUS_CODES:
            raise GptflowError(f"{ipath}: dtype code {code} is ambiguous ({AMBIGUOUS_CODES[code]})")
        if code not in DTYPE_BY_CODE:
            raise GptflowError(f"{ipath}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_BY_CODE[code])
        n, d = struct.unpack("<QQ", header[18:34])
        expected = HEADER_SIZE + 12 * n + 8 * d
        if size not in (expected, expected + n):  # + n: Megatron's optional multimodal modes
            raise GptflowError(
                f"{ipath}: {size} bytes, header implies {expected} (truncated or corrupt); re-tokenize it"
            )
        idx = np.memmap(ipath, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=n, offset=HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(
            idx, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n
        )
        self.document_indices = np.frombuffer(
            idx, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * n
        )
        if d < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise GptflowError(f"{ipath}: document index does not span the {n} sequences")
        bin_size = bpath.stat().st_size
        want = (
            int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if n
            else 0
        )
        if bin_size != want:
            raise GptflowError(
                f"{bpath}: {bin_size} bytes, index implies {want} (truncated or mismatched); re-tokenize it"
            )
        self._bin = (
            np.memmap(bpath, mode="r", dtype=self.dtype) if bin_size else np.zeros(0, self.dtype)
        )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence `i` (to its end when length is None)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        return self._bin[start : start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)


def merge_datasets(prefixes: list[str | os.PathLike], output_prefix: str | os.PathLike) -> dict:
    """Concatenate shards into one ``.bin``/``.idx``, in order, document index included.

    The merged document index is each shard's, shifted by the sequences before it, so empty
    documents and document boundaries survive (GPT-NeoX's ``merge_datasets.py`` writes the
    sequence count as every document boundary and loses them). Streams the ``.bin`` files;
    both outputs appear only when complete. Returns counts.
    """
    if not prefixes:
        raise GptflowError("merge: no input prefixes")
    parts = [IndexedDataset(p) for p in prefixes]
    dtypes = {p.dtype for p in parts}
    if len(dtypes) > 1:
        raise GptflowError(
            "merge: the shards have different token dtypes "
            + ", ".join(f"{p.prefix}={p.dtype.name}" for p in parts)
            + "; they were made with different tokenizers"
        )
    dtype = parts[0].dtype
    out = Path(output_prefix)
    bin_tmp, idx_tmp = temp_path(bin_path(out)), temp_path(idx_path(out))
    sha = hashlib.sha256()
    try:
        with open(bin_tmp, "wb") as f:
            for p in parts:
                with open(bin_path(p.prefix), "rb") as src:
                    while chunk := src.read(1 << 24):
                        f.write(chunk)
                        sha.update(chunk)
            f.flush()
            os.fsync(f.fileno())
        lengths = np.concatenate([p.sequence_lengths for p in parts])
        seq_counts = np.concatenate([np.diff(p.document_indices) for p in parts])
        write_index(idx_tmp, dtype, lengths, seq_counts)
        publish(bin_tmp, bin_path(out))
        publish(idx_tmp, idx_path(out))
    except BaseException:
        bin_tmp.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
        raise
    return {
        "sequences": len(lengths),
        "documents": len(seq_counts),
        "tokens": int(lengths.sum(dtype=np.int64)),
        "dtype": dtype.name,
        "bin_sha256": sha.hexdigest(),
    }
