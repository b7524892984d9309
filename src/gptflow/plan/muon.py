"""What DeepSpeed 0.19.8's Muon holds and moves on a rank, by ZeRO stage, as gptflow runs it
(gptflow.train.deepspeed_patches): its momentum (held twice at ZeRO 1/2), and at ZeRO 3 the
buffers its update gathers and the bytes those gathers move. :func:`muon_memory` is what :mod:`gptflow.plan.gpu_memory` adds to a rank's memory;
:func:`check_traffic` is the preflight's refusal where the update's traffic would dominate a
step.

Formulas only (planning imports neither torch nor DeepSpeed). ZeRO 3's update is replayed
allocation by allocation as DeepSpeed's code makes and frees them (:func:`zero3_update`),
which tests/unit/plan/test_muon_memory.py holds to what DeepSpeed's update allocates on 1, 2 and 3
gloo ranks for two model sizes, as it holds ZeRO 1/2's momentum (:func:`zero12_momentum`). What
NCCL allocates on GPUs is from PyTorch's source, not measured (no GPU here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptflow.config.settings import (
    ModelConfig,
    TrainConfig,
    muon_layer_shapes,
    muon_lr,
    muon_reduce_bucket_size,
)
from gptflow.errors import GptflowError

Shape = tuple[int, int]
GB = 10**9

# DeepSpeed 0.19.8 runtime/zero/stage3.py l. 243 (_muon_allgather_max_cached_bytes): the
# gathers' send and receive buffers are kept between calls while all of them fit in this
DEEPSPEED_GATHER_CACHE = 256 * 1024**2
DEEPSPEED_SUB_GROUP_SIZE = 10**9  # runtime/zero/config.py l. 182: zero_optimization.sub_group_size
# The share of the step's own ZeRO-3 traffic the Muon update may move before the preflight
# refuses it (check_traffic): 1, the update moving as many bytes as the rest of the step
TRAFFIC_SHARE = 1.0


def muon_groups(m: ModelConfig, t: TrainConfig) -> list[list[Shape]]:
    """Muon's matrices on a rank as DeepSpeed's ZeRO optimizer holds them: one parameter group
    per peak learning rate, in increasing lr, as :func:`gptflow.train.engine.optimizer_groups`
    makes them (:func:`gptflow.config.settings.muon_lr`: train.muon.lr, or train.lr x
    muon_lr_scale, whose rounding can set apart matrices of equal scale), each in the model's order (layer by layer,
    :data:`gptflow.config.settings.MUON_LAYER` within a layer), then sorted by DeepSpeed's
    ``MuonWithAuxAdam`` (original_muon.py l. 380): by shape, largest first (rows, then
    columns). Under ZeRO 3 the parameters it sorts are already partitioned (empty, all of one
    shape), so the model's order stays. A pipeline stage's layers only, each matrix as its
    tensor-parallel rank holds it; tests/unit/plan/test_muon_memory.py holds this to the groups
    DeepSpeed holds."""
    shapes = muon_layer_shapes(m, t.tensor_parallel)
    by_lr: dict[float, list[Shape]] = {}
    for _ in range(-(-m.num_layers // t.pipeline_parallel)):
        for rows, cols in shapes.values():
            by_lr.setdefault(muon_lr(t, rows, cols), []).append((rows, cols))
    groups = [group for _, group in sorted(by_lr.items())]
    if t.zero_stage == 3:
        return groups
    return [sorted(group, reverse=True) for group in groups]  # stable, as Python's sorted


def muon_widths(zero: int, precision: str) -> tuple[int, int]:
    """(bytes of a gradient element, of a momentum element) where Muon combines them, as
    gptflow runs DeepSpeed 0.19.8: ZeRO 3 gathers the gradients in its communication dtype
    (bf16 under bf16); the momentum is fp32 at every stage
    (:func:`gptflow.train.deepspeed_patches.muon_momentum_in_fp32`: DeepSpeed alone kept it in
    the gradients' dtype at bf16 ZeRO 2 and in the communication dtype at ZeRO 3, each 2
    bytes), also where ZeRO 3 gathers it and returns the update."""
    return (2 if precision in ("bf16", "fp16") else 4), 4


class _Ledger:
    """Bytes alive as the replayed Python code holds them: a buffer lives while a name (a
    variable, a list, a collective's work handle, DeepSpeed's cache) holds it."""

    def __init__(self) -> None:
        self.size: list[int] = []
        self.refs: list[int] = []
        self.names: dict[str, set[int]] = {}
        self.live = self.peak = 0

    def new(self, nbytes: int) -> int:
        """A buffer made now (a name must hold it)."""
        self.size.append(nbytes)
        self.refs.append(0)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return len(self.size) - 1

    def transient(self, nbytes: int) -> None:
        """A buffer made and freed inside one call."""
        self.peak = max(self.peak, self.live + nbytes)

    def hold(self, name: str, *bufs: int | None) -> None:
        """Bind `name` to `bufs` (None: memory the update did not make); what it held and
        nothing else holds is freed."""
        held = {b for b in bufs if b is not None}
        for b in held:
            self.refs[b] += 1
        for b in self.names.pop(name, ()):
            self.refs[b] -= 1
            if not self.refs[b]:
                self.live -= self.size[b]
        self.names[name] = held

    def drop(self, *names: str) -> None:
        for name in names:
            self.hold(name)


@dataclass(frozen=True)
class Zero3Update:
    """One rank's Muon at ZeRO 3 over a run's first steps (:func:`zero3_update`)."""

    momentum: int  # bytes of the rank's momentum partitions (kept; made with the engine)
    cache: int  # bytes DeepSpeed keeps in its gather cache after a step
    peaks: tuple[int, ...]  # per step: the update's peak above what was allocated before it
    traffic: int  # bytes the rank receives (and as many it sends) in the update, a step

    @property
    def transient(self) -> int:
        """The update's peak over what stays between steps (the cache): the larger of a
        later step's and the first step's (which fills the cache)."""
        return max(self.peaks[-1], self.peaks[0] - self.cache)


def sub_groups(groups: list[list[Shape]], dp: int, sub_group_size: int) -> list[list[Shape]]:
    """stage3.py l. 1210 ``_create_fp16_sub_groups``: each parameter group cut where its
    partitions reach `sub_group_size` elements."""
    subs: list[list[Shape]] = []
    for group in groups:
        if sub_group_size >= sum(math.ceil(r * c / dp) for r, c in group):
            subs.append(group)
            continue
        part: list[Shape] = []
        filled = 0
        for j, (r, c) in enumerate(group):
            part.append((r, c))
            filled += math.ceil(r * c / dp)
            if filled >= sub_group_size or j == len(group) - 1:
                subs.append(part)
                part, filled = [], 0
    return subs


def zero3_update(
    groups: list[list[Shape]],
    dp: int,
    precision: str,
    bucket: int,
    rank: int = 0,
    collective: str = "nccl",
    steps: int = 2,
    sub_group_size: int = DEEPSPEED_SUB_GROUP_SIZE,
    cache_limit: int = DEEPSPEED_GATHER_CACHE,
) -> Zero3Update:
    """DeepSpeed 0.19.8's ZeRO-3 Muon update on data-parallel rank `rank` of `dp`, replayed:
    what it allocates and when it lets go, in ``runtime/zero/stage3.py``'s
    ``_apply_muon_to_accumulated_grads`` (l. 1821), ``_partitioned_buffers_all_gather``
    (l. 2060) and ``_muon_update_sub_group`` (l. 1697), for Muon's parameter groups `groups`
    (:func:`muon_groups`) and `bucket` = zero_optimization.reduce_bucket_size (elements).
    Newton-Schulz's own working set is not in it (gptflow.plan.gpu_memory counts it apart);
    the update it returns is.

    Widths (:func:`muon_widths`): gradients gathered in the communication dtype, momenta in
    theirs; the gradient partitions are fp32 (gptflow sums gradients in fp32). Each parameter
    group is cut into sub-groups (:func:`sub_groups`), a sub-group into chunks of whole
    matrices of at most `bucket` elements (at least one, l. 1845). Per chunk, L = the sum of
    its matrices' partitions (ceil(numel / dp) each):

    - the gradients' gather: a send buffer L and a receive buffer dp x L -- kept in
      DeepSpeed's cache (keyed by L and dtype, oldest evicted first) while all it keeps fits
      256 MiB, else made each call -- and the result, dp x L, which lives until the next
      chunk's result is copied back (the loop variable ``update`` of l. 1858 holds a view of
      it); at dp 1 a copy where the dtype changes, else views;
    - the momenta: a clone of each partition (L), gathered alike;
    - rounds of dp matrices, one per rank: the rank's update (its matrix); a round whose
      matrices differ in shape, or that has fewer than dp, makes a zero-padded send buffer of
      its largest matrix for the gradient and one for the momentum, and dp receive buffers of
      it for each: (2 dp + 2) x the largest matrix. Each collective's work handle holds its
      buffers until the next round's handle replaces it, and the copy loop's variables one
      received buffer each until the next round's copy, so a round's buffers live into the
      next round's;
    - the momentum written back: a zero-padded fp32 buffer of the partition where the rank's
      slice runs past the matrix.

    The collectives' own buffers, by `collective`: ``nccl`` (what the preflight plans) makes a
    flat receive buffer of dp x the round's size for each of a round's two ``all_gather``s
    (PyTorch's ProcessGroupNCCL::allgather flattens a list of outputs), held by the work
    handle; ``all_gather_into_tensor`` none. ``gloo`` (measured on the CPU) makes one of the
    output's size on the calling thread inside the call; the gloo worker threads' own buffers
    are not counted (gloo's, as NCCL's internal ones are). Any other value: DeepSpeed's own
    buffers alone.

    Traffic: every collective is an all-gather, in which a rank receives (and sends) dp - 1
    times its input: L of gradients and L of momenta a chunk, and per round dp - 1 times the
    round's size (its largest matrix where padded) of each."""
    replay = _Zero3Replay(dp, rank, muon_widths(3, precision), collective, cache_limit)
    subs = sub_groups(groups, dp, sub_group_size)
    peaks = tuple(replay.step(subs, bucket) for _ in range(steps))
    momentum = sum(math.ceil(r * c / dp) for sub in subs for r, c in sub) * replay.wm
    return Zero3Update(momentum, sum(replay.cache.values()), peaks, replay.traffic // steps)


class _Zero3Replay:
    """A rank's ZeRO-3 Muon update, replayed (:func:`zero3_update`): what is alive, DeepSpeed's
    gather cache and the bytes sent, carried from chunk to chunk and step to step."""

    def __init__(
        self, dp: int, rank: int, widths: tuple[int, int], collective: str, cache_limit: int
    ) -> None:
        self.dp, self.rank, self.collective, self.cache_limit = dp, rank, collective, cache_limit
        self.wg, self.wm = widths
        self.acc = 4  # the fp32 gradient partitions
        self.ledger = _Ledger()
        self.cache: dict[tuple[int, int], int] = {}  # send + receive bytes by (L, width)
        self.traffic = 0

    def step(self, subs: list[list[Shape]], bucket: int) -> int:
        """One step's update (l. 1821); its peak above where it started."""
        ledger = self.ledger
        start = ledger.peak = ledger.live
        for sub in subs:
            begin = 0
            while begin < len(sub):  # l. 1845: whole matrices, up to `bucket` elements
                end, numel = begin, 0
                while end < len(sub) and (end == begin or numel + math.prod(sub[end]) <= bucket):
                    numel += math.prod(sub[end])
                    end += 1
                self.chunk(sub[begin:end])
                begin = end
        ledger.drop("full_grads", "group_items", "update (l. 1858)")
        return ledger.peak - start

    def gather(self, ns: list[int], parts: list[int], width: int, src: int) -> list[int | None]:
        """_partitioned_buffers_all_gather (l. 2060): each matrix gathered, as its buffer."""
        ledger, p = self.ledger, self.dp
        if p == 1:  # views, or copies into the gather's dtype
            return [None if src == width else ledger.new(n * width) for n in ns]
        size = sum(parts)
        key, nbytes = (size, width), (p + 1) * size * width
        if key in self.cache:
            self.cache[key] = self.cache.pop(key)  # the most recently used
        else:
            ledger.hold("gather buffers", ledger.new(p * size * width), ledger.new(size * width))
            if nbytes <= self.cache_limit:
                while self.cache and sum(self.cache.values()) + nbytes > self.cache_limit:
                    oldest = next(iter(self.cache))  # popitem(last=False)
                    self.cache.pop(oldest)
                    ledger.drop(f"cache {oldest}")
                self.cache[key] = nbytes
                ledger.hold(f"cache {key}", *ledger.names["gather buffers"])
        out = ledger.new(p * size * width)  # the rearranged result
        if self.collective == "gloo":
            ledger.transient(p * size * width)
        ledger.drop("gather buffers")
        self.traffic += (p - 1) * size * width
        return [out] * len(ns)

    def round_gather(self, name: str, send: int | None, recv: list, nbytes: int) -> None:
        """dist.all_gather(recv, send, async_op=True), its handle bound to `name`."""
        flat = self.ledger.new(self.dp * nbytes) if self.collective == "nccl" else None
        if self.collective == "gloo":
            self.ledger.transient(self.dp * nbytes)
        self.ledger.hold(name, send, *recv, flat)
        self.traffic += (self.dp - 1) * nbytes

    def chunk(self, chunk: list[Shape]) -> None:
        """One chunk's gathers (l. 1851), ``_muon_update_sub_group`` (l. 1697) on it, and its
        result copied back into the partitions (l. 1855)."""
        ledger, p, rank, wg, wm = self.ledger, self.dp, self.rank, self.wg, self.wm
        ns = [r * c for r, c in chunk]
        parts = [math.ceil(n / p) for n in ns]
        grads = self.gather(ns, parts, wg, self.acc)
        ledger.hold("full_grads", *grads)
        ledger.hold("group_items", *grads)
        clones = [ledger.new(n * wm) for n in parts]  # the momenta, cloned and gathered
        ledger.hold("momentum_buffer", *clones)
        moms = [m if m is not None else c
                for m, c in zip(self.gather(ns, parts, wm, wm), clones, strict=True)]  # fmt: skip
        ledger.hold("gathered_params_momentums", *moms)
        for base in range(0, len(chunk), p):  # the rounds (l. 1741)
            count = len(chunk[base : base + p])
            rg, rm = grads[base : base + p], moms[base : base + p]
            if rank < count:
                ledger.hold("update", ledger.new(ns[base + rank] * wm))
            uniform = count == p and len(set(chunk[base : base + p])) == 1
            if uniform:  # views of the gathered matrices
                size = ns[base]
                sends, outs = (rg[rank], rm[rank]), (rg, rm)
            else:  # zero-padded: a send buffer and dp receive buffers each (the one of index
                # count - 1, which a copy loop's variable keeps, apart); the previous round's
                # are held by its handles, so nothing is freed here
                size = max(ns[base : base + p])
                sends = (ledger.new(size * wg), ledger.new(size * wm))
                outs = ([ledger.new((p - 1) * size * wg), ledger.new(size * wg)],
                        [ledger.new((p - 1) * size * wm), ledger.new(size * wm)])  # fmt: skip
            ledger.hold("local_grad", sends[0])
            ledger.hold("local_momentum", sends[1])
            ledger.hold("grad_out", *outs[0])
            ledger.hold("momentum_out", *outs[1])
            self.round_gather("grad_handle", sends[0], outs[0], size * wg)
            self.round_gather("momentum_handle", sends[1], outs[1], size * wm)
            if not uniform:  # copied back from the padded buffers (l. 1780)
                ledger.hold("gathered_grad", outs[0][1])
                ledger.hold("gathered_momentum", outs[1][1])
        for j, n in enumerate(ns):  # the momentum written back (l. 1791)
            ledger.hold("gathered_momentum", moms[j])
            if rank * parts[j] + parts[j] > n:
                ledger.hold("buffer_to_update", ledger.new(parts[j] * self.acc))
            else:
                ledger.hold("buffer_to_update", moms[j])
        ledger.drop("momentum_buffer", "gathered_params_momentums", "update", "local_grad",
                    "local_momentum", "grad_out", "momentum_out", "grad_handle",
                    "momentum_handle", "gathered_grad", "gathered_momentum",
                    "buffer_to_update")  # fmt: skip
        ledger.hold("update (l. 1858)", grads[-1])  # the copy-back loop's variable


def zero12_momentum(groups: list[list[Shape]], dp: int, rank: int) -> int:
    """Elements of one copy of Muon's momentum on data-parallel rank `rank` of `dp` under
    DeepSpeed 0.19.8's DeepSpeedZeroOptimizer (ZeRO 1/2): each Muon parameter group is
    flattened in order, padded to a multiple of 2 dp (stage_1_and_2.py l. 441) and cut into dp
    equal partitions; the rank's buffer holds every matrix its partition touches, whole
    (``get_partition_info`` l. 2579, ``_muon_momentum_buffer`` l. 2805: Muon orthogonalizes
    whole matrices, so one straddling two partitions is held, and updated, by both). It is
    held twice: the committed momentum (optimizer state, in checkpoints) and the staged copy a
    step writes before the overflow check lets it be committed (``_muon_staging_momentum`` l.
    2989, kept between steps)."""
    held = 0
    for group in groups:
        numels = [r * c for r, c in group]
        size = -(-sum(numels) // (2 * dp)) * 2  # a partition
        start, end, at = rank * size, (rank + 1) * size, 0
        for n in numels:
            if start <= at < end or at < start < at + n:
                held += n
            at += n
    return held


def bf16_optimizer_momentum(groups: list[list[Shape]], dp: int) -> int:
    """Elements of Muon's momentum under DeepSpeed's BF16_Optimizer (bf16 at ZeRO 1): one fp32
    buffer the shape of the rank's partition of each Muon group (bf16_optimizer.py l. 452),
    the group padded to a multiple of 2 dp."""
    return sum(-(-sum(r * c for r, c in g) // (2 * dp)) * 2 for g in groups)


def muon_memory(
    m: ModelConfig, t: TrainConfig, dp: int, precision: str, collective: str = "nccl"
) -> dict[str, int]:
    """Bytes DeepSpeed 0.19.8's Muon holds on the most loaded rank of the most loaded pipeline
    stage, by what holds them ({} for AdamW); the one count the preflight's memory fit uses:

    - ZeRO 0: the momentum, one moment a matrix element (fp32, unpartitioned);
    - bf16 at ZeRO 1 (BF16_Optimizer): the momentum, fp32, the partition's shape;
    - ZeRO 1/2 otherwise: the momentum of every matrix the partition touches, whole, and its
      staged copy (:func:`zero12_momentum`);
    - ZeRO 3 (:func:`zero3_update`, the worst rank): the momentum partitions, the gather cache
      kept between steps, and the update's peak above them (transient) with `bucket` =
      :func:`gptflow.config.settings.muon_reduce_bucket_size`."""
    if t.optimizer != "muon":
        return {}
    groups = muon_groups(m, t)
    _, wm = muon_widths(t.zero_stage, precision)
    if t.zero_stage == 0:
        return {"Muon momentum": wm * sum(r * c for g in groups for r, c in g)}
    if t.zero_stage == 1 and precision == "bf16":
        return {"Muon momentum": 4 * bf16_optimizer_momentum(groups, dp)}
    if t.zero_stage in (1, 2):
        held = max(zero12_momentum(groups, dp, r) for r in range(dp))
        return {"Muon momentum": wm * held, "Muon staged momentum": wm * held}
    worst = max((zero3_update(groups, dp, precision, zero3_bucket(m, t, dp), r, collective)
                 for r in zero3_ranks(groups, dp)),
                key=lambda u: u.momentum + u.cache + u.transient)  # fmt: skip
    return {"Muon momentum": worst.momentum, "Muon gather cache": worst.cache,
            "Muon update": worst.transient}  # fmt: skip


def zero3_bucket(m: ModelConfig, t: TrainConfig, dp: int) -> int:
    """The reduce_bucket_size gptflow's engine gives DeepSpeed for a ZeRO-3 Muon run."""
    largest = max(r * c for r, c in muon_layer_shapes(m, t.tensor_parallel).values())
    bucket = muon_reduce_bucket_size(t, dp, largest)
    assert bucket is not None, "a ZeRO-3 Muon run"
    return bucket


def zero3_ranks(groups: list[list[Shape]], dp: int) -> list[int]:
    """The ranks whose updates differ: a rank computes a round's matrix only where the round
    has more matrices than its index (at most a chunk's, at most all of them), and only the
    last ranks write back a padded partition (the last rank always where any does)."""
    most = min(dp, sum(len(g) for g in groups))
    return sorted({*range(most), dp - 1})


def zero3_step_traffic(m: ModelConfig, t: TrainConfig, dp: int, gas: int, precision: str) -> int:
    """Bytes a rank receives in a ZeRO-3 step besides the Muon update, on paper: per
    micro-batch, every parameter gathered for the forward and again for the backward
    ((dp - 1)/dp of it each, in the parameters' dtype), and the gradients all-reduced
    (2 (dp - 1)/dp of them in the communication dtype: a ring all-reduce; with Muon DeepSpeed
    all-reduces instead of reduce-scattering, stage3.py l. 360). DeepSpeed keeps parameters
    under 1e5 elements and those reused within 1e9 elements gathered, so the backward's
    gathers are somewhat fewer."""
    width = 2 if precision in ("bf16", "fp16") else 4
    return gas * (dp - 1) * m.num_parameters() * (2 * width + 2 * width) // dp


def check_traffic(m: ModelConfig, t: TrainConfig, ranks: int, precision: str) -> str | None:
    """Refuse, in one line, a ZeRO-3 Muon run whose update moves more than TRAFFIC_SHARE of the
    rest of its step's traffic (:func:`zero3_step_traffic`): the update runs between the
    backward and the optimizer step, overlapped with no compute, while ZeRO 3 hides its own
    gathers behind the layers' compute, so past that share the update's collectives alone
    take as long as the step's; its rounds send every rank dp x their largest matrix (padded
    where a round is short of dp matrices or mixes shapes). Returns the plan's line where it
    passes (None for other runs)."""
    if t.optimizer != "muon" or t.zero_stage != 3:
        return None
    dp, gas = t.data_parallel_size(ranks), t.grad_accum_steps(ranks)
    groups = muon_groups(m, t)
    muon = zero3_update(groups, dp, precision, zero3_bucket(m, t, dp), steps=1).traffic
    step = zero3_step_traffic(m, t, dp, gas, precision)
    if muon > TRAFFIC_SHARE * step:
        raise GptflowError(
            f"train.optimizer muon at train.zero_stage 3 on {dp} data-parallel ranks: "
            f"DeepSpeed's Muon update would move {muon / GB:.3g} GB per rank a step, more than "
            f"the rest of the step ({step / GB:.3g} GB: {gas} micro-batch(es), each gathering "
            f"the parameters twice and all-reducing the gradients), with no compute to hide "
            f"behind -- its rounds send every rank {dp} x their largest matrix, padded where "
            f"a round mixes shapes or is short of {dp} matrices; use train.zero_stage 1 or 2 "
            f"(Muon there gathers only matrices straddling a partition), fewer data-parallel "
            f"ranks, or a larger train.global_batch_size (more micro-batches a step)"
        )
    return (
        f"  Muon at ZeRO 3: its update moves {muon / GB:.3g} GB per rank a step "
        f"({muon / step:.0%} of the step's other {step / GB:.3g} GB; refused above "
        f"{TRAFFIC_SHARE:.0%})"
    )
