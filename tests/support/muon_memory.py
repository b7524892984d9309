"""Run under torchrun (gloo): what DeepSpeed's Muon allocates and sends on each rank, for each
setting of argument 2 (comma-separated ``size:zero:precision[:key=value...]``; size tiny or
small; keys: ``bucket`` reduce_bucket_size in elements, ``deepspeed`` for DeepSpeed's default
(else gptflow's engine sets its own), ``cache`` a stand-in for DeepSpeed's 256 MiB
gather-cache limit in bytes, ``subgroup`` zero_optimization.sub_group_size, ``lr``
train.muon.lr), written as ``rank<N>.json`` into the directory given first. One process per
rank builds an engine per setting as the trainer does (gptflow.train.engine) and trains 2
steps (the first fills DeepSpeed's gather cache).

ZeRO 3: each step's ``_apply_muon_to_accumulated_grads`` runs under torch's profiler with
memory events; the update's peak is the most the main thread's allocations reach above where
they started, outside Newton-Schulz (DeepSpeed's ``muon_update`` wrapped in a profiler
range; its own peak is recorded apart). gloo's worker threads allocate buffers of their own
(as NCCL does outside PyTorch's allocator): not counted, nor their frees. Each collective the
update makes is run to completion before it returns and until gloo's worker has dropped the
tensors it held, and DeepSpeed receives a handle that holds them as the work handle did (the
worker thread releasing them at a moment of its own made the peak vary from step to step).
Also recorded: the bytes each collective sends every rank (dp - 1 times its input), the gather
cache and the momentum partitions after the step, the Muon groups' shapes as DeepSpeed holds
them, and the reduce_bucket_size it runs with.

ZeRO 1/2: after a step, the committed and the staged momentum (DeepSpeedZeroOptimizer) or the
momentum (BF16_Optimizer), and the bytes the engine keeps (tests.support.memory.kept_bytes).
"""

import gc
import json
import sys
import threading
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.train import device, distributed, engine
from tests.support.memory import kept_bytes

SIZES = {
    "tiny": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256),
    "small": ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=256),
}
MICRO, SEQ, STEPS = 2, 16, 2
MAIN = threading.get_native_id()


