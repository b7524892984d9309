"""Checkpoint saves: asynchronous (train.async_save true) against synchronous, through the trainer.

1. Two trainings of the same run, one with ``train.async_save: false`` (the baseline: DeepSpeed's
   ``save_checkpoint`` writes and fsyncs every file while training waits) and one with it true
   (gptflow.train.async_save: the files are taken into host memory, a writer thread per rank writes
   them), each a real ``gptflow train --config run.yaml`` process, one rank (gloo), DeepSpeed ZeRO 1
   in bf16 (the GPU default; --precision fp32 to compare). The model is a preset from config/models
   (default pythia-160m: 12 layers x 768) with this bench's tokenizer's vocabulary (a ByteLevel
   BPE of --vocab ids trained on the tests' stdlib slice, which is also the training text), so
   about 100 M parameters instead of Pythia's 162 M; same seed, same data, --steps steps of one
   sequence of --seq-length tokens, a save every --save-interval steps, no evaluation, a log
   record every step. --threads torch threads (default 1: the other core stays free for the
   writer thread, as a GPU node's host cores are while its GPUs compute).
   Printed per mode, from metrics.jsonl: the number of saves, the seconds each save blocked
   training (median, max; the async ones include any wait for the previous write), the steps'
   own time (the log's ms/step, which leaves out saves and the warm-up step 1), the loop's wall
   time (from the step-1 record to the process's exit: steps, saves, the last write's wait and
   DONE.json) and the process's wall time (start-up too: imports, DeepSpeed's engine, the data
   index); the bytes of a checkpoint (its step directory); then the ratios async/sync, and
   whether the two runs' final checkpoints are byte-identical
   (gptflow.train.checkpoint.checkpoint_digest of the last step directory of each).
2. The host rates the on-paper estimate needs, on --host-gib GiB of bytes (best of --repeat):
   a tensor clone (host memory copy), ``torch.save`` + fsync into the bench's directory, and
   gptflow.train.async_save's ``take`` (pickle + copy into the reused host buffers) and
   ``write`` (zip + fsync) of the same tensor, checked byte-identical to torch.save's file; and what a
   background snapshot.write leaves a one-thread matmul loop running meanwhile (its rate as a
   share of its rate alone: the writer thread, the zip's CRC and the kernel's write-back take
   cores and memory bandwidth the training shares on this 2-core host).
3. On paper, computed from config/models' --paper-preset (pythia-12b) with Pythia's vocabulary
   (50277 ids, padded as the trainer pads it) at ZeRO 1 over --paper-ranks data-parallel ranks
   (one node): each rank writes its optimizer partition (fp32 master weights + Adam's two
   moments, 12 bytes x parameters / ranks), rank 0 also the bf16 model file (2 bytes x
   parameters); the synchronous save takes rank 0's bytes at a write rate per rank (the one
   measured here, and --sync-rate, 0.73 GB/s, measured before for DeepSpeed's synchronous
   save), the asynchronous one blocks for rank 0's bytes at an ASSUMED pinned device-to-host
   rate (--d2h-rate, 20 GB/s per GPU over PCIe Gen5: not measurable here); the snapshot needs
   host memory of the largest rank's bytes x the node's ranks. No timing is asserted.

Usage: python bench/async_save.py [--preset pythia-160m] [--vocab 8192] [--steps 12]
       [--save-interval 3] [--seq-length 64] [--micro-batch 1] [--precision bf16]
       [--threads 1] [--host-gib 1] [--repeat 2] [--paper-preset pythia-12b] [--paper-ranks 8]
       [--sync-rate 0.73] [--d2h-rate 20] [--matmul-s 2] [--out DIR] [--keep] [--smoke]
(--smoke: the tiny preset in fp32, 4 steps, 10 MiB of host bytes: seconds rather than minutes,
the test suite's run (tests/unit/test_bench.py), whose figures mean nothing.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's bin: gptflow
GB, GIB = 1e9, 2**30
PYTHIA_VOCAB = 50277  # the Pythia / GPT-NeoX-20B tokenizer's ids
# --smoke: the smallest run that still prints every table (explicit options still win)
SMOKE = dict(preset="tiny", vocab=512, steps=4, save_interval=2, precision="fp32",
             host_gib=0.01, repeat=1, matmul_s=0.2)  # fmt: skip


# ----------------------------------------------------------------------------- the two runs


def prepare_data(out: Path, vocab: int) -> tuple[dict, Path, list[str]]:
    """The tests' workflow config, its stdlib slice as one shard, a `vocab`-id BPE."""
    from gptflow.data.readers import collect_local_documents
    from gptflow.data.shards import tokenize_to_shard
    from gptflow.data.sources import expand_root, local_shards
    from gptflow.data.tokenizer import sample_texts, train_bpe

    config = yaml.safe_load((REPO / "tests/config/config.yaml").read_text())
    spec = {**config["datasets"]["stdlib"], "shards": 1}
    (files,) = local_shards("stdlib", spec)
    jsonl = out / "stdlib.jsonl"
    stats = collect_local_documents(files, expand_root(spec["root"]), jsonl)
    tok = out / "tokenizer.json"
    train_bpe(sample_texts([str(jsonl)], "text", 64_000_000), tok, vocab_size=vocab,
              special_tokens=config["tokenizer"]["special_tokens"])  # fmt: skip
    prefix = str(out / "stdlib")
    tokenize_to_shard([str(jsonl)], str(tok), prefix)
    print(f"data: {stats['documents']} documents, {stats['bytes'] / 1e6:.1f} MB (the tests' "
          f"stdlib slice), one shard, ByteLevel BPE of {vocab} ids")  # fmt: skip
    return config, tok, [prefix]


