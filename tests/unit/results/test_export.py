"""The streamed Hugging Face export and the weights evaluation loads, on real DeepSpeed
checkpoints of a many-tensor model (the tiny model with 16 layers: 196 tensors, the largest
1/26 of the model): ZeRO 0 on one rank, ZeRO 1-3 on two (real partitions).

- the streamed export equals what the export consolidated before (DeepSpeed's zero_to_fp32;
  the ZeRO-0 module) tensor for tensor, for ZeRO 0-3;
- a bf16 export holds the fp32 master weights, ZeRO 0 included;
- its peak memory is a small multiple of the largest tensor, not of the model;
- transformers loads a sharded export with the logits of the single-file one.
"""

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptflow.config.settings import ModelConfig
from gptflow.errors import GptflowError
from gptflow.plan.workflow_config import load_workflow_config
from gptflow.train.run_config import render_run_config, write_run_config
from tests.support.hardware import fp16_env
from tests.support.in_turn import train_in_turn
from tests.support.memory import peak_allocated

BIN = Path(sys.executable).parent
LAYERS = 16
MODEL_16 = ModelConfig(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, vocab_size=512)


def launch_family(key: tuple) -> list[tuple]:
    """The layouts (zero, precision, tp, pp) trained in one launch with `key`'s: one model split
    (tensor x pipeline parallel) per launch (tests/support/in_turn.py); fp16 apart, in its own
    environment (tests/support/hardware.py); ZeRO 0 alone, on one rank; ZeRO 3 last."""
    zero, precision, tp, pp = key
    if zero == 0:
        return [key]
    if (tp, pp) != (1, 1):
        return [(1, p, tp, pp) for p in ("fp32", "bf16")]
    if precision == "fp16":
        return [(z, "fp16", 1, 1) for z in (1, 2, 3)]
    return [(z, p, 1, 1) for z in (1, 2, 3) for p in ("fp32", "bf16")]


@pytest.fixture(scope="module")
def trained(repo, tiny_config, tokenizer_json, shards, tmp_path_factory):
    """trained(zero_stage, precision, tp=1, pp=1) -> the run directory of a finished 2-step
    run (trained once per module, with the other layouts of its launch: launch_family): one
    rank at ZeRO 0, under torchrun at ZeRO 1-3 two ranks (data parallel) or tp x pp (tensor
    and pipeline parallel). fp16 on a CPU without oneDNN fp16 runs on PyTorch's reference
    kernels (tests/support/hardware.py)."""
    runs: dict[tuple, Path] = {}

    def render(zero: int, precision: str, tp: int, pp: int, where: Path) -> Path:
        settings = dict(
            zero_stage=zero, precision=precision, train_iters=2, lr_warmup_iters=1,
            log_interval=1, eval_interval=100, eval_iters=1, save_interval=100, keep_last=1,
            tensor_parallel=tp, pipeline_parallel=pp,
        )  # fmt: skip
        cfg = load_workflow_config(
            {
                **tiny_config,
                "model": {**tiny_config["model"], "num_layers": LAYERS},
                "train": {**tiny_config["train"], **settings},
            },
            schema_path=repo / "config/schema/config.schema.yaml",
            models_dir=repo / "config/models",
            source="test",
        )
        run_dir = where / f"zero{zero}-{precision}-tp{tp}-pp{pp}"
        run_dir.mkdir()
        run = render_run_config(
            cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": shards}, run_dir=str(run_dir)
        )
        write_run_config(run, run_dir / "run.yaml")
        return run_dir

    def train(zero: int, precision: str, tp: int = 1, pp: int = 1) -> Path:
        key = (zero, precision, tp, pp)
        if key not in runs:
            family = launch_family(key)
            where = tmp_path_factory.mktemp("trained")
            made = {k: render(*k, where) for k in family}
            ranks = 1 if zero == 0 else max(2, tp * pp)
            env = fp16_env() if precision == "fp16" else os.environ
            rec = train_in_turn([(d, None) for d in made.values()], ranks, where / "rec", env=env)
            assert [r["code"] for d in made.values() for r in rec[d.name]] == [0] * (
                ranks * len(made)
            )
            runs.update(made)
        return runs[key]

    return train


