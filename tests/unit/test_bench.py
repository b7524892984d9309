"""Every file of bench/ runs as a user runs it (`python bench/x.py --smoke`, a process of its own)
and prints its figures and ratios: each row's numbers and its ratio are parsed, not just the exit
status. A benchmark that cannot run here (no nginx or curl, no megatron-core) must say why in one
line, exit non-zero and print no traceback; the test checks that line, then skips (a failure under
GPTFLOW_REQUIRE_ALL=1, as every missing service). The figures of a smoke run mean nothing: only
that they are there, finite, and that the checks the benchmarks print (identical bytes, identical
checkpoints) hold."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NUM = r"(\d[\d,]*\.?\d*)"  # a figure as the benches print it (1,526 or 0.02)
RATIO = rf"{NUM}x"


def run_bench(name: str, tmp_path: Path, *args: str, env: dict | None = None):
    """`python bench/<name>.py --smoke ARGS` in tmp_path (scratch files too): its stdout, or a
    skip with its one-line reason where it cannot run here."""
    env = {**os.environ, "TMPDIR": str(tmp_path), **(env or {})}
    cmd = [sys.executable, str(REPO / "bench" / f"{name}.py"), "--smoke", *args]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    if out.returncode != 0:
        why = [line for line in out.stderr.splitlines() if "cannot run here" in line]
        assert why, (
            f"bench/{name}.py failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
        assert why == [f"bench/{name}.py cannot run here: {why[0].split(': ', 1)[1]}"], why
        pytest.skip(why[0])
    return out.stdout


def rows(text: str, pattern: str) -> list[tuple[str, ...]]:
    """Every match of `pattern` (a whole line); numbers must be finite."""
    found = re.findall(rf"^{pattern}$", text, re.M)
    for row in found:
        for cell in row if isinstance(row, tuple) else (row,):
            if re.fullmatch(NUM, cell):
                assert math.isfinite(float(cell.replace(",", ""))), row
    return found


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_every_bench_file_has_a_smoke_test():
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert {p.stem for p in (REPO / "bench").glob("*.py")} <= tested


def test_train(tmp_path):
    """Its Muon table runs DeepSpeed's Newton-Schulz eagerly here (TORCH_COMPILE_DISABLE: the
    compile of its first call costs ~17 s of CPU, as in test_muon_layouts); the bench itself
    compiles it, untimed. No warm-up steps (`--warmup 0`, which divided by zero once)."""
    out = run_bench("train", tmp_path, "--warmup", "0", env={"TORCH_COMPILE_DISABLE": "1"})
    got = rows(
        out,
        rf"  (plain PyTorch AdamW loop|trainer, DeepSpeed ZeRO-\d(?: \+ K-FAC)?)\s+{NUM}\s+{NUM}"
        rf"\s+{NUM}\s+{NUM}\s+{RATIO}\s+{RATIO}",
    )
    names = [r[0] for r in got]
    stages = [f"trainer, DeepSpeed ZeRO-{s}" for s in range(4)]
    assert names == ["plain PyTorch AdamW loop", *stages, *(f"{n} + K-FAC" for n in stages[:3])]
    assert got[0][5:] == ("1.000", "1.000")  # the plain loop against itself
    assert all(number(r[1]) > 0 and number(r[5]) > 0 for r in got)
    # ZeRO 3 with K-FAC: refused as the preflight refuses it (config.settings.check_kfac)
    assert re.search(
        r"^  trainer, DeepSpeed ZeRO-3 \+ K-FAC\s+refused by gptflow: train\.kfac is not "
        r"supported with train\.zero_stage 3: .*$",
        out,
        re.M,
    )
    # the same work: every stage's weights equal the plain loop's after the same steps
    check = re.search(r"max \|parameter - plain loop's\|: (.*)$", out, re.M)[1]
    diffs = dict(re.findall(r"(ZeRO-\d) ([\d.e+-]+)", check))
    assert set(diffs) == {"ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3"}
    assert all(float(d) < 1e-4 for d in diffs.values()), diffs
    assert rows(out, rf"  net extra per step\s+-?{NUM} ms = -?{NUM}% of the plain step")
    out, muon_table = out.split("\nMuon against AdamW: ")
    kfac = rows(out, rf"  (AdamW|K-FAC 5/50|K-FAC 1/10)\s+{NUM}  ((?:{NUM} ?)+)\s+{NUM}")
    assert [r[0] for r in kfac] == ["AdamW", "K-FAC 5/50", "K-FAC 1/10"]
    muon = rows(
        muon_table,
        rf"  (AdamW|Muon \(DeepSpeed\)|torch\.optim\.Muon)\s+{NUM}\s+{RATIO}  ((?:{NUM} ?)+)"
        rf"\s+{NUM}",
    )
    assert [r[0] for r in muon] == ["AdamW", "Muon (DeepSpeed)", "torch.optim.Muon"]
    assert all(number(r[1]) > 0 for r in muon) and muon[0][2] == "1.00"


def test_parallel(tmp_path):
    out = run_bench("parallel", tmp_path)
    got = rows(
        out,
        rf"  (data parallel 2 \(baseline\)|tensor parallel 2)\s+{NUM} ms/step\s+{NUM} tokens/s"
        rf"\s+{RATIO} the baseline's tokens/s",
    )
    assert [r[0] for r in got] == ["data parallel 2 (baseline)", "tensor parallel 2"]
    assert got[0][3] == "1.00" and number(got[1][3]) > 0


def test_async_save(tmp_path):
    out = run_bench("async_save", tmp_path)
    got = rows(out, rf"  ((?:blocked|steps|loop|process).*?)\s+{NUM}\s+{NUM}\s+{RATIO}")
    assert [r[0] for r in got] == [
        "blocked per save, median s",
        "blocked per save, max s",
        "blocked, all saves s",
        "steps 2.. own time s",
        "loop (step 1 to exit) s",
        "process wall s",
    ]
    assert rows(out, r"  saves\s+2\s+2\s*")  # 4 steps, a save every 2, in both modes
    assert "byte-identical: True" in out  # the async run's checkpoint is the sync run's
    for label in ("tensor clone", "torch.save", "snapshot.take", "snapshot.write"):
        assert re.search(rf"^  {re.escape(label)}.*\s{NUM} Gi?B/s", out, re.M), label
    assert "byte-identical to torch.save's file: True" in out
    assert re.search(rf"matmul loop .* {NUM}% of its rate alone$", out, re.M)


def test_plan(tmp_path):
    out = run_bench("plan", tmp_path)
    got = rows(
        out,
        rf"  (local|url|quality)\s+10\s+{NUM}\s+{NUM}s\s+{NUM}s\s+{NUM}s\s+{RATIO}\s+{RATIO}\s+{RATIO}\s+{NUM}",
    )
    assert [r[0] for r in got] == ["local", "url", "quality"]
    assert all(number(r[1]) > 20 and number(r[5]) > 0 for r in got)  # N collect + N tokenize
    assert number(got[2][1]) > 80  # + per shard 6 quality jobs, per group 16


def test_run(tmp_path):
    out = run_bench("run", tmp_path)
    assert rows(
        out, rf"  baseline \(Megatron-style per-document loop, 1 process\):\s+{NUM} s\s+{NUM} MB/s"
    )
    got = rows(
        out,
        rf"  gptflow tokenize --engine hf --workers (\d):\s+{NUM} s\s+{NUM} MB/s"
        rf"\s+x{NUM} vs baseline\s+identical bytes: True",
    )
    assert [r[0] for r in got] == ["1", "2"]


def test_tokenization(tmp_path):
    out = run_bench("tokenization", tmp_path, "--work", str(tmp_path / "work"))
    ceilings = rows(out, rf"  (gigatoken|hf)\s+(\d) thread\(s\):\s+{NUM} MB/s(?: \(5% sample\))?")
    assert [r[:2] for r in ceilings] == [("gigatoken", "1"), ("gigatoken", "2"), ("hf", "2")]
    got = rows(
        out,
        rf"  (auto|hf)\s+(\d)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}%  (\S+) .*, identical, .*",
    )
    assert [r[:2] for r in got] == [("auto", "1"), ("auto", "2"), ("hf", "1"), ("hf", "2")]


def test_download(tmp_path):
    out = run_bench("download", tmp_path)
    got = rows(out, rf"  (curl -o|curl -o && \S+ sha256 && sync|gptflow download --sha256 \(fsync\))"
                    rf"\s+{NUM} s\s+{NUM} MB/s.*")  # fmt: skip
    assert len(got) == 3
    assert rows(out, rf"  gptflow download .* = {RATIO} plain curl, {RATIO} curl\+sha256\+sync")


def test_download_without_curl_says_why_in_one_line(tmp_path):
    """The one-line refusal itself (curl is the baseline): PATH without curl, for real."""
    bare = tmp_path / "bin"
    bare.mkdir()
    cmd = [sys.executable, str(REPO / "bench" / "download.py"), "--smoke"]
    out = subprocess.run(cmd, env={**os.environ, "PATH": str(bare)}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1
    assert out.stdout == ""
    assert (
        out.stderr == "bench/download.py cannot run here: no curl on PATH (apt-get install curl)\n"
    )


def test_import_megatron(tmp_path):
    out = run_bench("import_megatron", tmp_path)
    got = rows(
        out,
        rf"((?:scan|sha256|numpy).*?)\s+{NUM} MB/s \({NUM} s\)\s+{RATIO} sha256 alone's rate",
    )
    assert [r[0] for r in got] == [
        "scan + sha256, cached",
        "scan + sha256, from disk",
        "sha256 alone, cached",
        "numpy max alone, cached",
    ]
    assert got[2][3] == "1.00"


def test_blend_index(tmp_path):
    out = run_bench("blend_index", tmp_path)
    got = rows(
        out,
        rf"\s*(3 random|5 random|Pile \(22\))\s+1,000 \|\s+{NUM}\s+{NUM}\s+{NUM}\s+\|\s+{NUM}"
        rf"\s+{NUM}\s+{NUM}\s+\| True",
    )
    assert [r[0] for r in got] == ["3 random", "5 random", "Pile (22)"]
    assert rows(out, rf"trainer, cached 1,000-sample index: memory-mapped in {NUM} ms")


def test_quality(tmp_path):
    """The spaCy signals decide as DataTrove does on every document of the smoke corpus; the
    rates are positive and the ratios are theirs; our MinHash and DataTrove's find all the
    smoke's planted pairs at J >= 0.85 and none at J <= 0.5."""
    import json

    from gptflow.data.quality.filters import RULES

    out = run_bench("quality", tmp_path, "--json")
    assert "per-document agreement with DataTrove" in out
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["documents"] == 40 and figures["mib"] > 0.05
    rate = figures["mib_per_s"]
    assert all(value > 0 for value in rate.values())
    assert figures["ratio_regex_to_datatrove"] == pytest.approx(
        rate["signals_regex"] / rate["datatrove_four_filters"]
    )
    assert figures["agreement"]["spacy"] == dict.fromkeys(RULES, 1.0)
    assert set(figures["agreement"]["regex"]) == set(RULES)
    assert all(0.8 <= a <= 1 for a in figures["agreement"]["regex"].values())
    assert figures["ratio_minhash_to_datatrove"] == pytest.approx(
        rate["minhash_signatures"] / rate["datatrove_minhash_signatures"]
    )
    planted = figures["minhash_planted"]
    assert planted["high"] >= 3 and planted["low"] >= 3
    for name in ("ours", "datatrove"):  # (the smoke's few pairs: no S-curve near-misses)
        assert planted[name]["recall_high"] == 1.0 and planted[name]["fp_low"] == 0.0


