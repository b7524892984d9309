"""model.init_from: a run starts from a Hugging Face GPT-NeoX checkpoint directory.

Real parts throughout: the tiny run trained by `gptflow train` (DeepSpeed on CPU) and exported
by gptflow.results.export; a GPTNeoXForCausalLM made and saved by transformers 5 (save_pretrained) as a
third party's checkpoint; torchrun ranks with gloo for tensor parallel, pipeline parallel and
ZeRO-3. Not exercised: real Pythia weights (there is no internet here), GPUs, checkpoints
larger than the tiny model (each rank reads one whole tensor at a time, measured by the build
test of test_model_parallel.py for the random initialisation that takes the same path).
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from gptflow.plan.workflow_config import load_workflow_config
from gptflow.train.run_config import RunConfig, render_run_config, write_run_config

from .test_train import BIN, gptflow_train, records

# the source run and the runs continuing from it: 4 steps, evaluated at the last
SETTINGS = dict(
    train_iters=4, lr_warmup_iters=1, log_interval=1, eval_interval=4, eval_iters=1,
    save_interval=4, keep_last=1,
)  # fmt: skip
# the tiny model (hidden 64, 4 heads, MLP 256) split in two: each tensor-parallel rank's part
HALVES = {
    "attention.query_key_value.weight": [96, 64],
    "attention.query_key_value.bias": [96],
    "attention.dense.weight": [64, 32],
    "attention.dense.bias": [64],
    "mlp.dense_h_to_4h.weight": [128, 64],
    "mlp.dense_4h_to_h.weight": [64, 128],
}
# and the vocabulary's 512 rows: each rank's half of the embedding and of the head
VOCAB_HALVES = {"gpt_neox.embed_in.weight": [256, 64], "embed_out.weight": [256, 64]}


def silent(_line: str) -> None:
    """export_hf's log, quiet."""


def workflow_config(repo, tiny_config, model=None, tokenizer=None, **train) -> dict:
    """The tiny config, edited, as the workflow loads it (the checks of -n included)."""
    return load_workflow_config(
        {
            **tiny_config,
            "tokenizer": tokenizer or tiny_config["tokenizer"],
            "model": {**tiny_config["model"], **(model or {})},
            "train": {**tiny_config["train"], **train},
        },
        schema_path=repo / "config/schema/config.schema.yaml",
        models_dir=repo / "config/models",
        source="test",
    )


@pytest.fixture(scope="module")
def render(repo, tiny_config, tokenizer_json, shards, tmp_path_factory):
    """render(name, model=None, **train) -> a run directory with its run.yaml (as conftest's
    make_run, for the whole module)."""

    def make(name: str, model=None, **train) -> Path:
        cfg = workflow_config(repo, tiny_config, model, **train)
        run_dir = tmp_path_factory.mktemp(name)
        run = render_run_config(
            cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": shards}, run_dir=str(run_dir)
        )
        write_run_config(run, run_dir / "run.yaml")
        return run_dir

    return make