class Held:
    """A finished collective's handle, holding its tensors as the work handle did."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return True


def settled(collective, sent: list):
    """`collective` run to completion, until gloo's worker has let go of its tensors and of the
    views it made of them (``all_gather_into_tensor`` chunks its output)."""

    def holders(tensors) -> list[int]:  # the tensors' references and their storages' (views)
        return [n for t in tensors for n in
                (t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata))]  # fmt: skip

    def call(out, inp, group=None, async_op=False, **_):
        tensors = [inp, *(out if isinstance(out, list) else [out])]
        before = holders(tensors)
        collective(out, inp, group=group, async_op=True).wait()
        deadline = time.monotonic() + 30
        while any(n > was for n, was in zip(holders(tensors), before, strict=True)):
            assert time.monotonic() < deadline, "a collective's work still holds its tensors"
            time.sleep(0)
        dp = torch.distributed.get_world_size(group)
        sent.append((dp - 1) * inp.numel() * inp.element_size())
        return Held(tensors) if async_op else None

    return call


def measured(trace: list[dict]) -> tuple[int, int]:
    """(the main thread's peak above its start outside Newton-Schulz, Newton-Schulz's own
    peak above where each call started) from a chrome trace's memory events. A free counts
    where the main thread made the buffer (or before the trace began), on whichever thread it
    happens (a work handle let go there); a buffer a worker made is not counted. Events of
    two threads can carry one time, so at an address made again before its free appears the
    free is taken as done then (an address holds one buffer at a time)."""
    events = sorted((e for e in trace if e.get("name") == "[memory]"),
                    key=lambda e: (e["ts"], e["args"]["Bytes"] > 0))  # fmt: skip
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("name") == "newton-schulz"]
    live: dict[int, tuple[bool, int]] = {}  # address: (made by the main thread, bytes)
    late: dict[int, int] = {}  # frees still to appear of buffers taken as freed
    level = peak = ns_peak = start = 0
    inside = None
    for e in events:
        nbytes, addr = e["args"]["Bytes"], e["args"]["Addr"]
        change = 0
        if nbytes > 0:
            if addr in live:  # its free comes later in the trace, but happened before this
                ours, was = live.pop(addr)
                late[addr] = late.get(addr, 0) + 1
                change -= was if ours else 0
            live[addr] = (e["tid"] == MAIN, nbytes)
            change += nbytes if e["tid"] == MAIN else 0
        elif late.get(addr):
            late[addr] -= 1
        else:
            ours, _ = live.pop(addr, (True, 0))  # made before the trace: the main thread's
            change += nbytes if ours else 0
        where = next((r for r in ranges if r[0] <= e["ts"] <= r[1]), None)
        if where != inside:
            inside, start = where, level
        level += change
        if where:
            ns_peak = max(ns_peak, level - start)
        else:
            peak = max(peak, level)
    return peak, ns_peak


def zero3(eng, record: dict, out: Path, rank: int) -> None:
    import deepspeed.comm as dscomm
    from deepspeed.runtime.zero.muon import original_muon

    opt = eng.optimizer
    plain, update = type(opt)._apply_muon_to_accumulated_grads, original_muon.muon_update
    collectives = dscomm.all_gather, dscomm.all_gather_into_tensor
    sent: list[int] = []

    def in_range(*args, **kwargs):
        with record_function("newton-schulz"):
            return update(*args, **kwargs)

    def apply(self):
        dscomm.all_gather = settled(torch.distributed.all_gather, sent)
        dscomm.all_gather_into_tensor = settled(torch.distributed.all_gather_into_tensor, sent)
        gc.collect()  # nothing freed by a collection at a moment of its own
        gc.disable()
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                plain(self)
        finally:
            gc.enable()
            dscomm.all_gather, dscomm.all_gather_into_tensor = collectives
        path = out / f"trace{rank}.json"
        prof.export_chrome_trace(str(path))
        peak, ns = measured(json.loads(path.read_text())["traceEvents"])
        path.unlink()
        record["peaks"].append(peak)
        record["newton_schulz"] = max(record.get("newton_schulz", 0), ns)
        record["traffic"].append(sum(sent))
        sent.clear()

    record.update(peaks=[], traffic=[])
    type(opt)._apply_muon_to_accumulated_grads = apply
    original_muon.muon_update = in_range
    try:
        yield
    finally:
        type(opt)._apply_muon_to_accumulated_grads = plain
        original_muon.muon_update = update
    muon = [i for i, used in enumerate(opt.sub_groups_using_muon) if used]
    record["groups"] = [[list(p.ds_shape) for p in opt.fp16_groups[i]] for i in muon]
    record["bucket"] = opt.reduce_bucket_size
    record["cache"] = sum(entry[2] for entry in opt._muon_allgather_buffers.values())
    state = [opt.optimizer.state[opt.fp32_partitioned_groups_flat[i]] for i in muon]
    record["momentum"] = sum(s["momentum_buffer"].nbytes for s in state)


def zero12(eng, record: dict) -> None:
    yield
    opt = eng.optimizer
    inner = opt.optimizer
    flats = [g["params"][0] for g in inner.param_groups if g.get("use_muon")]
    record["momentum"] = sum(inner.state[f]["momentum_buffer"].nbytes for f in flats)
    staged = getattr(opt, "_muon_pending_momentum", {})
    record["staged"] = sum(s.nbytes for s, _ in staged.values())
    record["kept"] = kept_bytes(eng)
    record["optimizer"] = type(opt).__name__
    held = getattr(opt, "bit16_groups", None) or opt.bf16_groups  # BF16_Optimizer's
    record["groups"] = [[list(p.shape) for p in held[i]]
                        for i, g in enumerate(inner.param_groups) if g.get("use_muon")]  # fmt: skip


env = distributed.resolve()
distributed.export(env)
dev = device.setup(env, timeout_minutes=5)
out, records = Path(sys.argv[1]), {}
plain_config = engine.deepspeed_config
for setting in sys.argv[2].split(","):
    size, zero, precision, *rest = setting.split(":")
    options = dict(option.partition("=")[::2] for option in rest)
    m = SIZES[size]
    muon = {"lr": float(options["lr"])} if "lr" in options else {}
    t = TrainConfig(train_iters=STEPS, global_batch_size=MICRO * env.world_size,
                    micro_batch_size=MICRO, seq_length=SEQ, zero_stage=int(zero),
                    precision=precision, optimizer="muon", clip_grad=0.0, muon=muon)  # fmt: skip

    def config(*args, options=options, **kwargs):
        cfg = plain_config(*args, **kwargs)
        zero_cfg = cfg["zero_optimization"]
        if "deepspeed" in options:
            zero_cfg.pop("reduce_bucket_size", None)
        if "bucket" in options:
            zero_cfg["reduce_bucket_size"] = int(options["bucket"])
        if "subgroup" in options:
            zero_cfg["sub_group_size"] = int(options["subgroup"])
        return cfg

    engine.deepspeed_config = config
    model = engine.build_model(m, t, env.world_size, dev.device)
    eng = engine.build_engine(model, engine.optimizer_groups(model, m, t), t, env.world_size)
    engine.deepspeed_config = plain_config
    if "cache" in options:
        eng.optimizer._muon_allgather_max_cached_bytes = int(options["cache"])
    record = records[setting] = {}
    probe = zero3(eng, record, out, env.rank) if t.zero_stage == 3 else zero12(eng, record)
    next(probe)
    generator = torch.Generator().manual_seed(0)  # the same batch on every rank
    x, y = (torch.randint(0, m.vocab_size, (MICRO, SEQ), generator=generator) for _ in "xy")
    for _ in range(STEPS):
        eng.backward(eng(x, y))
        eng.step()
    next(probe, None)
    eng.destroy()
(out / f"rank{env.rank}.json").write_text(json.dumps(records))
dev.shutdown()
device.leave(0)  # without the interpreter's teardown (gptflow.train.device.leave)