def make_run(out: Path, name: str, config: dict, tok: Path, shards: list[str], a, async_save):
    """A run directory with run.yaml rendered as tests/conftest.py's make_run does."""
    from gptflow.plan.workflow_config import load_workflow_config
    from gptflow.train.run_config import render_run_config, write_run_config

    train = {
        **config["train"], "train_iters": a.steps, "save_interval": a.save_interval,
        "seq_length": a.seq_length, "micro_batch_size": a.micro_batch,
        "global_batch_size": a.micro_batch, "precision": a.precision, "zero_stage": 1,
        "log_interval": 1, "eval_interval": a.steps, "eval_iters": 0, "keep_last": 2,
        "lr_warmup_iters": 1, "async_save": async_save,
    }  # fmt: skip
    cfg = load_workflow_config(
        {**config, "run": name, "model": {"preset": a.preset}, "train": train},
        schema_path=REPO / "config/schema/config.schema.yaml",
        models_dir=REPO / "config/models",
        source="bench",
    )
    run_dir = out / name
    run_dir.mkdir()
    run = render_run_config(cfg, tokenizer_path=str(tok), shards={"stdlib": shards},
                            run_dir=str(run_dir))  # fmt: skip
    write_run_config(run, run_dir / "run.yaml")
    return run_dir, run