def silent(_line: str) -> None:
    """export_hf's log, quiet."""


def final_checkpoint(run_dir: Path) -> Path:
    return Path(json.loads((run_dir / "DONE.json").read_text())["checkpoint"])


@functools.cache
def consolidated(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights as DeepSpeed itself consolidates them, read apart from gptflow.results.export:
    zero_to_fp32 for ZeRO 1-3 (fp16/fp32, and bf16 at ZeRO 2/3), the universal conversion
    (ds_to_universal) where zero_to_fp32 cannot read the checkpoint (bf16 at ZeRO 1: the
    BF16_Optimizer's; tensor and pipeline parallel), the whole ZeRO-0 module otherwise
    (``lm_head`` named as in the export)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = final_checkpoint(run_dir)
    layout = json.loads((ckpt / "COMPLETE").read_text())["layout"]
    bf16_optimizer = (layout["zero_stage"], layout["precision"]) == (1, "bf16")
    if bf16_optimizer or layout["tensor_parallel"] > 1 or layout["pipeline_parallel"] > 1:
        weights = universal_reference(ckpt)
    elif any(ckpt.glob("*optim_states.pt")):
        weights = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    else:
        states = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=True)
        weights = {k: v.float() for k, v in states["module"].items()}
    return {("lm_head.weight" if k == "embed_out.weight" else k): v for k, v in weights.items()}


def universal_reference(ckpt: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's ds_to_universal of `ckpt` into a directory of its own (the step is left as
    it is): one fp32 file per parameter, tensor-parallel slices and pipeline stages merged by
    DeepSpeed; a pipeline's stage names (``{i}.layer.X``, ``0.embed_in``, ``{L+1}.final_...``)
    read back by hand as the model's."""
    import argparse
    import contextlib
    import tempfile

    from deepspeed.checkpoint import ds_to_universal

    out = Path(tempfile.mkdtemp(prefix="reference-universal-")) / "universal"
    args = argparse.Namespace(
        input_folder=str(ckpt), output_folder=str(out), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
    )  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):
        ds_to_universal.main(args)
    weights = {}
    for d in (out / "zero").iterdir():
        if not d.is_dir():  # optimizer_state.pt: the common optimizer state
            continue
        name = d.name
        if m := re.fullmatch(r"(\d+)\.(.*)", name):
            i, rest = int(m[1]), m[2]
            name = (
                f"gpt_neox.{rest}" if i == 0
                else f"gpt_neox.layers.{i - 1}.{rest.removeprefix('layer.')}" if i <= LAYERS
                else rest if rest.startswith("embed_out.") else f"gpt_neox.{rest}"
            )  # fmt: skip
        weights[name] = torch.load(d / "fp32.pt", weights_only=False)["param"].float()
    return weights


