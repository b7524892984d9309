"""Memory and time of the deduplication group jobs -- ``minhash_buckets``,
``cluster_minhash_pairs`` and ``find_exact_repeats`` -- from the sizes of their input files:
the rules' ``mem_mb`` and ``runtime`` (rules/quality_functions.smk), shown at ``-n`` once the
inputs exist (``<TBD>`` before: Snakemake evaluates them again when the job is submitted),
and the Pile's figures in the README (held to this module by
tests/unit/data/quality/test_quality_minhash_scale.py).

Each is what the job holds at its peak, from costs measured by bench/minhash_scale.py (and,
for exact, the same measure of ``find_repeats``: peak RSS above the process's start, page
cache dropped), plus the process itself, times a margin; its time is its CPU cost, measured,
doubled for a shared node, plus its reads at an assumed file-system rate:

* a bucket job holds one pass: 178 bytes a document at the peak (1.52 M signed documents in
  one pass: 269-271 MiB; 380 k: 69-72 MiB), and at most a chunk a shard
  (:func:`gptflow.data.quality.buckets.chunk_bytes`); 1.0-1.2 CPU µs a document (1.6 M
  documents: 1.6-1.8 s);
* the clustering holds 4.6 bytes a document (the parent array, 4, sorted in place at the end
  for the cluster sizes; 8 from 2**31 documents: 4 to 16 M documents, 80 to 135 MiB) and its
  blocks' arrays (~65 MiB); 0.16 CPU µs a pair, 0.46 a document (4 M documents with 4 M and
  16 M pairs: 2.5 and 4.3 s);
* exact's repeats search holds one pass of at most 2**26 digests: 100 bytes each (2 M and 8 M
  in one pass); 0.8 CPU µs a digest.

MARGIN (1.5) is for a pass that holds more than its share -- a hash range is as full as the
group's largest buckets make it: a document repeated 10**6 times puts all its copies in one
pass -- and for the allocator's slack; a retry (Snakemake's `attempt`) asks for twice, then
three times as much, so that a job that ran out of memory or time does not fail alike.
"""

from __future__ import annotations

import math

from gptflow.data.quality import arrays, buckets, exact, minhash

MB = 10**6
MIB = 2**20
BASE_MIB = 100  # the process: Python, numpy, scipy, gptflow's CLI (measured 40-64 MiB)
MARGIN = 1.5
BUCKET_BYTES_PER_DOCUMENT = 178
BUCKET_CPU_S_PER_DOCUMENT = 1.2e-6
CLUSTER_BYTES_PER_DOCUMENT = 5  # the parent array (int32: 4) and the sort's slack (4.6 measured)
CLUSTER_BLOCK_MIB = 80  # a block of pairs and a block of documents in flight (~65 measured)
CLUSTER_CPU_S_PER_PAIR = 0.2e-6
CLUSTER_CPU_S_PER_DOCUMENT = 0.5e-6
REPEATS_BYTES_PER_DIGEST = 100
REPEATS_CPU_S_PER_DIGEST = 0.8e-6
READ_BYTES_PER_S = 100 * MB  # assumed: one job's share of a cluster file system
BUSY = 2  # CPU time doubled: a shared node
MIN_RUNTIME_MIN = 10
JOBS = ("minhash_buckets", "cluster_minhash_pairs", "find_exact_repeats")


def signature_documents(sizes: list[int], bands: int, rows: int) -> int:
    """Documents of a group's signature files, from their sizes alone."""
    record = minhash.record_dtype(rows).itemsize
    return sum(max(0, size - arrays.HEADER_BYTES) // (bands * record) for size in sizes)


def pair_count(sizes: list[int]) -> int:
    """Pairs of a group's band files (16 bytes each, after a header)."""
    return sum(max(0, size - arrays.HEADER_BYTES) // 16 for size in sizes)


def group_resources(
    job: str, sizes: dict[str, list[int]], bands: int = 14, rows: int = 8, attempt: int = 1
) -> dict[str, int]:
    """{"mem_mb", "runtime" (minutes)} of a group job from its input files' sizes in bytes:
    `sizes["signatures"]` (minhash_buckets, cluster_minhash_pairs), `sizes["pairs"]`
    (cluster_minhash_pairs), `sizes["hashes"]` (find_exact_repeats); `attempt`: Snakemake's,
    from 1."""
    if job == "minhash_buckets":
        documents = signature_documents(sizes["signatures"], bands, rows)
        passes = max(1, -(-documents // buckets.ROWS_PER_PASS))
        record = minhash.record_dtype(rows).itemsize
        shards = len(sizes["signatures"])
        carry = min(shards * buckets.chunk_bytes(shards), documents * record)
        held = -(-documents // passes) * BUCKET_BYTES_PER_DOCUMENT + carry
        cpu = documents * BUCKET_CPU_S_PER_DOCUMENT
        read = documents * record
    elif job == "cluster_minhash_pairs":
        documents = signature_documents(sizes["signatures"], bands, rows)
        pairs = pair_count(sizes["pairs"])
        wide = 2 if documents >= 2**31 else 1  # int64 parents
        held = documents * CLUSTER_BYTES_PER_DOCUMENT * wide + CLUSTER_BLOCK_MIB * MIB
        cpu = pairs * CLUSTER_CPU_S_PER_PAIR + documents * CLUSTER_CPU_S_PER_DOCUMENT
        read = sum(sizes["pairs"])
    elif job == "find_exact_repeats":
        digests = sum(sizes["hashes"]) // exact.DIGEST_BYTES
        passes = max(1, -(-digests // exact.ROWS_PER_PASS))
        held = -(-digests // passes) * REPEATS_BYTES_PER_DIGEST
        cpu = digests * REPEATS_CPU_S_PER_DIGEST
        read = sum(sizes["hashes"]) * passes  # each pass reads every hash file
    else:
        raise ValueError(f"no sizing for job {job!r}; one of {', '.join(JOBS)}")
    mem = (BASE_MIB * MIB + MARGIN * held) * attempt / MB
    minutes = max(MIN_RUNTIME_MIN, math.ceil((BUSY * cpu + read / READ_BYTES_PER_S) * MARGIN / 60))
    return {"mem_mb": math.ceil(mem), "runtime": minutes * attempt}