@pytest.fixture(scope="module")
def source(render, tmp_path_factory) -> tuple[Path, Path]:
    """(run directory, its Hugging Face export): the tiny run trained 4 steps, exported."""
    from gptflow.results.export import export_hf

    run_dir = render("source", **SETTINGS)
    out = gptflow_train(run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    hf = tmp_path_factory.mktemp("export") / "hf"
    export_hf(run_dir / "run.yaml", hf, log=silent)
    return run_dir, hf


def read_export(hf: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's safetensors files, read by the safetensors library."""
    from safetensors import safe_open

    tensors = {}
    for path in sorted(hf.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return tensors


def built(run_dir: Path) -> torch.nn.Module:
    """The model as the trainer builds it at step 0 on one rank, from run.yaml's init_from."""
    from gptflow.train.engine import build_model
    from gptflow.train.init_from import HFWeights

    cfg = RunConfig.load(run_dir / "run.yaml")
    with HFWeights(cfg.init_from) as init:
        return build_model(cfg.model, cfg.train, 1, torch.device("cpu"), init).eval()


def stored_name(name: str, tensors: dict) -> str:
    from gptflow.train.model import checkpoint_names

    (found,) = [n for n in checkpoint_names(name) if n in tensors]
    return found


def test_a_run_starts_from_an_export_with_its_weights_and_trains_on(render, source):
    """The model the trainer builds equals the export tensor for tensor; its step-0 validation
    loss is the source's last one on the same batches, exactly; it trains on; the run stopped
    at step 2 resumes from its checkpoint without the export (moved away meanwhile)."""
    src, hf = source
    run_dir = render("continued", model={"init_from": str(hf)}, **SETTINGS)
    cfg = RunConfig.load(run_dir / "run.yaml")
    assert cfg.series != RunConfig.load(src / "run.yaml").series  # the same config otherwise

    exported = read_export(hf)
    params = dict(built(run_dir).named_parameters())
    assert sorted(stored_name(n, exported) for n in params) == sorted(exported)
    assert all(torch.equal(p, exported[stored_name(n, exported)]) for n, p in params.items())

    first = gptflow_train(run_dir, "--exit-interval", "2")
    assert first.returncode == 75, first.stderr[-3000:]
    assert f"model: step 0 from the Hugging Face checkpoint {hf} (weights sha256 " in first.stderr
    assert "float32 on disk, read as fp32" in first.stderr
    (want,), got = [r for r in records(src, "eval") if r["step"] == 4], records(run_dir, "eval")
    assert got[0]["step"] == 0 and got[0]["val_loss"] == want["val_loss"]

    away = hf.with_name("moved-away")
    hf.rename(away)
    try:
        second = gptflow_train(run_dir)
    finally:
        away.rename(hf)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"model.init_from {hf} not read: resuming from step 2" in second.stderr
    losses = [r["loss"] for r in records(run_dir, "train")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    from gptflow.results.export import checkpoint_weights

    done = json.loads((run_dir / "DONE.json").read_text())
    assert done["final_step"] == 4
    final = checkpoint_weights(done["checkpoint"], run_dir)
    moved = [n for n, w in final.items() if not torch.equal(w.read(), params[n].detach())]
    assert len(moved) == len(params)  # every parameter trained on from the export


@pytest.mark.parametrize(
    ("tp", "pp", "zero"), [(2, 1, 1), (1, 2, 1), (1, 1, 3)], ids=["tp2", "pp2", "zero3"]
)
def test_each_rank_loads_its_part_of_the_checkpoint(render, source, repo, tp, pp, zero):
    """Two torchrun ranks build the model as the trainer does from the export: at tensor
    parallel 2 each holds the rows or columns of the split matrices that Megatron's split gives
    it, at pipeline parallel 2 its stage's parameters, under ZeRO-3 its partitions (gathered
    here); every one equal (torch.equal) to the export's tensor, cut by hand."""
    _, hf = source
    run_dir = render("layout", model={"init_from": str(hf)}, **SETTINGS)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2",
           str(repo / "tests" / "support" / "init_from_slices.py"),
           str(run_dir / "run.yaml"), str(tp), str(pp), str(zero), str(run_dir)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["equal"] == r["compared"] > 0 for r in ranks), ranks
    every = len(read_export(hf))
    if tp == 2:
        for r in ranks:
            assert r["compared"] == every
            for suffix, shape in HALVES.items():
                assert r["shapes"][f"gpt_neox.layers.1.{suffix}"] == shape, suffix
            for name, shape in VOCAB_HALVES.items():
                assert r["shapes"][name] == shape, name
    elif pp == 2:  # embedding + layer 0, then layer 1 + final LayerNorm + head
        first, last = (set(r["shapes"]) for r in ranks)
        assert not first & last and len(first | last) == every
        assert "gpt_neox.embed_in.weight" in first and "embed_out.weight" in last
    else:
        assert all(r["compared"] == every for r in ranks)


def transformers_model(seed: int = 0):
    """A GPTNeoXForCausalLM of the tiny architecture made by transformers, its weights drawn
    with std 0.3 (transformers draws 0.02, which leaves the logits near zero whatever the
    layers do) and its LayerNorms around 1."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, rotary_pct=0.25, rotary_emb_base=10000,
        max_position_embeddings=2048, layer_norm_eps=1e-5, use_parallel_residual=True,
        hidden_act="gelu", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm.weight" in name else 0.0, 0.3)
    return model


def test_a_transformers_checkpoint_loads_with_its_logits(render, tokenizer_json, shards, tmp_path):
    """transformers' own save_pretrained, once in fp32 (one file) and once in fp16 (4 shards and
    an index): gptflow's model built from each holds the weights transformers loads from it
    (fp16 widened to fp32 exactly) and gives transformers' logits on real tokens, within fp32
    rounding (measured: 4e-7 of the largest logit); the two are two series."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from gptflow.results.evaluate import token_stream
    from gptflow.train.model import checkpoint_name

    made = transformers_model()
    made.save_pretrained(tmp_path / "fp32")
    made.half().save_pretrained(tmp_path / "fp16", max_shard_size="100KB")
    for d in ("fp32", "fp16"):
        shutil.copyfile(tokenizer_json, tmp_path / d / "tokenizer.json")
    assert len(list((tmp_path / "fp16").glob("*.safetensors"))) == 4

    x = torch.from_numpy(token_stream(shards)[0][: 4 * 64].astype(np.int64)).view(4, 64)
    series = []
    for d in ("fp32", "fp16"):
        run_dir = render(f"hf-{d}", model={"init_from": str(tmp_path / d)})
        series.append(RunConfig.load(run_dir / "run.yaml").series)
        ours = built(run_dir)
        theirs = AutoModelForCausalLM.from_pretrained(
            tmp_path / d, dtype=torch.float32, local_files_only=True
        ).eval()
        params = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            assert torch.equal(p, params[checkpoint_name(name)]), name
        with torch.no_grad():
            want, got = theirs(input_ids=x).logits, ours(x)
        assert want.abs().max() > 5  # logits that depend on every layer
        assert (got - want).abs().max() < 1e-5 * want.abs().max(), (got - want).abs().max()
    assert series[0] != series[1]


def copied(hf: Path, to: Path) -> Path:
    shutil.copytree(hf, to)
    return to


def with_swapped_ids(hf: Path, to: Path) -> tuple[Path, str]:
    """A copy of checkpoint `hf` whose tokenizer has ids 300 and 301 swapped: another
    tokenizer of the same size. Returns the copy and the token that is 300 in it."""
    swapped = copied(hf, to)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    return swapped, min((a, b), key=vocab.get)


def refusal(call) -> str:
    """The message of the GptflowError `call()` raises: one line."""
    from gptflow.errors import GptflowError

    with pytest.raises(GptflowError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message
    return message


def test_what_cannot_be_continued_is_refused_in_one_line(
    repo, tiny_config, tokenizer_json, shards, source, tmp_path
):
    """At -n (the workflow config loaded): a missing directory, pickled weights (never
    unpickled: this one would leave a file behind), another architecture, embedding rows this
    run would pad differently. At -n when the run's tokenizer exists, and when run.yaml is
    rendered: another tokenizer (two token ids swapped). At the start of training: weights
    changed since run.yaml was rendered."""
    from gptflow.train import init_from

    _, hf = source
    cwd = Path.cwd()

    def planned(init: Path, **model) -> str:
        return refusal(
            lambda: workflow_config(repo, tiny_config, {"init_from": str(init), **model})
        )

    nowhere = tmp_path / "nowhere"
    assert planned(nowhere) == (
        f"test: model.init_from '{nowhere}' does not exist (relative to {cwd}); give the "
        f"directory of a Hugging Face GPT-NeoX checkpoint (config.json, *.safetensors, "
        f"tokenizer.json). Fix test."
    )

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(hf / name, pickled / name)
    marker = tmp_path / "unpickled"
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(Unpickled(marker)))
    assert planned(pickled) == (
        f"test: model.init_from '{pickled}' holds pickled weights only (pytorch_model.bin), and "
        f"gptflow reads safetensors only: unpickling a file runs whatever code it holds. "
        f"Download the checkpoint's model.safetensors, or convert it once where running its "
        f"code is safe (transformers: from_pretrained(dir).save_pretrained(dir) writes "
        f"safetensors). Fix test."
    )
    assert not marker.exists()

    other = copied(hf, tmp_path / "other-architecture")
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 3
    config["rope_parameters"]["partial_rotary_factor"] = 0.5
    (other / "config.json").write_text(json.dumps(config))
    assert planned(other) == (
        f"test: model.init_from '{other}': its config.json is not the run's model: "
        f"num_hidden_layers 3 in config.json, model.num_layers 2; "
        f"rope_parameters.partial_rotary_factor 0.5 in config.json, model.rotary_pct 0.25. Set "
        f"those model keys to the checkpoint's values (or pick the preset that has them). "
        f"Fix test."
    )
    config["hidden_act"] = "gelu_fast"  # GPT-NeoX-20B's
    (other / "config.json").write_text(json.dumps(config))
    assert planned(other) == (
        f"test: model.init_from '{other}': its config.json asks for what gptflow's GPT-NeoX does "
        f"not compute: hidden_act 'gelu_fast' (gptflow: 'gelu'); it cannot be continued here. "
        f"Fix test."
    )

    assert planned(hf, make_vocab_size_divisible_by=1000) == (
        f"test: model.init_from '{hf}': its embedding has 512 rows (config.json vocab_size) and "
        f"the run's would have 1000 (the tokenizer's 512 ids padded to a multiple of "
        f"model.make_vocab_size_divisible_by 1000); set model.make_vocab_size_divisible_by 512, "
        f"which pads them to 512 (the rows past the ids are kept as trained: the output head's "
        f"take part in every softmax). Fix test."
    )

    swapped, first = with_swapped_ids(hf, tmp_path / "swapped")
    want = (
        f"model.init_from '{swapped}': its tokenizer is not the run's ({tokenizer_json}): token "
        f"{first!r} is id 300 in the checkpoint's, id 301 in the run's. Its embedding rows are "
        f"that tokenizer's ids; train with the checkpoint's: tokenizer.source file, "
        f"tokenizer.path '{swapped / 'tokenizer.json'}'"
    )
    cfg = workflow_config(repo, tiny_config, {"init_from": str(swapped)})  # -n: no tokenizer yet
    assert refusal(lambda: init_from.check_planned_tokenizer(cfg, tokenizer_json)) == want
    shards_of = {"stdlib": shards}
    rendered = lambda: render_run_config(  # noqa: E731
        cfg, tokenizer_path=str(tokenizer_json), shards=shards_of, run_dir=str(tmp_path)
    )
    assert refusal(rendered) == want

    moved = copied(hf, tmp_path / "touched")
    cfg = workflow_config(repo, tiny_config, {"init_from": str(moved)})
    run = render_run_config(
        cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": shards}, run_dir=str(tmp_path)
    )
    weights = moved / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))
    assert refusal(lambda: init_from.HFWeights(run.init_from)) == (
        f"model.init_from '{moved}': model.safetensors changed since run.yaml was rendered (its "
        f"size or mtime differ), so the series named for its content may not hold it; render "
        f"the run again (the workflow does: the file is an input of render_run_config)"
    )