def read_export(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export's safetensors files, read by the safetensors library."""
    from safetensors import safe_open

    tensors = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                assert name not in tensors, name
                tensors[name] = f.get_tensor(name)
    return tensors


def model_bytes(weights: dict) -> tuple[int, int]:
    """(bytes of all tensors, bytes of the largest)."""
    sizes = [t.numel() * t.element_size() for t in weights.values()]
    return sum(sizes), max(sizes)


# Every (ZeRO stage, precision) the trainer accepts, and tensor, pipeline and both in fp32
# and in bf16 (the default on a GPU: ZeRO 1 + bf16 is DeepSpeed's BF16_Optimizer)
LAYOUTS = [
    *[(0, "fp32", 1, 1)],
    *[(zero, precision, 1, 1) for precision in ("fp32", "bf16", "fp16") for zero in (1, 2, 3)],
    *[(1, precision, tp, pp) for precision in ("fp32", "bf16") for tp, pp in [(2, 1), (1, 2), (2, 2)]],
]  # fmt: skip
LAYOUT_IDS = [f"zero{z}-{p}" + (f"-tp{t}-pp{q}" if t * q > 1 else "") for z, p, t, q in LAYOUTS]
STAGES = [(0, "fp32"), (1, "fp32"), (2, "bf16"), (3, "bf16")]
STAGE_IDS = [f"zero{z}-{p}" for z, p in STAGES]


@pytest.mark.parametrize(("zero", "precision", "tp", "pp"), LAYOUTS, ids=LAYOUT_IDS)
def test_the_streamed_sharded_export_equals_the_consolidated_weights(
    trained, tmp_path, zero, precision, tp, pp
):
    """Shards of at most 400 kB (the model is 3.5 MB): planned as huggingface_hub plans them,
    HF's index file, and every tensor equal (torch.equal) to the weights DeepSpeed
    consolidates, for every layout the trainer accepts. The export before raised 'is not a
    zero checkpoint' on ZeRO 1 + bf16 (the default on a GPU)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import AutoConfig, AutoModelForCausalLM

    from gptflow.results.export import export_hf

    run_dir = trained(zero, precision, tp, pp)
    want = consolidated(run_dir)
    total, largest = model_bytes(want)
    assert len(want) == LAYERS * 12 + 4 and total > 25 * largest
    limit = 400_000
    result = export_hf(run_dir / "run.yaml", tmp_path / "hf", max_shard_size=limit, log=silent)
    hf = tmp_path / "hf"

    got = read_export(hf)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], want[name]), name

    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": total}
    # as transformers' save_pretrained shards: the model's state dict, in its order
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf))
    state = model.state_dict()
    assert state.keys() == got.keys()
    hub = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )
    assert index["weight_map"] == hub.tensor_to_filename
    files = sorted(p.name for p in hf.glob("*.safetensors"))
    assert files == sorted(hub.filename_to_tensors) and len(files) == result["files"] > 5
    for f in files:
        names = [n for n, file in index["weight_map"].items() if file == f]
        assert sum(got[n].numel() * 4 for n in names) <= limit, f
    assert not list(tmp_path.glob(".hf*"))  # published whole, no temporary directory left


def test_transformers_loads_the_sharded_export_with_the_single_file_logits(
    trained, tmp_path, shards
):
    """The default export (the model fits one 5 GB shard) is one model.safetensors; a sharded
    export of the same checkpoint (index + 9 shards) loads in transformers with the same
    weights and bit-identical logits on real tokens."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from gptflow.results.evaluate import token_stream
    from gptflow.results.export import export_hf

    run_dir = trained(0, "fp32")
    export_hf(run_dir / "run.yaml", tmp_path / "single", log=silent)
    export_hf(run_dir / "run.yaml", tmp_path / "sharded", max_shard_size=400_000, log=silent)
    single = sorted(p.name for p in (tmp_path / "single").iterdir())
    assert [n for n in single if "safetensors" in n] == ["model.safetensors"]
    sharded = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert "model.safetensors" not in sharded and "model.safetensors.index.json" in sharded
    assert len([n for n in sharded if n.startswith("model-")]) == 9

    a = AutoModelForCausalLM.from_pretrained(tmp_path / "single", local_files_only=True).eval()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", local_files_only=True).eval()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    want = consolidated(run_dir)
    assert all(torch.equal(sa[k], want[k]) for k in want)  # nothing left at its random init
    tokens = token_stream(shards)[0][: 4 * 64].astype(np.int64)
    x = torch.from_numpy(tokens).view(4, 64)
    with torch.no_grad():
        la, lb = a(input_ids=x).logits, b(input_ids=x).logits
    assert torch.equal(la, lb)
    assert la.abs().max().item() > 1.0


def bf16_representable(t: torch.Tensor) -> torch.Tensor:
    return t == t.to(torch.bfloat16).float()


@pytest.mark.parametrize("zero", [2, 3], ids=["zero2", "zero3"])
def test_a_bf16_export_holds_the_fp32_master_weights(trained, zero):
    """ZeRO 2/3 bf16: the exported weights are the fp32 partitions of the optimizer states
    (the equality test above), and they are real fp32 values, not bf16 ones widened: almost
    none is representable in bf16. At ZeRO 2 each rounds to the saved bf16 module weight."""
    from gptflow.results.export import load_checkpoint_weights

    run_dir = trained(zero, "bf16")
    ckpt = final_checkpoint(run_dir)
    exported = load_checkpoint_weights(ckpt, run_dir)
    assert all(t.dtype == torch.float32 for t in exported.values())
    n = sum(t.numel() for t in exported.values())
    widened = sum(int(bf16_representable(t).sum()) for t in exported.values())
    assert widened < 0.01 * n, (widened, n)
    if zero == 2:
        module = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=False)["module"]
        assert module.keys() == exported.keys()
        for name, t in module.items():
            assert t.dtype == torch.bfloat16, name
            assert torch.equal(exported[name].to(torch.bfloat16), t), name


