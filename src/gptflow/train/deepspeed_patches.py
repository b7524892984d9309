"""Every change gptflow makes to DeepSpeed's own code, in one place, each written against
DeepSpeed 0.19.8 (the version pyproject.toml pins) and meant to be offered upstream.

A patch rewrites one condition or one line of a DeepSpeed method from its source
(:func:`rewrite`): the method's text must hold the line exactly once, or the patch refuses
to apply, in one line naming the method, so a DeepSpeed method is never patched blindly.
:func:`apply` runs every patch once per process, before the first engine is built
(:func:`gptflow.train.engine.init_distributed`), on DeepSpeed 0.19.8 only; on another release
it patches nothing and what needs a patch (train.optimizer muon) is refused in one line
(:func:`require`). What each fixes and how it was measured
is in its docstring; the layout test (tests/unit/train/test_muon_layouts.py) fails without them.
"""

from __future__ import annotations

import functools
import inspect
import sys
import textwrap

import torch

from gptflow.errors import GptflowError

TESTED = "0.19.8"


def rewrite(cls: type, name: str, old: str, new: str) -> None:
    """Replace `old` (one whole stretch of source, found exactly once) by `new` in method
    `name` of `cls`, compiled in the method's own module at the method's own lines (a
    traceback points into DeepSpeed's file): the rest of the method stays DeepSpeed's, byte
    for byte. Idempotent; several rewrites of one method all apply."""
    method = getattr(cls, name)
    done = getattr(method, "gptflow_rewrites", ())
    if (old, new) in done:
        return
    lines, first = inspect.getsourcelines(method)  # the file's text: DeepSpeed's own
    source = textwrap.dedent("".join(lines))
    for o, n in (*done, (old, new)):
        if source.count(o) != 1:
            import deepspeed

            raise GptflowError(
                f"DeepSpeed {deepspeed.__version__}: {cls.__name__}.{name} is not the code "
                f"gptflow's patch was written for (DeepSpeed {TESTED}); install "
                f"deepspeed=={TESTED} (make setup)"
            )
        source = source.replace(o, n)
    namespace: dict = {}
    module = sys.modules[method.__module__]
    code = compile("\n" * (first - 1) + source, inspect.getsourcefile(method), "exec")
    exec(code, module.__dict__, namespace)
    patched = namespace[name]
    patched.__qualname__ = method.__qualname__
    patched.gptflow_rewrites = (*done, (old, new))
    setattr(cls, name, patched)