class Unpickled:
    """A pickle whose loading touches `marker`: as a malicious file could run anything."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_the_series_is_named_by_the_weights_content_hashed_once(
    repo, tiny_config, tokenizer_json, shards, source, tmp_path, monkeypatch
):
    """The same weights at another path: the same series. One float changed in place (the
    same size, config.json and header, as two steps of one model have): another series. Each
    file is hashed once: the digests are kept in the run directory by size and mtime."""
    from gptflow import fsutil
    from gptflow.train import init_from

    _, hf = source

    def series(path: Path, run_dir: Path) -> str:
        cfg = workflow_config(repo, tiny_config, {"init_from": str(path)})
        return render_run_config(
            cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": shards},
            run_dir=str(run_dir),
        ).series  # fmt: skip

    hashed = []
    real = fsutil.sha256_file
    monkeypatch.setattr(fsutil, "sha256_file", lambda p, *a: hashed.append(p) or real(p, *a))
    runs = [tmp_path / f"run{i}" for i in range(2)]
    for d in runs:
        d.mkdir()
    same = copied(hf, tmp_path / "elsewhere")
    assert series(hf, runs[0]) == series(same, runs[1])
    assert len(hashed) == 2
    assert series(hf, runs[0]) == series(same, runs[1])
    assert len(hashed) == 2  # from the digests kept beside each run

    weights = same / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = struct.pack("<f", struct.unpack("<f", data[-4:])[0] + 1.0)
    weights.write_bytes(data)
    assert init_from.read_header(weights) == init_from.read_header(hf / "model.safetensors")
    assert series(hf, runs[0]) != series(same, runs[1])
    assert len(hashed) == 3


def test_snakemake_plans_the_checkpoint_as_an_input_and_refuses_another_tokenizer(
    tiny_config, tokenizer_json, source, tmp_path
):
    """`snakemake -n` through the workflow: render_run_config takes the checkpoint's files as
    inputs (a changed file renders run.yaml again, with its new identity); with
    tokenizer.source file the tokenizer is compared at -n, and another one stops the plan."""
    import yaml

    _, hf = source
    swapped, _ = with_swapped_ids(hf, tmp_path / "swapped")

    def plan(init: Path) -> subprocess.CompletedProcess:
        cfg = {
            **tiny_config,
            "tokenizer": {"name": "tiny-file", "source": "file", "path": str(tokenizer_json),
                          "eod_token": "<|endoftext|>"},
            "model": {"preset": "tiny", "init_from": str(init)},
        }  # fmt: skip
        path = tmp_path / f"{init.name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        cmd = [str(BIN / "snakemake"), "-n", "--snakefile", str(REPO / "Snakefile"),
               "--directory", str(tmp_path / "wd"), "--profile", str(REPO / "profiles/local"),
               "--configfile", str(path), "--cores", "2", "train"]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    good = plan(hf)
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    # render_run_config's inputs: the shards and the checkpoint's files (build_data_index
    # takes the shards alone)
    (inputs,) = [
        line for line in good.stdout.splitlines() if line.strip().startswith("input:")
        and "results/tokens/" in line and str(hf) in line
    ]  # fmt: skip
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert str(hf / name) in inputs, inputs

    bad = plan(swapped)
    assert bad.returncode != 0
    lines = [line for line in bad.stdout.splitlines() + bad.stderr.splitlines()
             if line.startswith("gptflow config")]  # fmt: skip
    assert len(lines) == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert lines[0].startswith("gptflow config (")
    assert (
        f"model.init_from '{swapped}': its tokenizer is not the run's ({tokenizer_json})"
        in (lines[0])
    )


# EleutherAI/pythia-160m's config.json as published on the Hugging Face Hub (transformers 4.24;
# typed here: there is no internet to fetch it)
PYTHIA_160M = {
    "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0,
    "hidden_act": "gelu", "hidden_size": 768, "initializer_range": 0.02,
    "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
    "model_type": "gpt_neox", "num_attention_heads": 12, "num_hidden_layers": 12,
    "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.24.0", "use_cache": True,
    "use_parallel_residual": True, "vocab_size": 50304,
}  # fmt: skip


def test_pythia_160m_config_is_the_preset_and_its_rows_are_128_padding(repo):
    """The pythia-160m preset has Pythia-160M's published architecture (transformers 4 key
    names); its 50,304 rows are the GPT-NeoX tokenizer's 50,277 ids padded to 128, and 256
    would be refused with 128 named. Also the same architecture in transformers 5's names."""
    from gptflow.config.schema import load_yaml
    from gptflow.config.settings import ModelConfig
    from gptflow.train.init_from import architecture_differences, check_rows, unsupported

    preset = load_yaml(repo / "config/models/pythia-160m.yaml")
    model = ModelConfig(**preset)
    assert architecture_differences(PYTHIA_160M, model) == [] and unsupported(PYTHIA_160M) == []
    v5 = {k: v for k, v in PYTHIA_160M.items() if k not in ("rotary_pct", "rotary_emb_base")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25}  # fmt: skip
    assert architecture_differences(v5, model) == []
    check_rows("pythia", PYTHIA_160M, 50277, model)
    wide = ModelConfig(**{**preset, "make_vocab_size_divisible_by": 256})
    message = refusal(lambda: check_rows("pythia", PYTHIA_160M, 50277, wide))
    assert "the run's would have 50432" in message
    assert "set model.make_vocab_size_divisible_by 128, which pads them to 50304" in message