# DeepSpeed bf16 at ZeRO 0 (FP16_UnfusedOptimizer), written by DeepSpeed itself: gptflow's own
# config refuses bf16 at ZeRO 0 for training, but such checkpoints exist. gptflow's model, its
# decay_groups and torch AdamW, as gptflow.train.engine builds them.
ZERO0_BF16 = """
import json
import sys
from pathlib import Path

import deepspeed
import torch

from gptflow.config.settings import ModelConfig
from gptflow.train.engine import init_distributed
from gptflow.train.model import GPTNeoX, decay_groups

init_distributed()
torch.manual_seed(0)
model = GPTNeoX(ModelConfig(**json.loads(sys.argv[2])))
optimizer = torch.optim.AdamW(decay_groups(model, 0.1), lr=3e-3)
config = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "steps_per_print": 10**9,
}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
for step in range(2):
    x = torch.randint(0, 512, (4, 32))
    engine.backward(engine(x, labels=x))
    engine.step()
print(type(engine.optimizer).__name__)
engine.save_checkpoint(sys.argv[1], tag="step00000002")
(Path(sys.argv[1]) / "step00000002" / "COMPLETE").write_text("")
from gptflow.train import device
sys.exit(device.leave(0))  # without the interpreter's teardown (gptflow.train.device.leave)
"""


def test_a_zero0_bf16_export_holds_deepspeeds_fp32_master_weights(tmp_path):
    """At ZeRO 0 DeepSpeed's FP16_UnfusedOptimizer saves the fp32 masters as
    ``optimizer.fp32_groups``, by optimizer group and without names. The export's tensors are
    exactly those masters (matched here by value, not by the export's group-to-name mapping:
    the same multiset), each rounding to the saved bf16 weight of its name, and real fp32 values;
    the export before wrote the bf16 weights widened."""
    from gptflow.results.export import checkpoint_weights, write_hf_weights

    script = tmp_path / "zero0_bf16.py"
    script.write_text(ZERO0_BF16)
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=1", str(script),
         str(tmp_path / "ckpt"), json.dumps(dataclasses.asdict(MODEL_16))],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "FP16_UnfusedOptimizer"
    ckpt = tmp_path / "ckpt" / "step00000002"
    states = torch.load(ckpt / "mp_rank_00_model_states.pt", weights_only=True)
    module, masters = states["module"], [t for g in states["optimizer"]["fp32_groups"] for t in g]
    assert len(masters) == len(module) == LAYERS * 12 + 4

    weights = checkpoint_weights(ckpt, tmp_path, MODEL_16)
    (tmp_path / "hf").mkdir()
    write_hf_weights(tmp_path / "hf", weights, max_shard_size=400_000)
    exported = read_export(tmp_path / "hf")
    assert exported.keys() == module.keys()
    unused = list(range(len(masters)))
    for name, t in exported.items():
        assert t.dtype == torch.float32, name
        # the first unused equal master (equal masters, as biases after two Adam steps from
        # zero can be, are interchangeable)
        same = next(i for i in unused if masters[i].shape == t.shape and torch.equal(masters[i], t))
        unused.remove(same)
        assert torch.equal(t.to(torch.bfloat16), module[name]), name
    assert not unused
    n = sum(t.numel() for t in exported.values())
    widened = sum(int(bf16_representable(t).sum()) for t in exported.values())
    assert widened < 0.01 * n, (widened, n)
    # named through another model's groups, the masters are refused, not mislabelled
    with pytest.raises(GptflowError, match=r"groups of \[66, 130\], but .* \[62, 122\]"):
        checkpoint_weights(ckpt, tmp_path, dataclasses.replace(MODEL_16, num_layers=LAYERS - 1))


