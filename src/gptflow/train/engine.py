"""Our train config -> a DeepSpeed config -> a DeepSpeed engine: where training talks to DeepSpeed.

The DeepSpeed JSON is rendered from :class:`gptflow.config.settings.TrainConfig`, never
hand-written: batch sizes and gradient accumulation are derived and checked, gradient clipping is
explicit (DeepSpeed silently clips at 1.0 when the key is absent), the optimizer is torch AdamW (no
C++ build needed on CPU) and the learning-rate schedule is ours (warmup + cosine/linear), stepped by
DeepSpeed once per optimizer step and saved in its checkpoints.

Over 500 lines: what training asks of DeepSpeed's engine lives here: the config, the model
built and placed, the optimizers, the engine, its gradients and loss scale, the universal
checkpoint. How the model is split over ranks (tensor and pipeline parallel, the dropout RNG of
split regions) is :mod:`gptflow.train.model_parallel`; what gptflow changes in DeepSpeed's own
code is :mod:`gptflow.train.deepspeed_patches`, applied in :func:`init_distributed`; export
reads DeepSpeed's checkpoints in gptflow.results.export.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re

import torch

from gptflow.config.settings import (
    MUON_LAYER,
    TrainConfig,
    muon_layer_shapes,
    muon_lr,
    muon_reduce_bucket_size,
)
from gptflow.errors import GptflowError
from gptflow.train import deepspeed_patches
from gptflow.train.model_parallel import (
    TENSOR_PARALLEL_PLAN,
    model_name,
    pipeline_model,
    split_tensor_parallel,
    tensor_parallel_rank,
    tensor_parallel_slice,
)


def deepspeed_config(
    train: TrainConfig, world_size: int, load_universal: bool = False, muon_largest: int = 0
) -> dict:
    """The DeepSpeed config for `train` on `world_size` ranks (data x tensor parallel); `load_universal`:
    the engine will resume from a universal checkpoint (another layout's, converted);
    `muon_largest`: elements of the largest matrix Muon steps (its ZeRO-3 bucket)."""
    train.check_trainable()
    if train.precision == "auto":
        raise GptflowError(
            f"train.precision {train.precision!r} is decided on the training device "
            f"(gptflow.train.main.on_device) before an engine is configured"
        )
    gas = train.grad_accum_steps(world_size)
    cfg: dict = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": train.clip_grad,
        "zero_optimization": {"stage": train.zero_stage},
        "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer under ZeRO
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "wall_clock_breakdown": False,
        "checkpoint": {"tag_validation": "FAIL", "load_universal": load_universal},
    }
    if train.optimizer == "muon" and train.zero_stage == 3:
        # DeepSpeed's ZeRO-3 Muon needs the whole gradients it orthogonalizes (it refuses
        # reduce-scatter: "Muon and reduce scatter cannot be used together")
        cfg["zero_optimization"]["reduce_scatter"] = False
        dp = train.data_parallel_size(world_size)
        if bucket := muon_reduce_bucket_size(train, dp, muon_largest):  # bounds its gathers
            cfg["zero_optimization"]["reduce_bucket_size"] = bucket
    if train.tensor_parallel == 1 or train.pipeline_parallel > 1:
        # checked by DeepSpeed against micro x accumulation x data-parallel ranks; under
        # AutoTP's own groups it counts the ranks of a tensor-parallel group as data-parallel
        # ones at some ZeRO stages and not at others, so it is left for DeepSpeed to derive
        # (a pipeline's grid counts them right)
        cfg["train_batch_size"] = train.global_batch_size
    if train.tensor_parallel > 1 and train.pipeline_parallel == 1:
        cfg["tensor_parallel"] = {
            "autotp_size": train.tensor_parallel,
            "partition_config": {"use_default_specs": False, "layer_specs": TENSOR_PARALLEL_PLAN},
        }
    if train.offload != "none":
        zero = cfg["zero_optimization"]
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if train.offload == "optimizer_and_params":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        # torch AdamW on the offloaded states (DeepSpeedCPUAdam is faster but needs a C++ build)
        cfg["zero_force_ds_cpu_optimizer"] = False
    if grad_accum_dtype(train) is not None:
        # gradients summed over micro-batches in fp32, as Megatron does (half-precision sums
        # lose low bits with every micro-batch); bf16 under ZeRO 1 selects DeepSpeed's
        # BF16_Optimizer, the other ZeRO cases their separate fp32 accumulation buffers
        cfg["data_types"] = {"grad_accum_dtype": grad_accum_dtype(train)}
    if train.precision == "bf16":
        # check_grad_overflow (DeepSpeed's default, pinned): the ZeRO optimizer skips a step
        # with a NaN/inf gradient whole, before SkippingAdamW sees any group of it
        cfg["bf16"] = {"enabled": True, "check_grad_overflow": True}
    elif train.precision == "fp16":
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return cfg


def grad_accum_dtype(train: TrainConfig) -> str | None:
    """What DeepSpeed sums the micro-batches' gradients in: fp32 for bf16 and fp16 under
    ZeRO (stages 1-3); None (the model's dtype) otherwise: fp32 runs, and a half precision
    at ZeRO 0, which :meth:`TrainConfig.check_trainable` refuses to train (DeepSpeed 0.19
    refuses fp32 sums there: "unsupported mix of model_dtype=torch.float16 and
    grad_accum_dtype=torch.float32"), read only from an existing run's config."""
    half = train.precision in ("bf16", "fp16")
    return "fp32" if half and train.zero_stage > 0 else None


class SkippingAdamW(torch.optim.AdamW):
    """torch AdamW whose update is skipped, whole, when any gradient of the step is NaN or
    infinite on any rank: one verdict per optimizer step, for every parameter group.

    Who decides depends on what DeepSpeed wraps it in (``deepspeed.initialize`` chooses; see
    :func:`build_engine`):

    - ZeRO 1-3, and fp16/bf16 at any stage: DeepSpeed's own optimizer (``DeepSpeedZeroOptimizer``,
      ``..._Stage3``, ``BF16_Optimizer``, the fp16 ones) checks the norm of all of the step's
      gradients, reduced over the data- and model-parallel ranks, before it calls this one
      (once per parameter group at ZeRO 1/2, per sub-group at ZeRO 3); on a NaN/inf it skips
      the whole step, counts it in ``engine.skipped_steps`` and holds the learning-rate
      schedule. This optimizer then only updates: no check, no collective, no host read
      (checking here, per group, made an all-reduce and a host read per call, and a group's
      verdict of its own).
    - ZeRO 0 fp32: it is the engine's optimizer, called once per step with every group. It
      decides: one flag on `device` (the loop's, also on a rank holding no gradient) from all
      the groups' gradients, OR-ed over all ranks in one all-reduce (the same collective on
      every rank), and sets ``overflow`` as DeepSpeed's optimizers do, so the engine counts the
      step in ``skipped_steps`` and holds the schedule (Megatron's behaviour). The engine reads
      ``overflow`` as a Python bool after every step, so here the flag is read on the host
      once per step: DeepSpeed's ZeRO optimizers read theirs likewise (``has_overflow``,
      ``is_invalid_grad_norm``).
    """

    overflow = False
    decides = True  # False under a DeepSpeed optimizer that decides (build_engine sets it)

    def __init__(self, params, *, device: torch.device, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.device = device

    def step(self, closure=None):
        if self.decides and skip_verdict(self):
            return None
        return super().step(closure)


def skip_verdict(optimizer) -> bool:
    """Whether `optimizer` (deciding at ZeRO 0 fp32, :class:`SkippingAdamW`) skips this step:
    any gradient of any group NaN or infinite on any rank. One flag on ``optimizer.device``,
    OR-ed over all ranks in one all-reduce, read on the host once; sets ``overflow``."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    bad = torch.zeros((), device=optimizer.device)
    if grads:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        bad.copy_(~torch.isfinite(norm))  # on the device, no host sync
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    optimizer.overflow = bool(bad)  # what DeepSpeed's engine reads, as a bool (see above)
    return optimizer.overflow


# The matrices Muon orthogonalizes (gptflow.config.settings.MUON_LAYER), by their
# GPTNeoX names: the hidden 2-D weights of every layer; never the embedding, embed_out, the
# LayerNorms or a bias.
MUON_PATTERNS = {kind: rf".*\.{re.escape(kind)}\.weight" for kind in MUON_LAYER}


def muon_kind(name: str) -> str | None:
    """Which of :data:`MUON_LAYER` the GPTNeoX parameter `name` is, or None (AdamW's)."""
    return next((k for k, pat in MUON_PATTERNS.items() if re.fullmatch(pat, name)), None)


def optimizer_groups(module: torch.nn.Module, model_cfg, train: TrainConfig) -> list[dict]:
    """The optimizer's parameter groups for `module` (this rank's model, pipeline stage or
    tensor-parallel slices): AdamW's decay and no-decay groups (gptflow.train.model.decay_groups;
    first, so the logged lr is train.lr), and with train.optimizer muon the one decision of
    which parameters Muon steps: those whose GPTNeoX name is a hidden matrix
    (:data:`MUON_PATTERNS`; by name, not by shape: under ZeRO 3 every parameter is a flat
    partition), taken out of AdamW's groups into Muon groups, one per learning rate
    (:func:`gptflow.config.settings.muon_lr`), each parameter tagged ``use_muon`` as DeepSpeed's ZeRO optimizers read
    it."""
    from gptflow.train.model import decay_groups

    groups = decay_groups(module, train.weight_decay)
    if train.optimizer != "muon":
        return groups
    names = {id(p): model_name(n, train.pipeline_parallel, model_cfg.num_layers)
             for n, p in module.named_parameters()}  # fmt: skip
    m, shapes = train.muon, muon_layer_shapes(model_cfg, train.tensor_parallel)
    by_lr: dict[float, list] = {}
    for g in groups:
        for p in g["params"]:
            kind = muon_kind(names[id(p)])
            p.use_muon = kind is not None
            if kind is not None:
                by_lr.setdefault(muon_lr(train, *shapes[kind]), []).append(p)
        g["params"] = [p for p in g["params"] if not p.use_muon]
        g.update(use_muon=False, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                 eps=train.adam_eps)  # fmt: skip
    return [g for g in groups if g["params"]] + [
        {"params": ps, "use_muon": True, "lr": lr, "momentum": m.momentum,
         "weight_decay": muon_weight_decay(train, lr), "ns_method": m.ns_method}
        for lr, ps in sorted(by_lr.items())
    ]  # fmt: skip


def muon_weight_decay(train: TrainConfig, lr: float) -> float:
    """The weight decay of a Muon group stepped at peak `lr`: DeepSpeed decays by the group's
    lr x its weight_decay. Under RMS matching that is Moonlight's train.lr x weight decay (the
    group's lr is train.lr scaled, so its decay is divided by the same scale); with
    train.muon.lr DeepSpeed's own, train.muon.lr x weight decay."""
    decay = train.weight_decay if train.muon.weight_decay is None else train.muon.weight_decay
    return decay if train.muon.lr is not None else decay * train.lr / lr


@functools.cache
def skipping_muon():
    """DeepSpeed's ``MuonWithAuxAdam`` (Muon on the groups tagged ``use_muon``, torch AdamW on
    the others) that skips a step as :class:`SkippingAdamW` does where it decides (ZeRO 0
    fp32). A class made on first use: importing DeepSpeed's Muon compiles its kernels.

    Where it runs Newton-Schulz depends on the wrapper, as DeepSpeed wires it: at ZeRO 0 in
    this ``step`` on the whole gradient (after the engine's clipping; gptflow refuses clipping
    with Muon: :meth:`gptflow.config.settings.TrainConfig.check_muon`); at ZeRO 1/2 (and
    BF16_Optimizer) while the gradient partitions are filled, gathering each matrix's slices,
    so the partition holds the update and ``step`` only applies lr and decay; at ZeRO 3 per
    sub-group on the gathered gradients. Its momentum is optimizer state: in DeepSpeed's
    checkpoints with Adam's moments, kept in fp32 at every stage
    (:func:`gptflow.train.deepspeed_patches.muon_momentum_in_fp32`), which, with the fix of
    ZeRO 1/2's bucket merge, a Muon run requires."""
    deepspeed_patches.require("train.optimizer muon")
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    class SkippingMuon(MuonWithAuxAdam):
        overflow = False
        decides = True  # as SkippingAdamW's (build_engine sets it)

        def __init__(self, param_groups, *, device: torch.device, fused) -> None:
            super().__init__(param_groups, torch.optim.AdamW, {"fused": fused})
            self.device = device

        def step(self, closure=None, step_id=None):
            if self.decides and skip_verdict(self):
                return None
            return super().step(closure, step_id)

    return SkippingMuon


def build_model(model_cfg, train: TrainConfig, world_size: int, device: torch.device, init=None):
    """The GPT-NeoX as this rank holds it, each parameter set from ``init(name, shape)`` (a
    :data:`gptflow.train.model.Initializer`: the whole parameter, fp32 on the CPU), by default the
    random initialisation seeded ``train.seed`` (:func:`gptflow.train.model.random_init`: every
    layout starts from the same weights); a Hugging Face checkpoint's weights with
    ``model.init_from`` (:class:`gptflow.train.init_from.HFWeights`).

    No rank ever builds the whole fp32 model (an 18B model is ~75 GB per rank, ~600 GB on an
    8-GPU node). Under ZeRO-3 it is born partitioned (``deepspeed.zero.Init``), each module
    then initialised gathered, by rank 0, and broadcast. Otherwise it is built on the meta
    device (no memory), cut there into this rank's pipeline stage and tensor-parallel slices,
    and only those are allocated on `device` and initialised, one parameter at a time (each
    rank asks `init` for the parameters it holds, and keeps its slice).
    """
    from gptflow.train.model import GPTNeoX, random_init, reset_buffers

    init = init or random_init(model_cfg, train.seed)
    if train.zero_stage == 3:
        return zero3_model(model_cfg, train, world_size, init)
    with torch.device("meta"):
        whole = GPTNeoX(model_cfg)
    shapes = {name: tuple(p.shape) for name, p in whole.named_parameters()}
    module = whole
    if train.pipeline_parallel > 1:
        module = pipeline_model(whole, train.pipeline_parallel, train.tensor_parallel, world_size)
    if train.tensor_parallel > 1:
        if train.pipeline_parallel == 1:  # the groups deepspeed.initialize would make itself
            from deepspeed.utils import groups

            groups._init_tp_mesh_device(tensor_model_parallel_size=train.tensor_parallel)
            split_tensor_parallel(module, groups.get_tensor_model_parallel_group())
        else:
            split_tensor_parallel(module, module.mpu().get_slice_parallel_group())
    materialize(module, device)
    reset_buffers(module)
    tp_rank = tensor_parallel_rank(train.tensor_parallel)
    with torch.no_grad():
        for name, p in module.named_parameters():
            full = model_name(name, train.pipeline_parallel, model_cfg.num_layers)
            value = init(full, shapes[full])
            p.copy_(tensor_parallel_slice(full, value, tp_rank, train.tensor_parallel))
    return module


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Allocate `module`'s meta parameters on `device` (uninitialised), keeping what DeepSpeed
    marked on them: ``to_empty`` makes new Parameter objects, and without AutoTP's marks
    (``tensor_model_parallel``, its universal-checkpoint metadata) the gradient norm would
    count each tensor-parallel slice once instead of on every rank -- wrong clipping."""
    marks = {name: dict(vars(p)) for name, p in module.named_parameters()}
    module.to_empty(device=device)
    for name, p in module.named_parameters():
        vars(p).update(marks[name])


def zero3_model(model_cfg, train: TrainConfig, world_size: int, init):
    """The GPT-NeoX born partitioned over the ranks (``deepspeed.zero.Init``): its parameters
    are empty at construction, so each module is initialised gathered, by rank 0, from
    ``init(name, shape)``; leaving the gather sends every rank its partition."""
    import deepspeed

    from gptflow.train.model import GPTNeoX

    with deepspeed.zero.Init(config_dict_or_path=deepspeed_config(train, world_size)):
        model = GPTNeoX(model_cfg, seed=train.seed)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own:
            with deepspeed.zero.GatheredParameters(own, modifier_rank=0):
                if rank == 0:
                    model.init_module(name, module, init)
    return model


def fused_adamw(param_groups: list[dict]) -> bool | None:
    """torch's fused AdamW kernel when every parameter is on a GPU (one launch for all
    tensors instead of a dozen per tensor); the default implementation elsewhere (the CPU,
    where tests and the bit-exact resume were measured)."""
    params = [p for g in param_groups for p in g["params"]]
    return True if params and all(p.is_cuda for p in params) else None


def build_engine(
    model: torch.nn.Module,
    param_groups: list[dict],
    train: TrainConfig,
    world_size: int,
    load_universal: bool = False,
    device: torch.device | None = None,
):
    """``deepspeed.initialize`` with a torch AdamW and our LR schedule; returns the engine.
    `device`: the loop's (default: the first parameter's), where the optimizer's skip verdict
    is made at ZeRO 0."""
    import deepspeed

    device = device or next(p.device for g in param_groups for p in g["params"])
    if train.optimizer == "muon":
        optimizer = skipping_muon()(param_groups, device=device, fused=fused_adamw(param_groups))
    else:
        optimizer = SkippingAdamW(
            param_groups,
            device=device,
            lr=train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            eps=train.adam_eps,
            fused=fused_adamw(param_groups),
        )
    # LambdaLR multiplies each group's base lr (Muon's groups their own); our schedule is
    # absolute, so divide train.lr back out: every group follows its shape.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: train.lr_at(step) / train.lr
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(train, world_size, load_universal, muon_largest(param_groups)),
    )
    # under a DeepSpeed optimizer, that one decides the skip for the whole step (see above)
    optimizer.decides = engine.optimizer is optimizer
    if train.compile:  # in place: parameter names and checkpoints stay those of the module
        engine.compile()
    if world_size == 1 and train.zero_stage == 0:
        # DeepSpeed would flatten every gradient, all-reduce it over one rank and copy it
        # back (~6 ms a step for the `small` preset); ZeRO stages reduce in their optimizer
        engine.enable_backward_allreduce = False
    return engine


def muon_largest(param_groups: list[dict]) -> int:
    """Elements of the largest matrix Muon steps (whole: ``ds_numel`` under ZeRO 3), 0 without."""
    return max((getattr(p, "ds_numel", p.numel()) for g in param_groups if g.get("use_muon")
                for p in g["params"]), default=0)  # fmt: skip


_GROUP_STARTED = False  # whether this process created a process group (init_distributed)


def group_started() -> bool:
    """Whether this process created a process group (gptflow.train.device.leave reads it)."""
    return _GROUP_STARTED


def init_distributed(backend: str | None = None) -> None:
    """DeepSpeed's process group (gloo on CPU, NCCL on GPU), without its JIT shm op on CPU.
    Every process group of gptflow's is made here (device.setup's too), so a process that
    made one ends through :func:`gptflow.train.device.leave`."""
    global _GROUP_STARTED
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # The shared-memory all-reduce op is only for inference and costs a ~20 s g++ build.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)  # its INFO lines would drown the training log
    deepspeed_patches.import_muon_compiling_on_first_call()
    deepspeed_patches.apply()
    _GROUP_STARTED = True  # set first: a failure half-way may have made the group already
    deepspeed.init_distributed(
        dist_backend=backend or get_accelerator().communication_backend_name(),
        auto_mpi_discovery=False,
        verbose=False,
    )


def global_grad_norm(engine) -> torch.Tensor | float | None:
    """The last step's gradient norm as DeepSpeed keeps it: a device tensor (read with the
    log line's other figures), a float (inf after a skipped step), or None."""
    return engine.get_global_grad_norm()


def full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole gradient of `param` that the optimizer will step on, between the step's last
    backward (gradients reduced over the data-parallel ranks) and ``engine.step()``, in the
    dtype DeepSpeed sums it in (fp32 under bf16/fp16 with ZeRO).

    BF16_Optimizer (bf16, ZeRO 1) sums the micro-batches into an fp32 buffer that every rank
    all-reduces whole; ``param._hp_grad`` is the parameter's view into it, read here without
    the all-reduce per parameter that DeepSpeed's ``safe_get_full_grad`` makes to reassemble
    it from the partitions. Every other optimizer: ``safe_get_full_grad``."""
    hp = getattr(param, "_hp_grad", None)
    if hp is not None:  # a flat slice of the buffer
        return hp.view(param.shape)
    from deepspeed.utils import safe_get_full_grad

    return safe_get_full_grad(param)


def set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace what :func:`full_grad` returns: the gradient the optimizer steps on.

    Not ``safe_set_full_grad`` under BF16_Optimizer: that writes the bf16 ``param.grad``,
    which BF16_Optimizer has already summed into its fp32 buffer and never reads again (its
    step clips and updates the fp32 partitions), so the write would be lost -- and with
    ``immediate_grad_update`` its partition path fails for a parameter that straddles two
    partitions. The fp32 view is written whole on every rank, as it was reduced."""
    hp = getattr(param, "_hp_grad", None)
    if hp is not None:
        hp.copy_(value.reshape(hp.shape))
        return
    from deepspeed.utils import safe_set_full_grad

    safe_set_full_grad(param, value)


def loss_scale_value(engine):
    """The dynamic loss scale (fp16) as DeepSpeed holds it, a float or a device tensor, read
    without a host sync (no truth test, no float()); None without one."""
    scale = getattr(engine.optimizer, "cur_scale", None)
    return scale if scale is not None else getattr(engine.optimizer, "loss_scale", None)


def loss_scale(engine) -> float:
    """The dynamic loss scale (fp16), else 1.0, on the host (for the logged record)."""
    scale = loss_scale_value(engine)
    try:
        return float(scale) if scale is not None else 1.0
    except (TypeError, ValueError):
        return 1.0


def skipped_steps(engine) -> int:
    """Optimizer steps DeepSpeed skipped (fp16 overflow: the loss scale is lowered instead)."""
    return int(getattr(engine, "skipped_steps", 0) or 0)


def convert_to_universal(step_dir: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """DeepSpeed's ``ds_to_universal`` on one saved step: the ZeRO partitions of every rank
    merged into one file per parameter and optimizer state (fp32 weights, Adam's moments and
    step), which a DeepSpeed engine of any data-parallel size and ZeRO stage 1-3 loads with
    ``checkpoint.load_universal``. Runs in this process (one worker each for extraction and
    merging); its progress goes to stderr, into the job's log."""
    import argparse
    import sys

    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(step_dir),
        output_folder=str(out_dir),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        # checkpoints without DeepSpeed's universal_checkpoint_info (a plain module, no
        # tensor parallel merge patterns) get the empty record it expects
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(sys.stderr):
        ds_to_universal.main(args)