def keep_compact_outputs_apart() -> None:
    """ZeRO 1/2 (``DeepSpeedZeroOptimizer.average_tensor``): a gradient slice that the
    reduction writes into its own output (a parameter of a group whose gradients are summed
    in a compact fp32 partition: under bf16, every AdamW tensor) is never merged with a
    following slice that has none (a Muon matrix, whose group keeps no compact partition).

    DeepSpeed merges neighbouring slices bound for the same rank when the *second* has no
    output, and writes the merged entry back with no output: the first slice's reduced
    gradient then reaches no fp32 partition, stays 0, and AdamW never moves that tensor.
    Measured with the Muon layout probe at bf16 ZeRO 2 before this patch: on 1 rank all 8
    Linear biases of the tiny model had exactly zero update at every step (1.0 x lr off the
    float64 reference), at tensor parallel 2 the same 8 on both ranks, at 2 data-parallel
    ranks the same. A merge is only right when neither slice has an output."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    rewrite(
        DeepSpeedZeroOptimizer,
        "average_tensor",
        "if (grad_partition_output is None and partition_id == prev_id",
        "if (grad_partition_output is None and rank_and_offsets and rank_and_offsets[-1][4] is None"
        " and partition_id == prev_id",
    )


def muon_momentum_in_fp32() -> None:
    """Under bf16 at ZeRO 2 and 3, Muon's momentum is kept and combined in fp32, as
    DeepSpeed's BF16_Optimizer (bf16 at ZeRO 1) and the design's fp32 accumulation do.

    DeepSpeed keeps it in the gradients' dtype: at ZeRO 1/2 ``_muon_momentum_buffer`` sizes it
    by the gradient it is lerped with (bf16 at ZeRO 2, where the gradient is ``param.grad``),
    and ZeRO 3 makes it, and gathers it for each round of updates, in the communication dtype
    (bf16); ``momentum.lerp_(grad, 0.05)`` in bf16 then loses what is below 2^-9 of the
    momentum every step. Here the buffer is fp32 at both stages, ``muon_update`` lifts a
    gradient to the momentum's dtype (so at ZeRO 2 the orthogonalized update also stays fp32
    until the fp32 master step, where it was rounded to bf16), and ZeRO 3 gathers the momentum
    in fp32 (its gradients still in the communication dtype). Measured with the Muon layout
    probe, the Muon half's worst error against the float64 reference: bf16 ZeRO 2 5.5e-2 x lr
    before, 3.66e-2 after (the BF16_Optimizer reference: 3.66e-2); bf16 ZeRO 3 5.2e-2 before,
    3.72e-2 after. Costs: the momentum's 2 more bytes per parameter of each Muon partition
    (ZeRO 2 holds it twice, committed and staged; gptflow.plan.gpu_memory counts it), and at
    ZeRO 3 twice the bytes of the momentum's gathers. Where gradient and momentum already share
    a dtype (fp32 runs, BF16_Optimizer), nothing changes."""
    from deepspeed.runtime.zero.muon import original_muon
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    rewrite(
        DeepSpeedZeroOptimizer,
        "_muon_momentum_buffer",
        "momentum_dtype = grads[0].dtype if grads else dtype",
        "momentum_dtype = torch.float32",
    )
    rewrite(
        DeepSpeedZeroOptimizer_Stage3,
        "_create_momentum_buffer",
        "dtype=self.communication_data_type)",
        "dtype=torch.float32)",
    )
    rewrite(
        DeepSpeedZeroOptimizer_Stage3,
        "_apply_muon_to_accumulated_grads",
        "self._muon_update_sub_group(i, group_items, self.communication_data_type)",
        "self._muon_update_sub_group(i, group_items, torch.float32)",
    )
    update = original_muon.muon_update  # the optimizers import it from the module at each call

    @functools.wraps(update)
    def in_momentum_dtype(grad, momentum, *args, **kwargs):
        if grad.dtype != momentum.dtype:
            grad = grad.to(momentum.dtype)
        return update(grad, momentum, *args, **kwargs)

    in_momentum_dtype.gptflow_rewrites = (("muon_update", "in_momentum_dtype"),)
    original_muon.muon_update = in_momentum_dtype


def import_muon_compiling_on_first_call() -> None:
    """Import DeepSpeed's Muon module with its ``torch.compile`` decorators deferred to the
    first call of each function they decorate.

    DeepSpeed 0.19.8 imports that module in every ZeRO engine (``is_zero_supported_optimizer``
    at start, ZeRO 1/2's ``average_tensor`` each step), Muon or not, and the module decorates
    three functions with ``torch.compile``, whose decoration imports ``torch._inductor``: 1.1 s of
    CPU per rank measured here, for kernels only a Muon run calls. Deferred, a Muon run compiles
    the same functions with the same arguments at their first call; the others never pay."""
    name = "deepspeed.runtime.zero.muon.original_muon"
    if name in sys.modules:
        return
    compile_now = torch.compile

    def compile_later(model=None, **kwargs):
        if model is None:  # @torch.compile(mode=...)
            return functools.partial(compile_later, **kwargs)
        compiled = []

        @functools.wraps(model)
        def call(*args, **kw):
            if not compiled:
                compiled.append(compile_now(model, **kwargs))
            return compiled[0](*args, **kw)

        return call

    torch.compile = compile_later
    try:
        __import__(name)
    finally:
        torch.compile = compile_now


@functools.cache
def apply() -> bool:
    """Every patch, once per process, on the DeepSpeed release they were written for; False
    (nothing patched) on another, where :func:`require` refuses what needs them."""
    import deepspeed

    if deepspeed.__version__ != TESTED:
        return False
    keep_compact_outputs_apart()
    muon_momentum_in_fp32()
    return True


def require(what: str) -> None:
    """Refuse `what` in one line unless the patches it needs are applied (the DeepSpeed
    release they were written for)."""
    if not apply():
        import deepspeed

        raise GptflowError(
            f"{what} needs gptflow's fixes of DeepSpeed {TESTED} (gptflow.train.deepspeed_patches), "
            f"and this is DeepSpeed {deepspeed.__version__}: install deepspeed=={TESTED} (make setup)"
        )


def patched(cls: type, name: str) -> bool:
    """Whether method `name` of `cls` is gptflow's rewrite (tests read it)."""
    return bool(getattr(getattr(cls, name), "gptflow_rewrites", ()))