PEAK_LAYOUTS = [(z, p, 1, 1) for z, p in STAGES] + [(1, "bf16", 2, 2), (1, "fp32", 2, 2)]


@pytest.mark.parametrize(
    ("zero", "precision", "tp", "pp"),
    PEAK_LAYOUTS,
    ids=[LAYOUT_IDS[LAYOUTS.index(x)] for x in PEAK_LAYOUTS],
)
def test_the_export_peak_memory_is_a_few_tensors_not_the_model(
    trained, tmp_path, zero, precision, tp, pp
):
    """The export's peak tensor memory is at most twice the largest tensor (the model is 26
    times it), while the consolidating read it replaces (zero_to_fp32, the universal
    conversion, torch.load of the ZeRO-0 file), measured the same way, holds at least the
    whole model: the measurement sees whole-model copies when there are any. Under tensor x
    pipeline parallel the tensor-parallel slices are joined one parameter at a time."""
    from gptflow.results.export import export_hf

    run_dir = trained(zero, precision, tp, pp)
    total, largest = model_bytes(consolidated(run_dir))
    streamed = peak_allocated(
        lambda: export_hf(run_dir / "run.yaml", tmp_path / "hf", max_shard_size=400_000, log=silent)
    )
    before = peak_allocated(lambda: consolidated.__wrapped__(run_dir))
    print(f"zero {zero} {precision}: model {total:,} B, largest tensor {largest:,} B, "
          f"streamed export peak {streamed:,} B, consolidated read peak {before:,} B")  # fmt: skip
    assert streamed <= 2 * largest, (streamed, largest)
    assert before >= total, (before, total)


@pytest.mark.parametrize(("zero", "precision", "tp", "pp"), LAYOUTS, ids=LAYOUT_IDS)
def test_evaluate_holds_the_consolidated_weights_for_every_layout(
    trained, tmp_path, shards, zero, precision, tp, pp
):
    """The evaluated model holds exactly (torch.equal) the weights DeepSpeed consolidates,
    for every layout the trainer accepts, and the evaluation writes eval.json (it failed with
    the export's 'is not a zero checkpoint' after a default GPU run: ZeRO 1 + bf16)."""
    from gptflow.results.evaluate import evaluate, load_model
    from gptflow.train.run_config import RunConfig

    run_dir = trained(zero, precision, tp, pp)
    cfg = RunConfig.load(run_dir / "run.yaml")
    want = consolidated(run_dir)
    state = load_model(cfg, final_checkpoint(run_dir), "cpu").state_dict()
    assert {("lm_head.weight" if k == "embed_out.weight" else k) for k in state} == want.keys()
    for name, t in state.items():
        assert torch.equal(t, want["lm_head.weight" if name == "embed_out.weight" else name])
    result = evaluate(
        run_dir / "run.yaml", tmp_path / "eval.json", prompts=["def"], new_tokens=2,
        max_windows=2, extra={"corpus": shards}, log=silent,
    )  # fmt: skip
    assert json.loads((tmp_path / "eval.json").read_text()) == result
    assert (result["device"], result["dtype"], result["step"]) == ("cpu", "fp32", 2)
    assert math.isfinite(result["extra"]["corpus"]["perplexity"])