def test_tokenizer_identity_is_what_encoding_depends_on(tokenizer_json, tmp_path):
    """The same tokenizer written another way (merges as ["a", "b"] or "a b", other decoder,
    padding on) is the same; a merge moved, a special token made plain, another pre-tokenizer
    are each named."""
    from gptflow.data.tokenizer import load_tokenizer, tokenizer_difference

    base = json.loads(Path(tokenizer_json).read_text())
    names = ("A", "B")

    def differs(edit) -> str | None:
        tok = copy.deepcopy(base)
        edit(tok)
        path = tmp_path / "edited.json"
        path.write_text(json.dumps(tok))
        return tokenizer_difference(load_tokenizer(path), load_tokenizer(tokenizer_json), names)

    def rewritten(tok):
        tok["model"]["merges"] = [
            m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]
        ]
        tok["decoder"] = None
        tok["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of":
                          None, "pad_id": 1, "pad_type_id": 0, "pad_token": "<|padding|>"}  # fmt: skip

    assert differs(rewritten) is None

    def merge_moved(tok):
        merges = tok["model"]["merges"]
        merges[3], merges[4] = merges[4], merges[3]

    def not_special(tok):
        tok["added_tokens"][1]["special"] = False

    def other_pre_tokenizer(tok):
        tok["pre_tokenizer"]["add_prefix_space"] = True

    first = base["model"]["merges"][4]
    first = first if isinstance(first, str) else " ".join(first)
    assert differs(merge_moved).startswith(f"merge #3 is {first!r} in A, ")
    assert differs(not_special) == "added token '<|padding|>': id 1 in A, id 1, special in B"
    assert differs(other_pre_tokenizer).startswith("the pre_tokenizer differs (")


REPO = Path(__file__).resolve().parents[3]
