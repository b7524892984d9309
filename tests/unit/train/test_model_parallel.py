"""Model parallelism on CPU with real torchrun ranks and gloo: tensor parallel (DeepSpeed AutoTP)
and pipeline parallel (DeepSpeed's PipelineModule). The losses of one rank, an exact resume within
the layout, moves to other layouts through DeepSpeed's universal checkpoint (tensor parallel),
and the export of the whole model.

No GPU exists here: NCCL, the speed of split layers and of pipeline stages across GPUs are not
exercised; the arithmetic, the data order, the schedules' results and the checkpoints are.

The runs that several tests read -- the one-rank reference, and the fresh runs of each layout,
straight and stopped at step 4 by the exit interval -- are trained once per module, the runs of
one layout in one launch (tests/support/in_turn.py); a test continues a copy of a stopped run,
in a process of its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.in_turn import copy_run, train_in_turn

from .test_flops import assert_mfu_is_per_device
from .test_relayout import continue_with, losses
from .test_train import BIN, gptflow_train, records

# No dropout: a split layer draws its masks per rank, so only dropout-free losses match 1 rank's.
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
STEPS = 10  # the losses compared: every step of the run
SETTINGS = dict(
    train_iters=STEPS, log_interval=1, eval_iters=1, eval_interval=STEPS, save_interval=STEPS,
    global_batch_size=8, zero_stage=1,
)  # fmt: skip
# the tiny model (hidden 64, 4 heads, MLP 256) split in two: what each rank holds
HALVES = {
    "attention.query_key_value.weight": (96, 64),
    "attention.query_key_value.bias": (96,),
    "attention.dense.weight": (64, 32),
    "attention.dense.bias": (64,),  # row-parallel: the bias is added once, after the sum
    "mlp.dense_h_to_4h.weight": (128, 64),
    "mlp.dense_h_to_4h.bias": (128,),
    "mlp.dense_4h_to_h.weight": (64, 128),
    "input_layernorm.weight": (64,),
}
# and the vocabulary (the tiny run's tokenizer: 512 rows): the embedding's and the head's rows
VOCAB_HALVES = {"gpt_neox.embed_in.weight": (256, 64), "embed_out.weight": (256, 64)}


# test_a_pipeline_evaluates_in_one_pass: two steps, three evaluation batches at steps 0 and 2
EVAL_SETTINGS = dict(
    model=NO_DROPOUT, train_iters=2, lr_warmup_iters=1, log_interval=2, eval_interval=2,
    eval_iters=3, save_interval=100, global_batch_size=8, zero_stage=1,
)  # fmt: skip
# the micro-batches of each eval_batch call of a pipeline, in the run's record (in_turn.py)
EVAL_HOOKS = """
from deepspeed.runtime.pipe.engine import PipelineEngine

plain = PipelineEngine.eval_batch
def counted(self, data_iter, *args, **kwargs):
    current["record"].setdefault("eval_batches", []).append(kwargs.get("num_micro_batches"))
    return plain(self, data_iter, *args, **kwargs)