@pytest.mark.parametrize(("zero", "precision", "tp", "pp"), [(0, "fp32", 1, 1), (1, "bf16", 2, 2)])
def test_evaluate_loads_the_weights_alone_one_tensor_at_a_time(trained, zero, precision, tp, pp):
    """The evaluated model holds exactly the checkpoint's weights, and loading it allocates the
    model plus at most two tensors: the ZeRO-0 file's Adam states (twice the model) are never
    read, nor is a second copy of the weights made; under tensor x pipeline parallel the
    slices are joined one parameter at a time, and nothing is initialised first."""
    from gptflow.results.evaluate import load_model
    from gptflow.train.run_config import RunConfig

    run_dir = trained(zero, precision, tp, pp)
    cfg = RunConfig.load(run_dir / "run.yaml")
    ckpt = final_checkpoint(run_dir)
    want = consolidated(run_dir)
    total, largest = model_bytes(want)
    files = [*ckpt.glob("mp_rank_*_model_states.pt"), *ckpt.glob("*optim_states.pt")]
    assert sum(f.stat().st_size for f in files) > 3 * total  # + Adam states
    models = []
    peak = peak_allocated(lambda: models.append(load_model(cfg, ckpt, "cpu")))
    assert peak <= total + 2 * largest, (peak, total, largest)
    state = models[0].state_dict()
    assert not models[0].training
    assert {("lm_head.weight" if k == "embed_out.weight" else k) for k in state} == want.keys()
    for name, t in state.items():
        assert torch.equal(t, want["lm_head.weight" if name == "embed_out.weight" else name])


def test_the_evaluate_job_memory_comes_from_the_model_without_importing_torch():
    """memory_mb for Pythia-1.4B at 2,048 tokens (1,414,647,808 parameters, as EleutherAI
    publishes; vocabulary 50,304): fp32 weights + 3 x a batch of 8 windows of fp32 logits +
    2 GiB = 16,877 MiB. The workflow calls it while planning, where torch is not imported."""
    from gptflow.config.schema import load_yaml
    from gptflow.config.settings import ModelConfig
    from gptflow.results.evaluate import memory_mb

    preset = load_yaml(Path(__file__).parents[3] / "config/models/pythia-1.4b.yaml")
    preset.pop("description")
    model = ModelConfig(**preset, vocab_size=50_304)
    assert model.num_parameters() == 1_414_647_808
    want = (4 * 1_414_647_808 + 3 * 4 * 8 * 2048 * 50_304 + 2 * 2**30) / 2**20
    assert memory_mb(model, 2048) == math.ceil(want) == 16_877
    code = "import sys, gptflow.results.evaluate; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_evaluate_and_export_run_at_once_on_a_tp_pp_run_and_write_nothing_into_it(
    trained, tmp_path
):
    """Both jobs follow DONE.json, so Snakemake starts them together: on a tensor x pipeline
    run, `gptflow export-hf` and `gptflow evaluate` in two processes at once both succeed,
    and neither writes into the checkpoint (before, each ran DeepSpeed's universal
    conversion into the step's ``universal/`` and the second publish moved the first's
    aside); the step's files and digest are unchanged."""
    from gptflow.train.checkpoint import checkpoint_digest

    run_dir = trained(1, "bf16", 2, 2)
    ckpt = final_checkpoint(run_dir)
    files = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    digest = checkpoint_digest(ckpt)
    config = str(run_dir / "run.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([str(BIN / "gptflow"), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
        for args in (
            ["export-hf", "--config", config, "--out", str(tmp_path / "hf")],
            ["evaluate", "--config", config, "--out", str(tmp_path / "eval.json"),
             "--max-windows", "4", "--new-tokens", "2", "--prompt=def"],
        )
    ]  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == files
    assert checkpoint_digest(ckpt) == digest
    exported = read_export(tmp_path / "hf")
    want = consolidated(run_dir)
    assert exported.keys() == want.keys()
    assert all(torch.equal(exported[k], want[k]) for k in want)
    assert json.loads((tmp_path / "eval.json").read_text())["step"] == 2