def train(run_dir: Path, threads: int) -> dict:
    """`gptflow train` on the run; its wall time, exit time and metrics records."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}  # fmt: skip
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    cmd = [str(BIN / "gptflow"), "train", "--config", str(run_dir / "run.yaml"),
           "--threads", str(threads)]  # fmt: skip
    started = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall, ended = time.perf_counter() - started, time.time()
    (run_dir / "train.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-30:])
        raise SystemExit(f"gptflow train failed ({p.returncode}) in {run_dir}:\n{tail}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"wall": wall, "ended": ended, "records": records}


def summarize(run_dir: Path, res: dict) -> dict:
    """The figures of one run (see the module docstring)."""
    from gptflow.train.checkpoint import checkpoint_digest

    saves = [r for r in res["records"] if r["kind"] == "save"]
    trains = [r for r in res["records"] if r["kind"] == "train"]
    (series,) = [p for p in (run_dir / "checkpoints").iterdir() if p.is_dir()]
    last = series / (series / "latest").read_text().strip()
    blocked = [r["blocked_s"] for r in saves]
    return {
        "saves": len(saves),
        "modes": sorted({r["mode"] for r in saves}),
        "blocked": blocked,
        "waited": [r["waited_s"] for r in saves],
        "steps_s": sum(r["ms_per_step"] * r["timed_steps"] for r in trains if r["ms_per_step"])
        / 1000,  # the warm-up step 1 is not timed
        "loop_s": res["ended"] - trains[0]["time"],
        "wall_s": res["wall"],
        "bytes": sum(f.stat().st_size for f in last.rglob("*") if f.is_file()),
        "last": last,
        "digest": checkpoint_digest(last),
    }


def print_runs(s: dict, params: int) -> None:
    print(f"\n  {'':<26} {'sync (baseline)':>16} {'async':>16} {'async/sync':>11}")

    def row(label: str, f, fmt: str, ratio: bool = True) -> None:
        a, b = f(s["sync"]), f(s["async"])
        r = f"{b / a:10.3f}x" if ratio and a else ""
        print(f"  {label:<26} {a:>16{fmt}} {b:>16{fmt}} {r:>11}")

    row("saves", lambda x: x["saves"], "d", ratio=False)
    row("blocked per save, median s", lambda x: statistics.median(x["blocked"]), ".3f")
    row("blocked per save, max s", lambda x: max(x["blocked"]), ".3f")
    row("blocked, all saves s", lambda x: sum(x["blocked"]), ".3f")
    row("  of it waiting for a write", lambda x: sum(x["waited"]), ".3f", ratio=False)
    row("steps 2.. own time s", lambda x: x["steps_s"], ".2f")
    row("loop (step 1 to exit) s", lambda x: x["loop_s"], ".2f")
    row("process wall s", lambda x: x["wall_s"], ".2f")
    row("checkpoint bytes per save", lambda x: x["bytes"], ",d", ratio=False)
    for mode in ("sync", "async"):
        x = s[mode]
        print(f"  {mode:>5}: modes logged {x['modes']}, blocked per save "
              f"{' '.join(f'{b:.3f}' for b in x['blocked'])} s")  # fmt: skip
    digests = s["sync"]["digest"], s["async"]["digest"]
    print(f"  final checkpoints ({s['sync']['last'].name}) byte-identical: "
          f"{digests[0] == digests[1]} (checkpoint_digest {digests[0][:16]} / "
          f"{digests[1][:16]})")  # fmt: skip
    print(f"  checkpoint bytes per parameter: {s['sync']['bytes'] / params:.2f} "
          f"(bf16 weights 2 + fp32 master and Adam moments 12 = 14, + small files)")  # fmt: skip


# ----------------------------------------------------------------------------- host rates


def best(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def host_rates(out: Path, gib: float, repeat: int, matmul_s: float) -> dict:
    """Seconds per byte of a clone, torch.save + fsync, snapshot take and write (best of)."""
    import torch

    from gptflow.train import async_save

    n = int(gib * GIB)
    t = torch.randint(0, 256, (n,), dtype=torch.uint8)
    clone_s = best(lambda: t.clone(), repeat)
    plain = out / "host" / "plain" / "tensor.pt"
    plain.parent.mkdir(parents=True)

    def save() -> None:  # as CheckpointSeries.save: DeepSpeed's torch.save, then fsync
        torch.save({"t": t}, plain)
        with open(plain, "rb") as f:
            os.fsync(f.fileno())

    save_s = best(save, repeat)
    pool = async_save.BufferPool()
    takes = []  # the first allocates its buffers, the others reuse them (as every later save)
    for _ in range(repeat + 1):
        started = time.perf_counter()
        snap = async_save.take({"t": t}, str(plain), pool)
        takes.append(time.perf_counter() - started)
        if len(takes) <= repeat:
            pool.give_back(snap.buffers)
    temp = out / "host" / "snap"
    temp.mkdir()
    written = []

    def write_synced():  # what the writer thread does: the zip, then fsync (fsutil.publish)
        path = async_save.write(snap, temp)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        written.append(path)

    write_s = best(write_synced, repeat)
    same = written[-1].read_bytes() == plain.read_bytes()
    compute = compute_during(write_synced, matmul_s)
    return {"compute": compute, "bytes": n, "clone": clone_s, "save": save_s,
            "take_first": takes[0], "take": min(takes[1:]), "write": write_s,
            "same": same}  # fmt: skip


def compute_during(work, alone_s: float) -> tuple[float, float]:
    """A one-thread matmul loop's rate while `work` runs in a thread, as a share of its rate
    alone (`alone_s` seconds): what a background write leaves a training step of this bench. Returns
    (share, the work's seconds)."""
    import threading

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x = torch.randn(512, 512)

    def rate(stop) -> float:
        n, started = 0, time.perf_counter()
        while not stop():
            x @ x
            n += 1
        return n / (time.perf_counter() - started)

    end = time.perf_counter() + alone_s
    alone = rate(lambda: time.perf_counter() > end)
    took = []
    thread = threading.Thread(target=lambda: took.append(best(work, 1)))
    thread.start()
    during = rate(lambda: not thread.is_alive())
    thread.join()
    torch.set_num_threads(threads)
    return during / alone, took[0]


def print_rates(r: dict, repeat: int) -> None:
    n = r["bytes"]
    print(f"\nhost rates on {n / GIB:g} GiB (best of {repeat}), files in the bench's directory:")
    print(f"  tensor clone (host memory copy)      {n / GIB / r['clone']:7.2f} GiB/s")
    print(f"  torch.save + fsync                   {n / GB / r['save']:7.2f} GB/s")
    print(f"  snapshot.take, buffers reused        {n / GB / r['take']:7.2f} GB/s  "
          f"(first take, allocating its buffers: {n / GB / r['take_first']:.2f} GB/s)")  # fmt: skip
    print(f"  snapshot.write (zip + fsync)         {n / GB / r['write']:7.2f} GB/s  "
          f"byte-identical to torch.save's file: {r['same']}")  # fmt: skip
    share, took = r["compute"]
    print(f"  a one-thread matmul loop while snapshot.write runs in a thread ({took:.2f} s): "
          f"{share:.0%} of its rate alone")  # fmt: skip


# ----------------------------------------------------------------------------- on paper


def on_paper(a, rates: dict) -> None:
    from gptflow.config.schema import load_yaml
    from gptflow.config.settings import ModelConfig, padded_vocab_size

    preset = load_yaml(REPO / "config/models" / f"{a.paper_preset}.yaml") or {}
    vocab = padded_vocab_size(PYTHIA_VOCAB, preset.get("make_vocab_size_divisible_by", 128))
    cfg = ModelConfig(**{**preset, "vocab_size": vocab})
    p, dp = cfg.num_parameters(), a.paper_ranks
    partition = 12 * p // dp  # fp32 master weights + Adam's exp_avg and exp_avg_sq, 1/dp each
    rank0 = 2 * p + partition  # + the bf16 model file
    measured = rates["bytes"] / rates["write"] / GB  # snapshot.write, what the writer thread does
    plain = rates["bytes"] / rates["save"] / GB
    print(f"\non paper: {a.paper_preset} ({p:,} parameters, vocab {vocab}), bf16 ZeRO 1 over "
          f"{dp} data-parallel ranks on one node of H100s")  # fmt: skip
    print(f"  rank 0 writes {rank0 / GB:.1f} GB (model file {2 * p / GB:.1f} GB bf16 + optimizer "
          f"partition {partition / GB:.1f} GB), ranks 1-{dp - 1} {partition / GB:.1f} GB each; "
          f"{(rank0 + (dp - 1) * partition) / GB:.1f} GB a checkpoint")  # fmt: skip
    for label, rate in (("measured here, torch.save + fsync", plain),
                        ("measured before, DeepSpeed's sync save", a.sync_rate)):  # fmt: skip
        print(f"  synchronous save at {rate:.2f} GB/s per rank ({label}): training blocked "
              f"{rank0 / GB / rate:.1f} s a save (rank 0)")  # fmt: skip
    print(f"  asynchronous save at an ASSUMED {a.d2h_rate:g} GB/s pinned device-to-host copy per "
          f"GPU (PCIe Gen5; not measurable here): training blocked {rank0 / GB / a.d2h_rate:.1f} "
          f"s a save; rank 0's write then runs {rank0 / GB / measured:.1f} s in the background "
          f"at this host's snapshot.write rate ({measured:.2f} GB/s), "
          f"{rank0 / GB / a.sync_rate:.1f} s at {a.sync_rate:g} GB/s: a save interval longer "
          f"than that never waits")  # fmt: skip
    print(f"  host memory for the snapshots: {rank0 / GB:.1f} GB (largest rank) x {dp} ranks = "
          f"{dp * rank0 / GB:.1f} GB per node (buffers pinned, kept between saves)")  # fmt: skip


# ----------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="pythia-160m", help="config/models/<preset>.yaml")
    p.add_argument("--vocab", type=int, default=8192, help="the bench tokenizer's ids (8192)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-interval", type=int, default=3)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (1)")
    p.add_argument("--host-gib", type=float, default=1.0, help="bytes of the host rates (1 GiB)")
    p.add_argument("--repeat", type=int, default=2, help="host rates: best of (2)")
    p.add_argument("--paper-preset", default="pythia-12b")
    p.add_argument("--paper-ranks", type=int, default=8, help="data-parallel ranks (8)")
    p.add_argument("--sync-rate", type=float, default=0.73, help="GB/s, measured before (0.73)")
    p.add_argument("--d2h-rate", type=float, default=20.0, help="GB/s, assumed (20)")
    p.add_argument("--out", help="make the scratch directory in DIR (default: the system's)")
    p.add_argument("--keep", action="store_true", help="keep it (run dirs, train.log)")
    p.add_argument("--matmul-s", type=float, default=2.0,
                   help="seconds of the matmul loop's rate alone (2)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help=f"seconds, not minutes: {SMOKE}")
    a = p.parse_args()
    if a.smoke:  # its values as the defaults: an option given on the command line still wins
        p.set_defaults(**SMOKE)
        a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"host: {os.cpu_count()} cores, load average {load} (a shared host: compare ratios)")
    with contextlib.ExitStack() as stack:
        if a.keep:
            out = Path(tempfile.mkdtemp(prefix="async-save-", dir=a.out))
            print(f"scratch directory (kept): {out}")
        else:
            out = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=a.out)))
        config, tok, shards = prepare_data(out, a.vocab)
        summary = {}
        for mode in ("sync", "async"):
            run_dir, run = make_run(out, f"bench-{mode}", config, tok, shards, a, mode == "async")
            if mode == "sync":
                params = run.model.num_parameters()
                print(f"model: {a.preset} with vocab {run.model.vocab_size}: "
                      f"{params:,} parameters ({run.model.num_layers} layers x "
                      f"{run.model.hidden_size}); {a.steps} steps of {a.micro_batch} x "
                      f"{a.seq_length} tokens, a save every {a.save_interval}, {a.precision} "
                      f"ZeRO 1, 1 rank, {a.threads} torch thread(s)")  # fmt: skip
            summary[mode] = summarize(run_dir, train(run_dir, a.threads))
            print(f"  {mode}: gptflow train done in {summary[mode]['wall_s']:.1f} s")
        print_runs(summary, params)
        rates = host_rates(out, a.host_gib, a.repeat, a.matmul_s)
        print_rates(rates, a.repeat)
        x = summary["async"]
        expected = x["bytes"] / rates["bytes"] * rates["take"]
        print(f"  so an async save here should block about {expected:.2f} s "
              f"(checkpoint bytes at the take rate); measured median "
              f"{statistics.median(x['blocked']):.3f} s")  # fmt: skip
        on_paper(a, rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
