"""MinHash at Pile scale (issue 48): the bucket, clustering and removal stages decide exactly
as before (tests/support/minhash_baseline.py, the former code, on the same signatures), while
a bucket job reads each byte of its band once, the clustering's memory follows the documents
and not the pairs, and a removal job reads its slice of the list, not the list."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gptflow.data.quality import buckets, clusters, minhash, removal
from gptflow.errors import GptflowError
from tests.support import minhash_baseline as baseline
from tests.support.planted import planted_pairs

READER = {"json_key": "text"}
DEFAULTS = {"ngram": 5, "bands": 14, "rows": 8, "seed": 1, "tokenizer": "regex"}
REPO = Path(__file__).resolve().parents[4]


def rchar() -> int:
    """Bytes this process has asked read()/pread() for (page cache or not; not mmap's)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def refuse_mmap(monkeypatch) -> None:
    """A memory map refused: its reads would be invisible to rchar, and its pages resident."""

    def refuse(*args, **kwargs):
        raise AssertionError("memory-mapped")

    monkeypatch.setattr(mmap, "mmap", refuse)


@pytest.fixture
def no_mmap(monkeypatch):
    refuse_mmap(monkeypatch)


def planted_corpus(rng: np.random.Generator, shards: int = 4) -> list[list[str]]:
    """Planted pairs at Jaccard 0-1, exact copies, a copy of a copy (chains), documents too
    short to sign, all placed at random over `shards` shards (some empty-ish)."""
    pairs = planted_pairs(300, rng, length=120)
    texts = [t for p in pairs for t in p[:2]]
    texts += [texts[i] for i in rng.integers(0, len(texts), 60)]  # exact copies
    texts += ["too short", "too short", "a b c d"] * 3
    chained = texts[0].split()
    for i in range(0, 40, 8):
        chained[i] = "changed"
        texts.append(" ".join(chained))
    place = rng.integers(0, shards, len(texts))
    order = rng.permutation(len(texts))
    return [[texts[i] for i in order if place[i] == s] for s in range(shards)]


def write_shard(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def run_both(tmp_path: Path, corpus: list[list[str]], rows_per_pass: int) -> dict:
    """The new stages and the baseline on the same documents: their band pair files, removal
    lists, counts and kept documents."""
    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir(exist_ok=True)
    old.mkdir(exist_ok=True)
    sigs, rows_major = [], []
    for i, texts in enumerate(corpus):
        shard = write_shard(tmp_path / f"{i}.jsonl", texts)
        sigs.append(new / f"{i}.sig.npy")
        minhash.signatures_of_shard(shard, READER, DEFAULTS, sigs[-1])
        rows_major.append(old / f"{i}.sig.npy")
        baseline.signatures_of_shard(texts, DEFAULTS, rows_major[-1])
    out = {"new": {}, "old": {}}
    for band in range(DEFAULTS["bands"]):
        buckets.band_pairs(sigs, band, 8, new / f"{band}.npy", rows_per_pass=rows_per_pass)
        baseline.band_pairs(rows_major, band, 8, old / f"{band}.npy", rows_per_pass=rows_per_pass)
        out["new"].setdefault("bands", []).append(np.load(new / f"{band}.npy"))
        out["old"].setdefault("bands", []).append(np.load(old / f"{band}.npy"))
    bands = range(DEFAULTS["bands"])
    documents = minhash.shard_documents(sigs)
    out["new"]["stats"] = clusters.cluster(
        [new / f"{b}.npy" for b in bands], documents, new / "r.npy"
    )
    out["old"]["stats"] = baseline.cluster([old / f"{b}.npy" for b in bands], old / "r.npy")
    for name, where in (("new", new), ("old", old)):
        out[name]["removed"] = np.load(where / "r.npy")
        out[name]["kept"] = []
        for i in range(len(corpus)):
            kept = where / f"{i}.kept.jsonl"
            removal.remove_documents(tmp_path / f"{i}.jsonl", READER, where / "r.npy", i, kept,
                                     where / f"{i}.json", reason="minhash", about={})  # fmt: skip
            out[name]["kept"].append(kept.read_text())
    return out


@pytest.mark.parametrize("rows_per_pass", [1 << 24, 97])
def test_the_stages_decide_as_before_on_a_planted_corpus(tmp_path, rows_per_pass):
    """Same pairs in every band (array for array, so in the same order), same clusters, same
    removal list, same kept documents; in one pass and in ~9."""
    corpus = planted_corpus(np.random.default_rng(48))
    got = run_both(tmp_path, corpus, rows_per_pass)
    new, old = got["new"], got["old"]
    assert sum(len(b) for b in old["bands"]) > 500  # near-copies, copies, chains
    for band, (a, b) in enumerate(zip(new["bands"], old["bands"], strict=True)):
        assert np.array_equal(a, b), band
    assert new["stats"] == old["stats"] and old["stats"]["removed"] > 100
    assert max(int(s) for s in old["stats"]["cluster_sizes"]) >= 4
    assert np.array_equal(new["removed"], old["removed"])
    assert new["kept"] == old["kept"]


def crafted_signatures(rng: np.random.Generator, n: int, alphabet: int) -> np.ndarray:
    """(n, 14 * 8) uint64 signatures over a tiny alphabet of values: many documents share a
    band's first value but not the rest (the sort's hard case), many share whole bands; some
    have no signature; a few values sit at the pass boundaries."""
    sigs = rng.integers(0, alphabet, (n, 14 * 8)).astype(np.uint64)
    sigs[:, ::8] = rng.choice(
        np.array([0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 2], dtype=np.uint64), (n, 14)
    )
    if n > 1:
        for share in (8, 4, 1):  # whole bands of another document, or their first values
            to, of = rng.integers(0, n, (2, n // 4))
            for band in range(14):
                sigs[to, band * 8 : band * 8 + share] = sigs[of, band * 8 : band * 8 + share]
    sigs[rng.random(n) < 0.1] = minhash.NO_SIGNATURE
    return sigs


@pytest.mark.parametrize(("alphabet", "rows_per_pass"), [(2, 1 << 24), (3, 50), (1000, 7)])
def test_band_pairs_equal_the_former_on_crafted_signatures(tmp_path, alphabet, rows_per_pass):
    rng = np.random.default_rng(alphabet)
    new, old = [], []
    for i, n in enumerate([0, 37, 1, 120, 64]):
        sigs = crafted_signatures(rng, n, alphabet)
        new.append(tmp_path / f"{i}.new.npy")
        minhash.write_signatures(new[-1], [sigs], 14, 8)
        old.append(tmp_path / f"{i}.old.npy")
        np.save(old[-1], sigs)
    for band in (0, 5, 13):
        buckets.band_pairs(new, band, 8, tmp_path / "a.npy", rows_per_pass=rows_per_pass)
        baseline.band_pairs(old, band, 8, tmp_path / "b.npy", rows_per_pass=rows_per_pass)
        a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
        assert len(b) and np.array_equal(a, b), band


def test_a_bucket_job_reads_each_byte_of_its_band_once(tmp_path, no_mmap, monkeypatch):
    """In 9 passes over 3 shards of 20,000 documents, rchar grows by the band's records with a
    signature (68 bytes each, 3.3 MB), at most a chunk (16 KiB here) a shard of the records
    without one (sorted last) and the headers: each byte of the band at most once. No memory map (whose
    reads rchar would not count: the former code's grew by 25 kB, it mapped every shard); a
    second read of the band would double it."""
    rng = np.random.default_rng(7)
    files, signed = [], 0
    for i in range(3):
        sigs = rng.integers(0, 2**64 - 1, (20_000, 112), dtype=np.uint64)
        sigs[rng.random(20_000) < 0.2] = minhash.NO_SIGNATURE
        signed += int((sigs[:, 0] != minhash.NO_SIGNATURE).sum())
        files.append(tmp_path / f"{i}.npy")
        minhash.write_signatures(files[-1], [sigs], 14, 8)
    monkeypatch.setattr(buckets, "CHUNK_BYTES", (1 << 14, 1 << 14))
    buckets.band_pairs(files, 3, 8, tmp_path / "warm.npy")  # what a first call imports
    before = rchar()
    buckets.band_pairs(files, 4, 8, tmp_path / "p.npy", rows_per_pass=60_000 // 9 + 1)
    read = rchar() - before
    band_bytes = signed * 68
    assert band_bytes <= read <= band_bytes + 3 * ((1 << 14) + 256) + 200, read


def test_the_clustering_joins_components_across_blocks_as_scipy_does(tmp_path, monkeypatch):
    """Random graphs (chains, stars, repeated edges, either end first) in blocks of 7 pairs,
    resolved 5 documents at a time: the baseline's removal list and counts."""
    monkeypatch.setattr(clusters, "BLOCK_PAIRS", 7)
    monkeypatch.setattr(clusters, "BLOCK_DOCUMENTS", 5)
    rng = np.random.default_rng(3)
    documents = [40, 0, 25, 60]
    places = np.array([(o, i) for o, n in enumerate(documents) for i in range(n)], np.uint32)
    files = []
    for band in range(4):
        edges = rng.integers(0, len(places), (int(rng.integers(5, 60)), 2))
        chain = np.arange(len(places) - 1)[rng.random(len(places) - 1) < 0.2]
        edges = np.concatenate([edges, np.stack([chain, chain + 1], 1)])
        edges = edges[edges[:, 0] != edges[:, 1]]
        files.append(tmp_path / f"{band}.npy")
        np.save(files[-1], np.concatenate([places[edges[:, 0]], places[edges[:, 1]]], 1))
    stats = clusters.cluster(files, documents, tmp_path / "new.npy")
    assert stats == baseline.cluster(files, tmp_path / "old.npy")
    assert np.array_equal(np.load(tmp_path / "new.npy"), np.load(tmp_path / "old.npy"))
    assert stats["removed"] > 50


def test_a_chain_joined_one_pair_a_block_resolves_to_one_cluster(tmp_path, monkeypatch):
    """A chain whose pairs come from its far end, one a block: each join hangs the chain so
    far under a smaller root without compressing its far documents (a tree 30 deep), which the
    end's resolution must follow to the root: one cluster of 31, its first document kept."""
    monkeypatch.setattr(clusters, "BLOCK_PAIRS", 1)
    chain = np.array([[0, i, 0, i + 1] for i in range(29, -1, -1)], np.uint32)
    np.save(tmp_path / "chain.npy", chain)
    stats = clusters.cluster([tmp_path / "chain.npy"], [31], tmp_path / "r.npy")
    assert stats["cluster_sizes"] == {"31": 1} and stats["clusters"] == 1
    assert np.load(tmp_path / "r.npy").tolist() == [[0, i] for i in range(1, 31)]


CLUSTER_PEAK = """
import json, sys, numpy as np
from gptflow.data.quality import clusters
import scipy.sparse.csgraph

def peak():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024
clusters.BLOCK_PAIRS = 1 << 14  # every file longer than a block: the blocks' arrays alike
base = peak()
documents = json.loads(sys.argv[2])
stats = clusters.cluster(sys.argv[3:], documents, sys.argv[1])
print(json.dumps({"growth": peak() - base, "removed": stats["removed"]}))
"""


def cluster_growth(tmp_path: Path, pairs: int, documents: list[int]) -> int:
    """Peak RSS growth of a child clustering `pairs` random pairs (14 files) of `documents`."""
    rng = np.random.default_rng(pairs)
    files = []
    for band, count in enumerate(np.diff(np.linspace(0, pairs, 15).astype(np.int64))):
        p = np.empty((count, 4), dtype=np.uint32)
        for end in (0, 2):
            p[:, end] = rng.integers(0, len(documents), count)
            p[:, end + 1] = rng.integers(0, min(documents), count)
        files.append(str(tmp_path / f"{pairs}-{band}.npy"))
        np.save(files[-1], p)
    src = Path(clusters.__file__).parents[3]  # the gptflow this test imports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)])}
    out = subprocess.run(
        [sys.executable, "-c", CLUSTER_PEAK, str(tmp_path / "r.npy"), json.dumps(documents), *files],
        check=True, capture_output=True, text=True, env=env,
    )  # fmt: skip
    return json.loads(out.stdout)["growth"]


def test_the_clustering_memory_follows_the_documents_not_the_pairs(tmp_path):
    """4x the pairs among the same 200,000 documents (blocks of 2**14 pairs): the peak grows
    by less than 2 MiB (the former clustering held 52-70 bytes a pair: ~50 MiB more for the
    0.9 M more); 4x the documents: by their 4 bytes each and the blocks' arrays (at most
    BLOCK_DOCUMENTS)."""
    few = cluster_growth(tmp_path, 300_000, [50_000] * 4)
    many = cluster_growth(tmp_path, 1_200_000, [50_000] * 4)
    assert many - few < 2 * 2**20, (few, many)
    more_documents = cluster_growth(tmp_path, 300_000, [200_000] * 4)
    assert 4 * 600_000 < more_documents - few < 24 * 600_000, (few, more_documents)


def test_a_removal_job_reads_its_slice_of_the_list_not_the_list(tmp_path, monkeypatch):
    """A list of 4 M documents over 2,000 shards (32 MB): the job for one shard reads its rows
    and ~2 x 22 bisection reads, and maps nothing (the former mapped the list, and read all of
    it from storage: bench/minhash_scale.py)."""
    rng = np.random.default_rng(2)
    ordinals = np.sort(rng.integers(0, 2000, 4_000_000)).astype(np.uint32)
    index = rng.integers(0, 2**20, len(ordinals)).astype(np.uint32)
    order = np.lexsort((index, ordinals))
    removal.write_removed(tmp_path / "r.npy", np.stack([ordinals, index], 1)[order])
    expected = {o: baseline.removed_in_shard(tmp_path / "r.npy", o) for o in (0, 1234, 1999, 2000)}
    refuse_mmap(monkeypatch)
    for ordinal in (0, 1234, 1999, 2000):
        before = rchar()
        got = removal.removed_in_shard(tmp_path / "r.npy", ordinal)
        read = rchar() - before
        assert np.array_equal(got, expected[ordinal]) and (len(got) > 0) == (ordinal < 2000)
        # the rows, the header, 2 bisections of 4-byte reads, /proc/self/io's own read
        assert read <= 8 * len(got) + 256 + 2 * 4 * 24 + 200, (ordinal, read, len(got))


def test_files_of_another_layout_or_truncated_are_refused_in_one_line(tmp_path):
    rows_major = tmp_path / "old.npy"  # signatures as VERSIONS["minhash"] 2 wrote them
    np.save(rows_major, np.zeros((3, 112), np.uint64))
    with pytest.raises(GptflowError, match=r"old\.npy: not band-major MinHash signatures"):
        buckets.band_pairs([rows_major], 0, 8, tmp_path / "p.npy")
    new = tmp_path / "new.npy"
    minhash.write_signatures(new, [np.zeros((3, 112), np.uint64)], 14, 8)
    cut = tmp_path / "cut.npy"
    cut.write_bytes(new.read_bytes()[:-5])
    with pytest.raises(GptflowError, match=r"cut\.npy: a MinHash signature file of \d+ bytes"):
        buckets.band_pairs([cut], 0, 8, tmp_path / "p.npy")
    pairs = tmp_path / "pairs.npy"
    np.save(pairs, np.array([[0, 1, 1, 3]], np.uint32))
    with pytest.raises(GptflowError, match=r"names document 3 of shard 1 of 2 in the group \(3 "):
        clusters.cluster([pairs], [2, 3], tmp_path / "r.npy")
    with pytest.raises(GptflowError, match=r"shard 1 of 1 in the group \(no such shard\)"):
        clusters.cluster([pairs], [2], tmp_path / "r.npy")
    assert not (tmp_path / "p.npy").exists() and not (tmp_path / "r.npy").exists()
    with pytest.raises(GptflowError, match=r"old\.npy: not a removal list \(\(n, 2\) uint32"):
        removal.removed_in_shard(rows_major, 0)
    with pytest.raises(GptflowError, match=r"missing\.npy: no such removal list file; the job"):
        removal.removed_in_shard(tmp_path / "missing.npy", 0)


def test_the_group_jobs_resources_follow_every_input():
    """mem_mb and runtime (gptflow.data.quality.sizing) grow with each input that the job's
    memory or time follows, and with the attempt; the pass caps bound the per-pass memory."""
    from gptflow.data.quality import sizing
    from gptflow.data.quality.arrays import HEADER_BYTES

    def sigs(documents, shards=10):
        return [HEADER_BYTES + documents // shards * 14 * 68] * shards

    def pairs(count):
        return [HEADER_BYTES + count // 14 * 16] * 14

    def res(job, attempt=1, **sizes):
        return sizing.group_resources(job, sizes, 14, 8, attempt)

    assert sizing.signature_documents(sigs(10**6), 14, 8) == 10**6
    assert sizing.pair_count(pairs(14 * 10**6)) == 14 * 10**6
    small, large = res("minhash_buckets", signatures=sigs(10**6)), None
    large = res("minhash_buckets", signatures=sigs(4 * 10**6))
    assert large["mem_mb"] > small["mem_mb"] + 4 and large["runtime"] >= small["runtime"]
    capped = [res("minhash_buckets", signatures=sigs(n))["mem_mb"] for n in (2**23, 2**25)]
    assert capped[1] <= capped[0] + 1  # 4 passes of 2**23, or one of 2**23
    assert res("minhash_buckets", signatures=sigs(10**9))["runtime"] > 60
    base = res("cluster_minhash_pairs", signatures=sigs(10**7), pairs=pairs(10**7))
    more_docs = res("cluster_minhash_pairs", signatures=sigs(10**8), pairs=pairs(10**7))
    more_pairs = res("cluster_minhash_pairs", signatures=sigs(10**7), pairs=pairs(10**10))
    assert more_docs["mem_mb"] > base["mem_mb"] + 4 * 9 * 10**7 * 1.5 / 10**6
    assert more_pairs["mem_mb"] == base["mem_mb"]  # the pairs are streamed
    assert more_pairs["runtime"] > base["runtime"] + 30
    wide = res("cluster_minhash_pairs", signatures=sigs(2**31 + 10), pairs=pairs(0))
    assert wide["mem_mb"] > 8 * 2**31 * 1.5 / 10**6  # int64 parents
    digests = [res("find_exact_repeats", hashes=[16 * n])["mem_mb"] for n in (10**6, 10**7)]
    assert digests[1] > digests[0] + 9 * 10**6 * 90 * 1.5 / 10**6
    for job, sizes in (("minhash_buckets", {"signatures": sigs(10**8)}),
                       ("cluster_minhash_pairs", {"signatures": sigs(10**8), "pairs": pairs(10**9)}),
                       ("find_exact_repeats", {"hashes": [16 * 10**8]})):  # fmt: skip
        once, twice = (sizing.group_resources(job, sizes, 14, 8, a) for a in (1, 2))
        assert twice["mem_mb"] >= 2 * once["mem_mb"] - 1 and twice["runtime"] > once["runtime"]
    with pytest.raises(ValueError, match="no sizing for job 'x'"):
        sizing.group_resources("x", {})


def test_the_readme_s_pile_figures_are_the_sizing_function_s():
    """docs/data-quality.md, "What the group jobs ask for": the mem_mb and runtime of each row are
    group_resources' for 210 M documents in 2,000 shards (14 x 8), worked, not typed in."""
    import re

    from gptflow.data.quality import sizing
    from gptflow.data.quality.arrays import HEADER_BYTES

    documents, shards = 210_000_000, 2000
    signatures = [HEADER_BYTES + documents // shards * 14 * 68] * shards

    def pairs(count):
        return [HEADER_BYTES + count // 14 * 16] * 14

    expected = {
        "`minhash_buckets` (each of 14)": ("minhash_buckets", {"signatures": signatures}),
        "`cluster_minhash_pairs`, 2 x 10^8 pairs": (
            "cluster_minhash_pairs", {"signatures": signatures, "pairs": pairs(2 * 10**8)}),
        "`cluster_minhash_pairs`, 10^9 pairs": (
            "cluster_minhash_pairs", {"signatures": signatures, "pairs": pairs(10**9)}),
        "`find_exact_repeats`": ("find_exact_repeats", {"hashes": [documents // shards * 16] * shards}),
    }  # fmt: skip
    readme = (REPO / "docs" / "data-quality.md").read_text()
    for row, (job, sizes) in expected.items():
        found = re.search(rf"^\| {re.escape(row)} \| [^|]+ \| (\d+) \| (\d+) \|$", readme, re.M)
        assert found, row
        got = sizing.group_resources(job, sizes)
        assert (int(found[1]), int(found[2])) == (got["mem_mb"], got["runtime"]), row