def test_minhash_scale(tmp_path):
    """Both implementations' MinHash stages on the smoke's corpora: every table row is there
    and finite, today's bucket job reads less than the former's (13 passes of every column)
    and its reads (rchar) are its band's, and the two decide alike ('identical ... yes')."""
    import json

    out = run_bench("minhash_scale", tmp_path, "--json")
    assert "identical pairs (band 0), removal lists and counts: yes" in out
    reads = rows(out, rf"\s+{NUM}\s+(\d+)\s+{NUM} \| {NUM} / {NUM} MiB, {RATIO}; rchar {NUM}; "
                      rf"band {NUM} \| {NUM} / {NUM} s")  # fmt: skip
    assert len(reads) == 6 and all(number(r[5]) > 1 for r in reads)
    clusterings = rows(out, rf"\s+{NUM}\s+{NUM} \| {NUM} / {NUM}, {RATIO} \| {NUM}, {NUM} \| "
                            rf"{NUM} / {NUM}")  # fmt: skip
    assert len(clusterings) == 6
    figures = json.loads(out.strip().splitlines()[-1])
    for row in figures["by_size"] + figures["by_copies"]:
        today = row["buckets_today"]
        assert row["band_bytes"] <= today["rchar"] < row["band_bytes"] + 16 * (1 << 22)
        assert today["rchar"] < row["buckets_former"]["read_bytes"]


def test_autotune(tmp_path):
    out = run_bench("autotune", tmp_path)
    got = rows(out, rf"  (tiny\.tune\.mb[48]\.z0\.ac0)\s+{NUM}\s+{RATIO}\s+{NUM}%\s+{NUM}\s+{NUM}")
    assert sorted(r[0] for r in got) == ["tiny.tune.mb4.z0.ac0", "tiny.tune.mb8.z0.ac0"]
    own = next(r for r in got if r[0] == "tiny.tune.mb4.z0.ac0")
    assert own[2] == "1.00"  # the baseline: the run's own layout
    assert rows(out, rf"  search: {NUM} s wall for 2 trial\(s\) \({NUM} s a trial\), of which "
                rf"timed steps {NUM} s \((\d+)%\)")  # fmt: skip
    assert rows(out, rf"  fastest: tiny\.tune\.mb[48]\.z0\.ac0 {NUM} tokens/s = {RATIO} the run's "
                rf"own layout \(tiny\.tune\.mb4\.z0\.ac0, {NUM} tokens/s\)")  # fmt: skip
    assert rows(out, rf"  a second invocation: {NUM} s, nothing run")