def test_layers_placed_over_two_devices_give_the_logits_of_one(trained, shards):
    """The evaluation of a model larger than one GPU places its layers in consecutive blocks
    over the job's GPUs (gptflow.results.sizing.layer_devices), each block moving its inputs to its
    device. No GPU exists here: the two devices are both the CPU, so this checks the
    placement's bookkeeping (every module allocated, hooks, weights in) and that the logits
    are the one-device logits; bf16 placement gives logits within bf16's rounding."""
    import numpy as np

    from gptflow.results.evaluate import load_model, token_stream
    from gptflow.results.sizing import layer_devices
    from gptflow.train.run_config import RunConfig

    assert layer_devices(16, 2) == [0] * 8 + [1] * 8
    assert layer_devices(96, 5) == [i // 20 for i in range(96)]  # 20, 20, 20, 20, 16
    run_dir = trained(0, "fp32")
    cfg = RunConfig.load(run_dir / "run.yaml")
    ckpt = final_checkpoint(run_dir)
    x = torch.from_numpy(token_stream(shards)[0][: 2 * 64].astype(np.int64)).view(2, 64)
    one = load_model(cfg, ckpt, ["cpu"])
    two = load_model(cfg, ckpt, ["cpu", "cpu"])
    half = load_model(cfg, ckpt, ["cpu", "cpu"], "bf16")
    assert len(two.gpt_neox.layers[0]._forward_pre_hooks) == 1
    assert not one.gpt_neox.layers[0]._forward_pre_hooks
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert half.gpt_neox.rotary.inv_freq.dtype == torch.float32
    with torch.no_grad():
        a, b, c = one(x), two(x), half(x).float()
    assert torch.equal(a, b)
    assert (a - c).abs().max() < 0.1 * a.abs().max()


def test_the_jobs_after_training_are_sized_from_the_run_config(trained):
    """The evaluate and export_hf jobs' resources as the rules ask for them, from run.yaml's
    model (gptflow.results.sizing): the host memory of a CPU evaluation is the model's, on GPUs two
    tensors; the export's a few tensors; minutes at least the floor."""
    from gptflow.results import sizing
    from gptflow.results.evaluate import export_resources, run_resources
    from gptflow.train.run_config import RunConfig

    run_dir = trained(0, "fp32")
    model = RunConfig.load(run_dir / "run.yaml").model
    eval_cfg = {"max_windows": 256, "prompts": ["a", "b"], "new_tokens": 32}
    cpu = run_resources(run_dir / "run.yaml", 80 * 1024, False, eval_cfg)
    gpu = run_resources(run_dir / "run.yaml", 80 * 1024, True, eval_cfg)
    assert cpu["mem_mb"] == sizing.eval_host_mb(model, 64, False) > gpu["mem_mb"]
    assert gpu["mem_mb"] == math.ceil((8 * model.largest_tensor_numel() + 2 * 2**30) / 2**20)
    assert cpu["gres"] == gpu["gres"] == "gpu:1" and cpu["runtime"] == sizing.MIN_RUNTIME_MIN
    assert export_resources(run_dir / "run.yaml") == {
        "mem_mb": math.ceil((12 * model.largest_tensor_numel() + 2 * 2**30) / 2**20),
        "runtime": sizing.MIN_RUNTIME_MIN,
    }


def test_a_steps_export_equals_the_final_one_and_needs_no_finished_run(trained, tmp_path):
    """export_hf(step=N) (the harness's checkpoints, eval.harness.every) on the layout a GPU
    run defaults to (bf16, ZeRO 1, two ranks): the final step named by its number gives the
    final export byte for byte; it reads the run's series directory, so it works while the
    run still trains (no DONE.json); a step not on disk is one line naming the steps the run
    keeps and the setting that keeps more."""
    from gptflow.results.export import export_hf

    run_dir = trained(1, "bf16")
    final = export_hf(run_dir / "run.yaml", tmp_path / "final", log=silent)
    done = run_dir / "DONE.json"
    done.rename(tmp_path / "DONE.json")  # as while training
    try:
        step = export_hf(run_dir / "run.yaml", tmp_path / "step", step=2, log=silent)
        with pytest.raises(GptflowError) as e:
            export_hf(run_dir / "run.yaml", tmp_path / "step1", step=1, log=silent)
    finally:
        (tmp_path / "DONE.json").rename(done)
    assert step["checkpoint"] == final["checkpoint"] and step["step"] == final["step"] == 2
    for f in (tmp_path / "final").iterdir():
        assert f.read_bytes() == (tmp_path / "step" / f.name).read_bytes(), f.name
    message = str(e.value)
    assert "\n" not in message and not (tmp_path / "step1").exists()
    assert "has no complete checkpoint of step 1 (not saved yet, or deleted: its training " in (
        message
    )
    assert "keeps steps 2; train.keep_last 1, train.keep_every None); set train.keep_every" in (
        message
    )