PipelineEngine.eval_batch = counted
"""


@pytest.fixture(scope="module")
def one(make_module_run, tmp_path_factory):
    """One rank's runs, in one process: "one" (SETTINGS, no dropout: the losses and weights
    every layout is held to) and "eval" (EVAL_SETTINGS)."""
    runs = {"one": (dict(model=NO_DROPOUT, **SETTINGS), None), "eval": (EVAL_SETTINGS, None)}
    return in_turn(make_module_run, tmp_path_factory, "1rank", 1, runs)[0]


def in_turn(make_module_run, tmp_path_factory, layout: str, ranks: int, runs: dict, hooks=""):
    """`runs` ({name: (train settings, exit interval or None)}) of one layout trained in one
    launch (tests/support/in_turn.py), as run directories named `layout`-`name`; returns
    ({name: run directory}, {name: [each rank's record]}). A run without an exit interval
    finished (code 0 on every rank); one with saved and stopped at it (75 on every rank, what
    `gptflow train` exits with; torchrun's report of it is stopped_at_4)."""
    dirs = {name: make_module_run(f"{layout}-{name}", **settings)
            for name, (settings, _) in runs.items()}  # fmt: skip
    order = [(dirs[name], exit_at) for name, (_, exit_at) in runs.items()]
    rec = train_in_turn(order, ranks, tmp_path_factory.mktemp(layout) / "rec", hooks=hooks)
    for name, (_, exit_at) in runs.items():
        codes = [r["code"] for r in rec[dirs[name].name]]
        assert codes == [75 if exit_at else 0] * ranks, (name, codes)
    return dirs, {name: rec[d.name] for name, d in dirs.items()}


@pytest.fixture(scope="module")
def tp2(make_module_run, tmp_path_factory):
    """Tensor parallel 2 on 2 ranks, one launch: "straight" and "stopped" (at step 4, exit
    interval) without dropout; "dropout" and "dropout-stopped" (6 steps) with the tiny model's."""
    split = dict(model=NO_DROPOUT, tensor_parallel=2, **SETTINGS)
    dropout = dict(SETTINGS, train_iters=6, eval_interval=6, save_interval=6, tensor_parallel=2)
    runs = {"straight": (split, None), "stopped": (split, 4), "dropout": (dropout, None),
            "dropout-stopped": (dropout, 4)}  # fmt: skip
    return in_turn(make_module_run, tmp_path_factory, "tp2", 2, runs)[0]


@pytest.fixture(scope="module")
def pp2(make_module_run, tmp_path_factory):
    """Two pipeline stages on 2 ranks, one launch: "straight", "stopped" (at step 4) and "eval"
    (EVAL_SETTINGS), each eval_batch call's micro-batches recorded per rank."""
    split = dict(model=NO_DROPOUT, pipeline_parallel=2, **SETTINGS)
    runs = {"straight": (split, None), "stopped": (split, 4),
            "eval": (dict(EVAL_SETTINGS, pipeline_parallel=2), None)}  # fmt: skip
    dirs, rec = in_turn(make_module_run, tmp_path_factory, "pp2", 2, runs, EVAL_HOOKS)
    return dirs | {"eval_batches": [r["eval_batches"] for r in rec["eval"]]}


@pytest.fixture(scope="module")
def dp2(make_module_run, tmp_path_factory):
    """Two data-parallel ranks, one launch, each stopped at step 4: "zero2" and "zero1"."""
    runs = {"zero2": (dict(model=NO_DROPOUT, **{**SETTINGS, "zero_stage": 2}), 4),
            "zero1": (dict(model=NO_DROPOUT, **SETTINGS), 4)}  # fmt: skip
    return in_turn(make_module_run, tmp_path_factory, "dp2", 2, runs)[0]


def torchrun(run_dir, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}", "-m", "gptflow",
        "train", "--config", str(run_dir / "run.yaml"), "--threads", "1", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def assert_close(want: dict, got: dict, rel: float = 1e-4) -> None:
    """fp32 losses of another layout: the same sums in another order."""
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), (want, got)
    worst = max(abs(want[s] - got[s]) / abs(want[s]) for s in want)
    assert worst < rel, (worst, want, got)


def final_step(run_dir):
    done = json.loads((run_dir / "DONE.json").read_text())
    return done["checkpoint"]


def module_slices(step_dir) -> list[dict]:
    """Each tensor-parallel rank's module weights, as DeepSpeed saved them (fp32 training:
    these are the weights themselves)."""
    files = sorted(step_dir.glob("mp_rank_*_model_states.pt"))
    return [torch.load(f, map_location="cpu", weights_only=True)["module"] for f in files]


def merged_by_hand(slices: list[dict]) -> dict:
    """The whole model from the slices, by Megatron's split: column-parallel rows (and the
    vocabulary's: the embedding's and the head's) and row-parallel columns concatenated,
    everything else identical on every rank."""
    whole = {}
    for name, first in slices[0].items():
        parts = [s[name] for s in slices]
        if re.search(r"(query_key_value|dense_h_to_4h)\.(weight|bias)$|embed_(in|out)\.", name):
            whole[name] = torch.cat(parts, dim=0)
        elif re.search(r"(attention\.dense|dense_4h_to_h)\.weight$", name):
            whole[name] = torch.cat(parts, dim=1)
        else:
            assert all(torch.equal(first, p) for p in parts), name  # replicated, in step
            whole[name] = first
    return whole


def test_vocab_parallel_loss_and_embedding_are_the_unsplit_ones(repo, tmp_path):
    """Two gloo ranks (tests/support/vocab_parallel.py): Megatron's vocab-parallel
    cross-entropy (max and sum of exponentials over the group, the target's logit from the rank
    that holds it) on logits split in two, fp32 and bf16, against F.cross_entropy on the whole
    logits; and the tiny model at tensor parallel 2 (embedding and head split along the
    vocabulary) against the same weights unsplit: the loss and each rank's rows' gradients,
    within fp32 rounding."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2",
           str(repo / "tests" / "support" / "vocab_parallel.py"), str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    for f in sorted(tmp_path.glob("rank*.json")):
        r = json.loads(f.read_text())
        assert r["loss float32"] < 1e-5 and r["grad float32"] < 1e-6, r
        # bf16 logits: the loss in fp32 either way; the gradient rounded to bf16 (8 bits)
        assert r["loss bfloat16"] < 1e-5 and r["grad bfloat16"] < 1e-4, r
        assert r["grad dtype bfloat16"] == "torch.bfloat16", r
        assert r["model loss"] < 1e-5, r
        for name in VOCAB_HALVES:
            assert tuple(r[f"{name} shape"]) == (128, 64), r  # half of its 256 rows
            assert r[f"{name} weight"] == 0.0, r
            assert r[f"{name} grad"] < 1e-6, r
        assert r["qkv grad"] < 1e-6, r
    assert len(list(tmp_path.glob("rank*.json"))) == 2


def test_tp2_trains_as_one_rank_resumes_exactly_and_exports_the_whole_model(one, tp2, tmp_path):
    from gptflow.results.export import checkpoint_weights

    one, straight = one["one"], tp2["straight"]
    assert "2 ranks (torchrun) = 2 tensor x 1 data parallel, micro batch 4 x grad accum 2" in (
        (straight / "train.log").read_text()
    )
    assert_close(losses(one), losses(straight))

    # each rank holds its half of every split layer (a plan that matched nothing would
    # replicate the layers and still train right)
    step = final_step(straight)
    slices = module_slices(Path(step))
    assert len(slices) == 2
    for suffix, shape in HALVES.items():
        for s in slices:
            assert tuple(s[f"gpt_neox.layers.1.{suffix}"].shape) == shape, suffix
    for name, shape in VOCAB_HALVES.items():
        assert all(tuple(s[name].shape) == shape for s in slices), name

    # killed at step 4 by the exit interval, resumed in the same layout: the same run, bit
    # for bit (losses and weights)
    resumed = copy_run(tp2["stopped"], tmp_path / "resumed")
    again = torchrun(resumed, 2)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming from step 4" in again.stderr and "universal" not in again.stderr
    assert losses(resumed) == losses(straight)
    a = checkpoint_weights(step, straight)
    b = checkpoint_weights(final_step(resumed), resumed)
    assert all(torch.equal(a[k].read(), b[k].read()) for k in a)

    # the export reads the whole model: DeepSpeed's slices merged as Megatron splits them,
    # and within fp32 rounding of the model one rank trained
    whole = {k: w.read() for k, w in a.items()}
    by_hand = merged_by_hand(slices)
    assert list(whole) == list(by_hand)
    assert all(torch.equal(whole[k], by_hand[k]) for k in whole)
    single = checkpoint_weights(final_step(one), one)
    diffs = {k: (whole[k] - single[k].read()).abs().max().item() for k in whole}
    # measured: 2.3e-4 on query_key_value's bias, whose key part has no gradient in exact
    # arithmetic (softmax ignores a shift of all scores) -- Adam scales that rounding noise up
    # to lr-sized steps -- and at most 3.6e-6 everywhere else
    assert all(
        d < (1e-3 if k.endswith("query_key_value.bias") else 1e-5) for k, d in diffs.items()
    ), diffs


def test_tp2_moves_to_one_rank_and_to_data_parallel_and_back(one, tp2, dp2, tmp_path):
    """A tp 2 checkpoint continued at tp 1 on one rank and on 2 data-parallel ranks, and a
    2-rank data-parallel ZeRO-2 checkpoint continued at tp 2: each through DeepSpeed's
    universal checkpoint (converted once, kept with the step), never from step 0."""
    want = losses(one["one"])

    to_one = copy_run(tp2["stopped"], tmp_path / "to_one")
    continue_with(to_one, tensor_parallel=1)
    moved = gptflow_train(to_one)
    assert moved.returncode == 0, moved.stderr[-4000:]
    assert "resuming from step 4" in moved.stderr
    assert "loading it through DeepSpeed's universal checkpoint" in moved.stderr
    assert_close(want, losses(to_one))

    to_dp = copy_run(tp2["stopped"], tmp_path / "to_dp")
    continue_with(to_dp, tensor_parallel=1, zero_stage=2)
    moved = torchrun(to_dp, 2)
    assert moved.returncode == 0, moved.stderr[-4000:]
    assert "universal checkpoint" in moved.stderr and "resuming from step 4" in moved.stderr
    assert_close(want, losses(to_dp))

    to_tp = copy_run(dp2["zero2"], tmp_path / "to_tp")
    continue_with(to_tp, tensor_parallel=2, zero_stage=1)
    moved = torchrun(to_tp, 2)
    assert moved.returncode == 0, moved.stderr[-4000:]
    assert "universal checkpoint" in moved.stderr and "resuming from step 4" in moved.stderr
    assert_close(want, losses(to_tp))


@pytest.mark.parametrize(
    ("model", "train", "message"),
    [
        ({}, {"tensor_parallel": 3, "zero_stage": 1}, "train.tensor_parallel 3 does not divide model.num_attention_heads 4"),
        ({"num_attention_heads": 8, "intermediate_size": 100}, {"tensor_parallel": 8, "zero_stage": 1},
         r"does not divide model.intermediate_size \(default 4 x hidden_size\) 100"),
        ({"make_vocab_size_divisible_by": 1}, {"tensor_parallel": 2, "zero_stage": 1},
         r"train.tensor_parallel 2 does not divide model.make_vocab_size_divisible_by 1: each "
         r"rank holds 1/2 of the vocabulary .* set model.make_vocab_size_divisible_by to a "
         r"multiple of 2 \(e.g. 2\)"),
        ({"num_attention_heads": 6, "hidden_size": 96}, {"tensor_parallel": 3, "zero_stage": 1},
         r"does not divide model.make_vocab_size_divisible_by 128: .* \(e.g. 384\)"),
        ({}, {"tensor_parallel": 2, "zero_stage": 0}, "needs train.zero_stage 1 or 2"),
        ({}, {"tensor_parallel": 2, "zero_stage": 3}, "with train.zero_stage 3 is not supported"),
        ({}, {"pipeline_parallel": 3, "zero_stage": 1}, "exceeds model.num_layers 2"),
        ({"num_layers": 6}, {"pipeline_parallel": 4, "zero_stage": 1},
         r"train.pipeline_parallel 4 does not divide model.num_layers 6: .* use one of \[2, 3, 6\]"),
        ({}, {"pipeline_parallel": 2, "zero_stage": 2}, "needs train.zero_stage 1 \\(it is 2\\)"),
        ({}, {"pipeline_parallel": 2, "tensor_parallel": 2, "zero_stage": 2}, "needs train.zero_stage 1 \\(it is 2\\)"),
    ],
)  # fmt: skip
def test_layouts_that_cannot_split_are_refused_when_planned(
    repo, edit_config, model, train, message
):
    from gptflow.errors import GptflowError
    from gptflow.plan.workflow_config import load_workflow_config

    cfg = edit_config(model={"preset": "tiny", **model}, train=train)
    with pytest.raises(GptflowError, match=message):
        load_workflow_config(
            cfg, schema_path=repo / "config/schema/config.schema.yaml",
            models_dir=repo / "config/models", source="test",
        )  # fmt: skip


def test_ranks_the_model_parallel_size_does_not_divide_are_refused():
    from gptflow.config.settings import TrainConfig
    from gptflow.errors import GptflowError

    t = TrainConfig(train_iters=1, global_batch_size=8, micro_batch_size=2, tensor_parallel=2)
    assert t.data_parallel_size(4) == 2 and t.grad_accum_steps(4) == 2
    assert [t.data_parallel_rank(r, 4) for r in range(4)] == [0, 0, 1, 1]  # neighbours share
    with pytest.raises(GptflowError, match=r"train.tensor_parallel 2 does not divide the 3"):
        t.grad_accum_steps(3)
    # pipeline stages are blocks of ranks (DeepSpeed's pipe-major grid; the trainer checks it
    # against DeepSpeed's own at start): rank = stage x dp + data-parallel rank
    p = TrainConfig(train_iters=1, global_batch_size=8, micro_batch_size=2, pipeline_parallel=2)
    assert [p.data_parallel_rank(r, 4) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(GptflowError, match=r"train.pipeline_parallel 2 does not divide the 5"):
        p.grad_accum_steps(5)
    with pytest.raises(
        GptflowError, match=r"x 2 data-parallel ranks \(4 ranks / 2 per model copy\)"
    ):
        TrainConfig(train_iters=1, global_batch_size=12, micro_batch_size=4,
                    tensor_parallel=2).grad_accum_steps(4)  # fmt: skip


def test_pp2_trains_as_one_rank_resumes_exactly_and_exports_the_whole_model(one, pp2, tmp_path):
    """Two pipeline stages (embedding + layer 0, layer 1 + head) under DeepSpeed's 1F1B
    schedule, two micro-batches per step."""
    from gptflow.results.export import checkpoint_weights
    from gptflow.train.model import hf_name

    one, straight = one["one"], pp2["straight"]
    assert "2 ranks (torchrun) = 2 pipeline x 1 data parallel" in (
        (straight / "train.log").read_text()
    )
    assert_close(losses(one), losses(straight))
    evals = (
        [r["val_loss"] for r in records(one, "eval")],
        [r["val_loss"] for r in records(straight, "eval")],
    )
    assert len(evals[0]) == len(evals[1]) == 2  # eval_batch through the stages, steps 0 and 8
    assert all(abs(a - b) < 1e-4 * a for a, b in zip(*evals, strict=True)), evals

    step = Path(final_step(straight))
    layer_files = sorted(step.glob("layer_*-model_states.pt"))
    assert len(layer_files) == 4  # embedding, 2 layers, head: one file per pipeline layer

    resumed = copy_run(pp2["stopped"], tmp_path / "resumed")
    again = torchrun(resumed, 2)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming from step 4" in again.stderr
    assert losses(resumed) == losses(straight)
    a = checkpoint_weights(step, straight)
    b = checkpoint_weights(final_step(resumed), resumed)
    assert all(torch.equal(a[k].read(), b[k].read()) for k in a)

    # the export: the model's names and order, equal to the stages' own files (fp32 training:
    # their module weights are the weights), and within rounding of one rank's model
    single = checkpoint_weights(final_step(one), one)
    assert list(a) == list(single)
    by_hand = {}
    for i, f in enumerate(layer_files):
        for name, t in torch.load(f, map_location="cpu", weights_only=True).items():
            by_hand[hf_name(f"{i}.{name}", 2)] = t
    assert sorted(by_hand) == sorted(a)
    assert all(torch.equal(a[k].read(), by_hand[k]) for k in a)
    diffs = {k: (a[k].read() - single[k].read()).abs().max().item() for k in a}
    assert all(
        d < (1e-3 if k.endswith("query_key_value.bias") else 1e-5) for k, d in diffs.items()
    ), diffs


def test_a_pipeline_evaluates_in_one_pass(one, pp2):
    """An evaluation through 2 pipeline stages is one ``eval_batch`` with all of its
    micro-batches (it was one per micro-batch: a serial pass of every stage and a barrier
    each), and its loss is one rank's, within fp32 rounding of another summation order."""
    for calls in pp2["eval_batches"]:  # rank 0's, rank 1's
        # steps 0 and 2: 3 global batches of 8 sequences, in micro-batches of 4, on 1
        # data-parallel rank
        assert calls == [6, 6]
    assert len(pp2["eval_batches"]) == 2
    want = [r["val_loss"] for r in records(one["eval"], "eval")]
    got = [r["val_loss"] for r in records(pp2["eval"], "eval")]
    assert len(want) == len(got) == 2
    assert all(abs(a - b) < 1e-4 * a for a, b in zip(want, got, strict=True)), (want, got)


def test_pp2_moves_to_one_rank_and_data_parallel_moves_to_pp2(one, pp2, dp2, tmp_path):
    """A 2-stage pipeline checkpoint continued on one rank (no pipeline), and a 2-rank
    data-parallel ZeRO-2 checkpoint continued as 2 pipeline stages: through the universal
    checkpoint, whose parameters carry the model's names and the pipeline's (symlinks)."""
    want = losses(one["one"])

    to_one = copy_run(pp2["stopped"], tmp_path / "to_one")
    continue_with(to_one, pipeline_parallel=1)
    moved = gptflow_train(to_one)
    assert moved.returncode == 0, moved.stderr[-4000:]
    assert "resuming from step 4" in moved.stderr and "universal checkpoint" in moved.stderr
    assert_close(want, losses(to_one))
    (series,) = (to_one / "checkpoints").iterdir()
    zero = series / "step00000004" / "universal" / "zero"
    link = zero / "2.layer.attention.dense.weight"
    assert link.is_symlink() and os.readlink(link) == "gpt_neox.layers.1.attention.dense.weight"

    to_pp = copy_run(dp2["zero2"], tmp_path / "to_pp")
    continue_with(to_pp, pipeline_parallel=2, zero_stage=1)
    moved = torchrun(to_pp, 2)
    assert moved.returncode == 0, moved.stderr[-4000:]
    assert "resuming from step 4" in moved.stderr and "universal checkpoint" in moved.stderr
    assert_close(want, losses(to_pp))


@pytest.mark.parametrize("layout", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}],
                         ids=["tp2xdp2", "pp2xdp2"])  # fmt: skip
def test_model_parallel_with_data_parallel_on_4_ranks_follows_one_rank(one, make_run, layout):
    """Four ranks: two data-parallel copies of a model split two ways, each copy reading its
    half of every batch (the rank count is the point: 2 x 2); MFU against a stated peak is
    per device, over all 4 ranks (tests/unit/train/test_flops.py)."""
    one = one["one"]
    run = make_run("four", model=NO_DROPOUT, **{**SETTINGS, **layout, "peak_tflops": 0.5})
    out = torchrun(run, 4)
    assert out.returncode == 0, out.stderr[-4000:]
    kind = "tensor" if "tensor_parallel" in layout else "pipeline"
    assert f"4 ranks (torchrun) = 2 {kind} x 2 data parallel, micro batch 4 x grad accum 1" in (
        out.stderr
    )
    assert_close(losses(one), losses(run))
    assert_mfu_is_per_device(out.stderr, records(run, "train"), 0.5)


def test_tp2xpp2_on_4_ranks_follows_one_rank_exports_and_moves(one, dp2, make_run, tmp_path):
    """Tensor parallel 2 inside each of 2 pipeline stages (DeepSpeed's pipe x model grid,
    AutoTP on each stage's layers with the grid's group): one rank's losses, each rank holding
    half of its stage's split matrices, the export of the whole model, and moves out of and
    into the layout through the universal checkpoint (whose record names every stage's
    parameters, not only rank 0's). The straight run and the one stopped at step 4 train in
    one launch of 4 ranks (tests/support/in_turn.py)."""
    from gptflow.results.export import checkpoint_weights

    one = one["one"]
    want = losses(one)
    split = dict(tensor_parallel=2, pipeline_parallel=2)
    both = make_run("both", model=NO_DROPOUT, **SETTINGS, **split)
    out_of = make_run("out_of", model=NO_DROPOUT, **SETTINGS, **split)
    rec = train_in_turn([(both, None), (out_of, 4)], 4, tmp_path / "rec")
    assert [r["code"] for r in rec["both"]] == [0] * 4
    assert [r["code"] for r in rec["out_of"]] == [75] * 4  # saved at step 4 and stopped
    assert "4 ranks (torchrun) = 2 tensor x 2 pipeline x 1 data parallel, micro batch 4 x " in (
        (both / "train.log").read_text()
    )
    assert_close(want, losses(both))
    assert max(r["grad_norm"] for r in records(both, "train")) > 1.0  # clipping was at work

    step = Path(final_step(both))
    # embedding, 2 layers, head: one file per pipeline layer and tensor-parallel rank
    assert len(list(step.glob("layer_*-model_0[01]-model_states.pt"))) == 8
    for tp_rank in (0, 1):
        layer = torch.load(step / f"layer_02-model_0{tp_rank}-model_states.pt", weights_only=True)
        for suffix, shape in HALVES.items():
            assert tuple(layer[f"layer.{suffix}"].shape) == shape, suffix
        embed = torch.load(step / f"layer_00-model_0{tp_rank}-model_states.pt", weights_only=True)
        head = torch.load(step / f"layer_03-model_0{tp_rank}-model_states.pt", weights_only=True)
        assert tuple(embed["embed_in.weight"].shape) == VOCAB_HALVES["gpt_neox.embed_in.weight"]
        assert tuple(head["embed_out.weight"].shape) == VOCAB_HALVES["embed_out.weight"]
    whole = checkpoint_weights(step, both)
    single = checkpoint_weights(final_step(one), one)
    assert list(whole) == list(single)
    diffs = {k: (whole[k].read() - single[k].read()).abs().max().item() for k in whole}
    assert all(
        d < (1e-3 if k.endswith("query_key_value.bias") else 1e-5) for k, d in diffs.items()
    ), diffs

    continue_with(out_of, tensor_parallel=1, pipeline_parallel=1)
    moved = gptflow_train(out_of)
    assert moved.returncode == 0, moved.stderr[-4000:]
    assert "resuming from step 4" in moved.stderr and "universal checkpoint" in moved.stderr
    assert_close(want, losses(out_of))

    into = copy_run(dp2["zero1"], tmp_path / "into")
    continue_with(into, **split)
    moved = torchrun(into, 4)
    assert moved.returncode == 0, moved.stderr[-4000:]
    assert "resuming from step 4" in moved.stderr and "universal checkpoint" in moved.stderr
    assert_close(want, losses(into))


def test_no_rank_builds_the_whole_model(repo, tmp_path):
    """Each of 4 ranks at tensor 2 x pipeline 2 allocates, while its model is built, at most
    what it then holds plus two of the whole model's largest tensor (one drawn whole, one
    slice of it being copied): the model is made on the meta device, split there, and only the
    rank's part is allocated and initialised. A whole fp32 model on every rank would be
    ~600 GB per 8-GPU node for an 18B model."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=4",
           str(repo / "tests" / "support" / "build_peak.py"), "2", "2", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    for r in ranks:
        assert r["held"] < r["whole"] / 3, r  # a quarter of the layers' weights, or so
        assert 0 < r["peak"] <= r["held"] + 2 * r["largest"], r


def test_tp2_dropout_masks_differ_in_split_regions_agree_in_replicated_ones(repo, tmp_path):
    """Megatron's model-parallel RNG, on 2 tensor-parallel ranks (tests/support/dropout_masks.py,
    activation checkpointing on): the attention's dropout masks (each rank holds other heads)
    differ between the ranks; the embedding's and the hidden dropouts' (their inputs are the
    row-parallel sums, the same on both) are equal; the backward's recomputation of a layer
    draws the attention masks its forward drew."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2",
           str(repo / "tests" / "support" / "dropout_masks.py"), str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # forward: the embedding's, then each layer's two; then those the recomputation reruns (it
    # stops once the saved tensors the backward needs are remade)
    assert len(a["hidden"]) == len(b["hidden"]) > 1 + 2 * 2
    assert all(torch.equal(x, y) for x, y in zip(a["hidden"], b["hidden"], strict=True))
    # forward layers 0, 1; the backward recomputes layer 1, then 0
    assert len(a["attention"]) == len(b["attention"]) == 4
    for ranks in (a, b):
        first, second, again_second, again_first = ranks["attention"]
        assert torch.equal(first, again_first) and torch.equal(second, again_second)
        assert not torch.equal(first, second)
    assert not any(torch.equal(x, y) for x, y in zip(a["attention"], b["attention"], strict=True))


def test_tp2_with_dropout_resumes_exactly_and_keeps_replicated_weights_equal(tp2, tmp_path):
    """The tiny model's dropout (0.1) at tensor parallel 2: killed at step 4 and resumed, the
    run repeats the uninterrupted one bit for bit (losses and weights) -- the attention's
    per-rank stream is reseeded with the default one -- and the replicated weights (LayerNorms,
    embeddings, row-parallel biases) are the same on both ranks: the replicated regions' masks
    agree (merged_by_hand checks them)."""
    from gptflow.results.export import checkpoint_weights

    straight = tp2["dropout"]
    merged_by_hand(module_slices(Path(final_step(straight))))
    resumed = copy_run(tp2["dropout-stopped"], tmp_path / "resumed")
    again = torchrun(resumed, 2)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming from step 4" in again.stderr
    assert losses(resumed) == losses(straight) and sorted(losses(straight)) == [1, 2, 3, 4, 5, 6]
    a = checkpoint_weights(final_step(straight), straight)
    b = checkpoint_weights(final_step(resumed), resumed)
    assert all(torch.equal(a[k].read(), b[k].read()) for k in a)
