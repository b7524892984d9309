"""The whole DAG through Snakemake on the tiny config: plan, run, no-op rerun, targeted rerun,
and two local ranks that save, exit 75 and resume. (A trainer killed with SIGKILL through
Snakemake and resumed on the next run: tests/workflow/test_study.py, on a study's run.)

The pipeline runs once per module (`pipeline`); a test that reads it uses that directory as it
is, and a test that reruns or changes anything gets its own copy (`pipeline_copy`), so every
test passes alone and in any order."""

import collections
import copy
import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import BIN, REPO, headless, job_counts, screenshot_pixels, snakemake_cmd

# what a changed run config reruns: everything from the run config on
AFTER_RUN_CONFIG = {
    "render_run_config": 1,
    "build_data_index": 1,
    "train_gpt": 1,
    "evaluate": 1,
    "export_hf": 1,
    "report_assets": 1,
}
# what a changed hyperparameter reruns: the data index is shared by every run that reads the
# same samples (its settings hold no lr), so only the run's own stages
AFTER_HYPERPARAMETER = {k: n for k, n in AFTER_RUN_CONFIG.items() if k != "build_data_index"}
EVERY_STAGE = {
    "collect_local_documents": 2,
    "sample_documents": 1,
    "train_tokenizer": 1,
    "tokenize_shard": 2,
    **AFTER_RUN_CONFIG,
    "all": 1,
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def hf_window_loss(hf_dir: Path, tokens, seq: int, max_windows: int) -> tuple[float, int, int]:
    """(mean NLL, tokens predicted, windows) of the exported transformers model over the
    first non-overlapping windows of seq + 1 tokens: eval.json's figures, computed apart from
    gptflow (transformers' GPTNeoXForCausalLM, windows cut here)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    n = min((len(tokens) - 1) // seq, max_windows)
    windows = np.stack([tokens[i * seq : i * seq + seq + 1] for i in range(n)]).astype(np.int64)
    x = torch.from_numpy(windows)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(input_ids=x[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)
    )
    return loss.item(), n * seq, n


def check_generations(wd: Path, evaluation: dict, prompts: list[str], new_tokens: int) -> None:
    """Each generation continues its prompt by 1..new_tokens tokens, its text is those tokens
    decoded, and they are what transformers' greedy generate makes of the exported model."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(wd / "results/tokenizers/tiny-bpe/tokenizer.json"))
    eod = tok.token_to_id("<|endoftext|>")
    hf = AutoModelForCausalLM.from_pretrained(
        wd / "results/runs/tiny/hf", local_files_only=True
    ).eval()
    assert [g["prompt"] for g in evaluation["generations"]] == prompts
    for g in evaluation["generations"]:
        assert g["prompt_ids"] == tok.encode(g["prompt"]).ids, g
        assert 1 <= len(g["ids"]) <= new_tokens, g
        assert len(g["ids"]) == new_tokens or g["ids"][-1] == eod, g  # only EOD stops it early
        assert g["text"] == tok.decode(g["ids"]), g
        ids = torch.tensor([g["prompt_ids"]])
        with torch.no_grad():
            theirs = hf.generate(
                ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eod, pad_token_id=eod
            )
        assert theirs[0, ids.shape[1] :].tolist() == g["ids"], g


def test_dry_run_plans_every_stage(pipeline):
    _, _, plan, _ = pipeline
    assert plan.returncode == 0, plan.out
    assert job_counts(plan.out) == EVERY_STAGE


def test_end_to_end_trains_and_writes_real_shards(pipeline):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    wd, _, _, _ = pipeline
    done = json.loads((wd / "results/runs/tiny/DONE.json").read_text())
    assert done["final_step"] == 40
    assert done["final_val_loss"] < done["initial_val_loss"] - 0.5
    assert Path(wd / done["checkpoint"], "COMPLETE").is_file()
    for shard in ("00000", "00001"):
        prefix = wd / "results/tokens/tiny-bpe/stdlib" / shard
        manifest = json.loads(prefix.with_suffix(".json").read_text())
        ds = IndexedDataset(str(prefix))
        assert len(ds) == manifest["sequences"] > 0
        assert int(ds.sequence_lengths.sum()) == manifest["tokens"]
    for rule in EVERY_STAGE:
        if rule != "all":
            assert list((wd / "logs" / rule).rglob("*.log")), f"no log for {rule}"
    train_log = (wd / "logs/train_gpt/tiny.log").read_text()
    assert " iteration       40/      40 | consumed samples:          320 |" in train_log
    metrics = [
        json.loads(line)
        for line in (wd / "results/runs/tiny/metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics if m["kind"] == "train"] == list(range(5, 45, 5))
    # TFLOP/s per device = FLOPs per token x tokens/s / ranks, with the tiny model's 884,736
    # FLOPs a token by Megatron's formula (worked out by hand in tests/unit/train/test_train.py)
    ranks = int(re.search(r"(\d+) ranks? \(", train_log)[1])
    implied = [
        m["tflops_per_device"] * 1e12 * ranks / m["tokens_per_s"]
        for m in metrics
        if m["kind"] == "train"
    ]
    assert implied == pytest.approx([884_736] * len(implied), rel=1e-9), implied
    assert "; 884,736 FLOPs per token," in train_log


def test_the_export_loads_in_transformers_with_logit_parity(pipeline):
    """export_hf's directory loads offline with AutoModelForCausalLM/AutoTokenizer; on a batch
    of real tokens its logits equal our model's within 1e-4 (fp32), and greedy generations
    are identical."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gptflow.results.evaluate import greedy, load_model, token_stream
    from gptflow.train.run_config import RunConfig

    wd, _, _, _ = pipeline
    hf_dir = wd / "results/runs/tiny/hf"
    assert sorted(p.name for p in hf_dir.iterdir() if p.name != ".snakemake_timestamp") == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
    assert not list((wd / "results/runs/tiny").glob(".hf*"))  # no temp directory left
    cwd = os.getcwd()
    os.chdir(wd)  # run.yaml's paths are relative to the workflow directory
    try:
        cfg = RunConfig.load("results/runs/tiny/run.yaml")
        done = json.loads(cfg.done_path.read_text())
        ours = load_model(cfg, done["checkpoint"])
        tokens = token_stream(["results/tokens/tiny-bpe/stdlib/00001"])[0][: 4 * 64]
    finally:
        os.chdir(cwd)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    assert type(hf).__name__ == "GPTNeoXForCausalLM"
    x = torch.from_numpy(tokens.astype(np.int64)).view(4, 64)
    with torch.no_grad():
        ours_logits, hf_logits = ours(x), hf(input_ids=x).logits
    diff = (ours_logits - hf_logits).abs().max().item()
    assert diff < 1e-4, diff
    assert ours_logits.abs().max().item() > 1.0  # a trained model, not all zeros
    for prompt in ("import json", "def __init__(self"):
        ids = tok(prompt, return_tensors="pt").input_ids
        theirs = hf.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
        mine = greedy(ours, ids[0].tolist(), 16, cfg.tokenizer.eod_id, 64)
        assert theirs[0, ids.shape[1] :].tolist() == mine, prompt
    evaluation = json.loads((wd / "results/runs/tiny/eval.json").read_text())
    assert evaluation["step"] == 40
    # 33 documents: the 1 % test split of '90,9,1' rounds to none, and eval.json says so
    assert evaluation["test"]["stdlib"]["sequences"] == [33, 33]
    assert "no tokens" in evaluation["test"]["stdlib"]["note"]
    check_generations(wd, evaluation, ["def ", "The "], 32)  # the default eval config


# clicks the report's "Training" category, then the eye button of the "loss" row (the report
# is a single-page app without URL routes); appended to a copy of the report for the browser
REPORT_CLICKS = """<script>
setTimeout(() => { [...document.querySelectorAll('a,button,li,div,span,td,tr')]
  .filter(e => e.textContent.trim() === 'Training').pop().click(); }, 1000);
setTimeout(() => { [...document.querySelectorAll('tr')].find(r => r.textContent.includes('loss'))
  .querySelector('a,button').click(); }, 2000);
</script>"""


def test_the_report_is_one_file_that_renders_the_dag_and_the_loss_plot(
    pipeline, snakemake, chromium, tmp_path
):
    import base64

    wd, config, _, _ = pipeline
    report = tmp_path / "report.html"
    made = snakemake(wd, config, "--report", str(report))
    assert made.returncode == 0, made.out[-3000:]
    text = report.read_text()
    assert not re.search(r"""(?:src|href)=["']https?://""", text)  # self-contained
    card = (wd / "results/runs/tiny/report/card.html").read_text()
    manifest = json.loads((wd / "results/tokens/tiny-bpe/stdlib/00000.json").read_text())
    for want in ("Data card", "stdlib", f"{manifest['tokens']:,}", manifest["sources"][0]["sha256"][:16],
                 "Evaluation", "Resolved run config", "none: training ran"):  # fmt: skip
        assert want in card, want

    dom = headless(chromium, report, "--dump-dom")
    assert "Snakemake Report" in dom and "Run card" in dom and "Training" in dom
    canvas = re.search(r'<canvas width="(\d+)" height="(\d+)" class="marks"', dom)
    assert canvas and int(canvas[2]) > 300, "the workflow graph (vega canvas) did not render"

    probe = tmp_path / "probe.html"
    head, _, tail = text.rpartition("</body>")  # the page's own, after embedded documents
    probe.write_text(head + REPORT_CLICKS + "</body>" + tail)
    dom = headless(chromium, probe, "--dump-dom")
    img = re.search(
        r'<img src="data:image/svg\+xml;charset=utf8;filename=loss\.svg;base64,([^"]+)"', dom
    )
    assert img, "the loss plot is not shown after opening it"
    svg = base64.b64decode(img[1]).decode()
    series = json.loads((wd / "results/runs/tiny/DONE.json").read_text())["series"]
    # matplotlib writes each text as paths after a comment holding the text
    for want in ("train loss", "validation loss", f"loss (series {series})", "step"):
        assert f"<!-- {want} -->" in svg, want
    assert "#1f77b4" in svg and "#ff7f0e" in svg  # the train (C0) and validation (C1) lines
    shot = tmp_path / "report.png"  # kept for a look on failure
    headless(chromium, probe, f"--screenshot={shot}")
    pixels = screenshot_pixels(shot)
    assert pixels.shape == (900, 1400, 3), pixels.shape
    # not a blank page, and the loss plot's two lines are on screen in their colours, each
    # drawn across the plot from step 0 or 5 to step 40 (about 1,000 pixels and 540 wide at
    # this window size; the page before the plot is opened has 44 and 0 of them)
    assert len({tuple(p) for p in pixels.reshape(-1, 3)[::7]}) > 50, "a blank page"
    for name, rgb in (("train", (0x1F, 0x77, 0xB4)), ("validation", (0xFF, 0x7F, 0x0E))):
        _, xs = (abs(pixels.astype(int) - rgb).sum(axis=2) < 60).nonzero()
        assert len(xs) > 400, f"{len(xs)} pixels of the {name} loss line's colour in {shot}"
        assert xs.max() - xs.min() > 300, f"the {name} loss line spans x {xs.min()}-{xs.max()}"


def test_evaluation_reports_test_split_and_extra_perplexity(
    pipeline_copy, snakemake, write_config, tiny
):
    """With a 10 % test split and an extra shard (retrains on the new split): both
    perplexities are exp of the mean loss over exactly the windows of seq_length + 1 tokens
    the shards hold, and the loss is the one transformers computes with the export."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    copy_wd, _ = pipeline_copy
    cfg = copy.deepcopy(tiny)
    cfg["data"]["split"] = "80,10,10"
    cfg["eval"] = {
        "prompts": ["import ", "class "],
        "new_tokens": 4,
        "max_windows": 40,
        "extra": {"json": ["results/tokens/tiny-bpe/stdlib/00000"]},
    }
    run = snakemake(copy_wd, write_config(copy_wd / "split.yaml", cfg))
    assert run.returncode == 0, run.out[-3000:]
    evaluation = json.loads((copy_wd / "results/runs/tiny/eval.json").read_text())
    hf_dir = copy_wd / "results/runs/tiny/hf"
    shards = [MegatronIndexed(str(copy_wd / f"results/tokens/tiny-bpe/stdlib/{s}"))
              for s in ("00000", "00001")]  # fmt: skip
    sequences = [ds[i] for ds in shards for i in range(len(ds))]
    assert len(sequences) == 33

    # the test split: sequences 30-32 of the two shards read as one (Megatron's split)
    test = evaluation["test"]["stdlib"]
    assert test["sequences"] == [30, 33]
    tokens = np.concatenate(sequences[30:33])
    loss, counted, windows = hf_window_loss(hf_dir, tokens, 64, 40)
    assert (test["tokens"], test["windows"]) == (counted, windows) and counted > 1000, test
    assert test["loss"] == pytest.approx(loss, abs=1e-4), (test, loss)
    assert math.isfinite(test["perplexity"]) and 1.0 < test["perplexity"] < 512, test
    assert test["perplexity"] == pytest.approx(math.exp(test["loss"]), rel=1e-12), test

    # the extra shard: every token of 00000 in order, at most 40 windows of 65 tokens
    extra = evaluation["extra"]["json"]
    tokens = np.fromfile(copy_wd / "results/tokens/tiny-bpe/stdlib/00000.bin", dtype="<u2")
    assert len(tokens) == sum(len(s) for s in sequences[: len(shards[0])])
    loss, counted, windows = hf_window_loss(hf_dir, tokens, 64, 40)
    assert windows == min((len(tokens) - 1) // 64, 40) == 40  # the cap is reached
    assert (extra["tokens"], extra["windows"]) == (counted, windows) == (40 * 64, 40), extra
    assert extra["loss"] == pytest.approx(loss, abs=1e-4), (extra, loss)
    assert math.isfinite(extra["perplexity"]) and extra["perplexity"] > 1.0, extra
    assert extra["perplexity"] == pytest.approx(math.exp(extra["loss"]), rel=1e-12), extra
    assert extra["perplexity"] < 512  # better than uniform over the vocabulary

    check_generations(copy_wd, evaluation, ["import ", "class "], 4)


def test_inspect_decodes_a_shard(pipeline):
    wd, _, _, _ = pipeline
    out = subprocess.run(
        [
            str(BIN / "gptflow"),
            "inspect",
            "results/tokens/tiny-bpe/stdlib/00000",
            "--max-chars",
            "200",
        ],
        cwd=wd,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "dtype:     uint16" in out.stdout
    assert "decoded with results/tokenizers/tiny-bpe/tokenizer.json" in out.stdout
    assert "A package for parsing, handling, and generating email messages" in out.stdout


def test_second_run_does_nothing(pipeline_copy, snakemake):
    wd, config = pipeline_copy
    done = (wd / "results/runs/tiny/DONE.json").stat().st_mtime_ns
    again = snakemake(wd, config)
    assert again.returncode == 0, again.out[-3000:]
    assert "Nothing to be done" in again.out
    assert job_counts(again.out) == {}
    assert (wd / "results/runs/tiny/DONE.json").stat().st_mtime_ns == done


def test_summary_says_where_the_checkpoint_metrics_and_logs_are(pipeline):
    """`gptflow summary` (what `make run` ends with): per finished run, its step, tokens,
    validation loss from step 0 to the end, and every output with what it holds (the
    checkpoint's step and digest, the metrics' record counts, the export's files and bytes)."""
    wd, _, _, _ = pipeline
    out = subprocess.run(
        [str(BIN / "gptflow"), "summary"], cwd=wd, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    run = wd / "results/runs/tiny"
    done = json.loads((run / "DONE.json").read_text())
    records = read_jsonl(run / "metrics.jsonl")
    evals = [m for m in records if m["kind"] == "eval"]
    trains = [m for m in records if m["kind"] == "train"]
    assert (evals[0]["step"], evals[-1]["step"]) == (0, 40)
    first, last = evals[0]["val_loss"], evals[-1]["val_loss"]
    hf = [p for p in (run / "hf").iterdir() if p.is_file()]
    kb = sum(p.stat().st_size for p in hf) / 1000
    assert (
        out.stdout.splitlines()
        == [
            "run tiny: step 40, 20,480 tokens",  # 40 steps x 8 sequences x 64 tokens
            f"  validation loss: {first:.4f} at step 0 -> {last:.4f} at step 40",
            "  run config:  results/runs/tiny/run.yaml",
            f"  checkpoint:  {done['checkpoint']} (step 40, sha256 {done['checkpoint_sha256'][:16]})",
            f"  metrics:     results/runs/tiny/metrics.jsonl ({len(trains)} train records, "
            f"{len(evals)} evaluations)",
            "  train log:   results/runs/tiny/train.log (every attempt)",
            "  job log:     logs/train_gpt/tiny.log (the last attempt)",
            "  evaluation:  results/runs/tiny/eval.json (no test perplexity: test split '90,9,1' "
            "has no tokens)",
            f"  HF export:   results/runs/tiny/hf ({len(hf)} files, {kb:.1f} kB)",
            "  report card: results/runs/tiny/report/card.html",
        ]
    ), out.stdout
    assert (wd / done["checkpoint"] / "COMPLETE").is_file()
    assert (wd / "logs/train_gpt/tiny.log").is_file()


def test_why_names_the_changed_key_and_exactly_the_stages_it_reruns(
    pipeline, write_config, tiny, tmp_path
):
    """gptflow why compares the config recorded by the last successful run (onsuccess) with
    the one a run would use now, and attributes each change to the jobs whose params hold it."""
    wd, config, _, _ = pipeline
    assert (wd / ".snakemake/gptflow/last-config.yaml").is_file()

    def why(cfg_path, *options):
        out = subprocess.run(
            [str(BIN / "gptflow"), "why", *options, "--directory", str(wd), "--json",
             str(tmp_path / "w.json"), "--", "--snakefile", str(REPO / "Snakefile"), "--profile", str(REPO / "profiles/local"),
             "--configfile", str(cfg_path)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout, json.loads((tmp_path / "w.json").read_text())

    text, result = why(config)
    assert "Nothing will rerun" in text and "Config unchanged" in text, text
    assert result["jobs"] == [] and result["changes"] == []
    # the plan's preflight and size (tests/unit/watch/test_why.py works these out by hand): 165,632
    # parameters (the tiny model's real count, from the tokenizer the run made), 40 x 8 x 64
    # tokens, 884,736 FLOPs a token (Megatron's formula, as the trainer logs it), at 40 % MFU
    # of 989 TFLOP/s; 16 bytes a parameter for 3 checkpoints (keep_last 2, and the one being
    # written); the shards made, to the byte
    assert result["preflight"]["lines"][0].startswith(
        "gptflow preflight: train_gpt on 1 rank(s) = 1 data parallel; micro batch 4 x grad "
        "accum 2 x 1 = global batch 8; 165,632 parameters (vocabulary 512: "
        "results/tokenizers/tiny-bpe/tokenizer.json)"
    ), result["preflight"]
    pre = result["preflight"]["size"]
    assert (pre["parameters"], pre["training_tokens"]) == (165_632, 20_480)
    assert pre["training_flops"] == 884_736 * 20_480
    assert pre["gpu_hours"] == pytest.approx(1.272286e-8, rel=1e-6)
    shards = sum(f.stat().st_size for f in (wd / "results/tokens").rglob("*.bin"))
    assert (pre["checkpoint_bytes"], pre["shard_bytes"]) == (7_950_336, shards)
    assert (
        "Size: 165,632 parameters, 20,480 training tokens, 1.81e+10 FLOPs = "
        "1.27e-08 GPU-hours at 40% MFU of 989 TFLOP/s; disk: checkpoints about 0.00795 GB, "
        f"shards about {shards / 1e9:.3g} GB, "
    ) in text, text

    changed = copy.deepcopy(tiny)
    changed["train"]["lr"] = 2.0e-3
    text, result = why(
        write_config(tmp_path / "lr.yaml", changed), "--mfu", "0.5", "--peak-tflops", "312"
    )
    # 18,119,393,280 FLOPs / (312e12 x 0.5) = 1.16150e-4 s = 3.226388e-8 GPU-hours
    assert result["preflight"]["size"]["gpu_hours"] == pytest.approx(3.226388e-8, rel=1e-6)
    assert "= 3.23e-08 GPU-hours at 50% MFU of 312 TFLOP/s;" in text, text
    assert result["changes"] == [["train.lr", 0.003, 0.002]], text
    rules = [j["rule"] for j in result["jobs"]]
    assert sorted(rules) == sorted(AFTER_HYPERPARAMETER), text
    by_rule = {j["rule"]: j for j in result["jobs"]}
    for rule in ("render_run_config", "train_gpt"):
        assert by_rule[rule]["keys"] == [["train.lr", 0.003, 0.002]], text
    assert "config train.lr: 0.003 -> 0.002" in text
    assert "because: Params have changed since last execution" in text


def test_enabling_the_container_reruns_only_the_image_and_training(
    pipeline, snakemake, write_config, tiny, tmp_path
):
    """Training is the only job that runs inside the image; with format sif it runs under `apptainer exec --nv` (no Apptainer
    here: this is the plan), with format sqsh it needs the Slurm profile's srun for Pyxis."""
    wd, _, _, _ = pipeline
    cfg = copy.deepcopy(tiny)
    cfg["container"] = {"enabled": True, "format": "sif", "mounts": ["/data:/data:ro"]}
    plan = snakemake(wd, write_config(tmp_path / "sif.yaml", cfg), "-n", "-p", "train")
    assert plan.returncode == 0, plan.out[-3000:]
    assert job_counts(plan.out) == {"build_image": 1, "squash_image": 1, "train_gpt": 1, "train": 1}
    (image,) = re.findall(r"results/containers/gptflow-[0-9a-f]{12}\.sif", plan.out)[:1]
    assert (
        f"apptainer exec --nv --pwd {wd} --bind {wd}:{wd} --bind /data:/data:ro {wd}/{image} "
        "gptflow train --config results/runs/tiny/run.yaml"
    ) in plan.out
    # an edited Dockerfile is a new image name, and so a changed input of training only
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text((REPO / "envs/Dockerfile").read_text() + "ENV EDITED=1\n")
    cfg["container"]["dockerfile"] = str(dockerfile)
    edited = snakemake(wd, write_config(tmp_path / "edited.yaml", cfg), "-n", "train")
    assert job_counts(edited.out) == job_counts(plan.out)
    assert image not in edited.out
    cfg["container"]["format"] = "sqsh"
    sqsh = snakemake(wd, write_config(tmp_path / "sqsh.yaml", cfg), "-n", "train")
    assert sqsh.returncode != 0
    assert "container.format sqsh runs through Pyxis (srun --container-image)" in sqsh.out
    # a missing Dockerfile is named when the image is needed, and ignored when it is not
    cfg["container"].update(format="sif", dockerfile=str(tmp_path / "nope" / "Dockerfile"))
    missing = snakemake(wd, write_config(tmp_path / "missing.yaml", cfg), "-n", "train")
    assert missing.returncode != 0
    assert f"container.dockerfile is '{tmp_path}/nope/Dockerfile', but" in missing.out
    cfg["container"]["enabled"] = False
    off = snakemake(wd, write_config(tmp_path / "off.yaml", cfg), "-n", "train")
    assert off.returncode == 0 and "Nothing to be done" in off.out, off.out[-3000:]


def test_changing_a_hyperparameter_reruns_only_training(
    pipeline_copy, snakemake, write_config, tiny
):
    wd, _ = pipeline_copy
    shard = wd / "results/tokens/tiny-bpe/stdlib/00000.bin"
    before = shard.stat().st_mtime_ns
    indices = {p: p.stat().st_mtime_ns for p in (wd / "results/data-index").glob("*/*.npy")}
    assert len(indices) == 6  # document, sample, shuffle index of train and valid
    old = json.loads((wd / "results/runs/tiny/DONE.json").read_text())
    changed = copy.deepcopy(tiny)
    changed["train"]["lr"] = 2.0e-3
    config = write_config(wd / "changed.yaml", changed)
    plan = snakemake(wd, config, "-n")
    # the data index is not rebuilt: its settings hold no lr
    assert job_counts(plan.out) == {**AFTER_HYPERPARAMETER, "all": 1}
    assert "Params have changed since last execution" in plan.out
    run = snakemake(wd, config)
    assert run.returncode == 0, run.out[-3000:]
    new = json.loads((wd / "results/runs/tiny/DONE.json").read_text())
    assert new["series"] != old["series"]  # a new trajectory, trained from step 0...
    assert (
        "starting at step 0"
        in (wd / "logs/train_gpt/tiny.log").read_text().split("series " + new["series"])[1]
    )
    assert Path(wd / old["checkpoint"]).is_dir()  # ...next to the old one, which is kept
    metrics = (wd / "results/runs/tiny/metrics.jsonl").read_text().splitlines()
    assert {json.loads(line)["series"] for line in metrics} == {new["series"]}
    assert (wd / "results/runs/tiny/checkpoints" / old["series"] / "metrics.jsonl").is_file()
    assert shard.stat().st_mtime_ns == before  # tokenization did not rerun
    assert {p: p.stat().st_mtime_ns for p in indices} == indices  # the indices were cached


def updated_by_a_job(plan: str, name: str) -> set[str]:
    """The rules of the planned jobs whose reason names shard file `name` among the
    "Input files updated by another job"."""
    rules = set()
    for block in re.split(r"^(?=rule \w+:$)", plan, flags=re.M):
        reason = re.search(r"^\s*reason: .*$", block, re.M)
        updated = reason[0].partition("updated by another job:")[2] if reason else ""
        if block.startswith("rule ") and re.search(rf"/stdlib/{re.escape(name)}\b", updated):
            rules.add(block.split(":")[0].removeprefix("rule "))
    return rules


def test_a_remade_or_changed_shard_reruns_the_index_and_the_run_config(pipeline_copy, snakemake):
    """The data index and run.yaml take each shard's manifest (PREFIX.json, written last, with
    the .bin's and .idx's sha256), not its three files: a shard made again (its job forced) or
    whose manifest changed reruns both and everything after, and the plan names the manifest."""
    wd, config = pipeline_copy
    tokens = "results/tokens/tiny-bpe/stdlib"
    reading_shards = {"render_run_config", "build_data_index"}
    remade = snakemake(wd, config, "-n", "--forcerun", f"{tokens}/00000.json")
    assert job_counts(remade.out) == {"tokenize_shard": 1, **AFTER_RUN_CONFIG, "all": 1}, (
        remade.out[-3000:]
    )
    assert updated_by_a_job(remade.out, "00000.json") == reading_shards, remade.out[-6000:]
    manifest = wd / tokens / "00001.json"
    manifest.write_text(manifest.read_text().replace('"documents":', '"documents": ', 1))
    changed = snakemake(wd, config, "-n")
    assert job_counts(changed.out) == {**AFTER_RUN_CONFIG, "all": 1}, changed.out[-3000:]
    for rule in reading_shards:
        block = changed.out.split(f"rule {rule}:")[1].split("\nrule ")[0]
        assert f"Updated input files: {tokens}/00001.json" in block, block


def test_two_local_ranks_through_the_local_profile_save_exit_75_and_resume(
    pipeline_copy, write_config, tiny, snakemake
):
    """`--set-resources train_gpt:nproc_per_node=2` on profiles/local: train_gpt starts two
    gloo ranks through `gptflow train --nproc-per-node 2`, the job's 2 cores shared (one
    thread each). SIGTERM to that launcher (as a stopped workstation or `kill` sends it) makes
    both ranks save their ZeRO-1 partitions and exit 75, and Snakemake sees exit status 75;
    the rerun resumes on two ranks and finishes."""
    import psutil

    wd, _ = pipeline_copy
    two = copy.deepcopy(tiny)
    two["run"] = "tiny-2"
    two["train"].update(zero_stage=1, train_iters=60, save_interval=5, eval_interval=100)
    config = write_config(wd / "two.yaml", two)
    run_dir = wd / "results/runs/tiny-2"
    ranks = ["train", "--set-resources", "train_gpt:nproc_per_node=2"]
    proc = subprocess.Popen(
        snakemake_cmd(wd, config, *ranks), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not list(run_dir.glob("checkpoints/*/latest")):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        rank0 = psutil.Process(json.loads((run_dir / "train.lock").read_text())["pid"])
        launcher = rank0.parent()
        assert "--nproc-per-node" in launcher.cmdline(), launcher.cmdline()
        launcher.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    log = (wd / "logs/train_gpt/tiny-2.log").read_text()
    assert proc.returncode != 0
    started = "gptflow train --config results/runs/tiny-2/run.yaml --nproc-per-node 2 --threads 1"
    assert started in out
    assert "exit status 75" in out, out[-3000:]
    assert "the 2 ranks saved and stopped; exiting 75" in log, log[-3000:]
    assert not (run_dir / "DONE.json").exists()
    stopped = int(log.split("saved step ")[1].split(";")[0])

    rerun = snakemake(wd, config, *ranks)
    assert rerun.returncode == 0, rerun.out[-3000:]
    log = (wd / "logs/train_gpt/tiny-2.log").read_text()
    assert f"resuming from step {stopped};" in log
    assert "2 ranks (torchrun)" in log
    done = json.loads((run_dir / "DONE.json").read_text())
    assert done["final_step"] == 60
    step = wd / done["checkpoint"]
    assert json.loads((step / "COMPLETE").read_text())["layout"]["world_size"] == 2
    assert sorted(p.name for p in step.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]  # fmt: skip


def test_snakemake_lint_is_clean(repo, tmp_path):
    """The repository's Snakefile with its embedded default config, linted from a scratch
    working directory: run in the repository, Snakemake writes .snakemake/ there."""
    out = subprocess.run(
        [str(BIN / "snakemake"), "--lint", "--snakefile", str(repo / "Snakefile"),
         "--directory", str(tmp_path), "--configfile", str(repo / "config/config.yaml")],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Congratulations, your workflow is in a good condition!" in out.stdout + out.stderr


def test_merge_adds_one_job_and_keeps_the_shards(pipeline_copy, snakemake, write_config, tiny):
    """tokenize.merge: true adds merge_shards only; the shards (made by gigatoken, checked
    against hf) are not re-tokenized, and the merged prefix is their concatenation."""
    import numpy as np

    from gptflow.data.indexed import IndexedDataset

    wd, _ = pipeline_copy
    cfg = copy.deepcopy(tiny)
    cfg["tokenize"]["merge"] = True
    config = write_config(wd / "merge.yaml", cfg)
    out = snakemake(wd, config, "data")
    assert out.returncode == 0, out.out[-3000:]
    assert job_counts(out.out) == {"merge_shards": 1, "data": 1}
    tokens = wd / "results/tokens/tiny-bpe/stdlib"
    shards = [IndexedDataset(tokens / s) for s in ("00000", "00001")]
    merged = IndexedDataset(tokens / "merged")
    assert merged.num_documents == sum(s.num_documents for s in shards)
    assert np.array_equal(merged._bin, np.concatenate([s._bin for s in shards]))
    for s in ("00000", "00001"):
        engine = json.loads((tokens / f"{s}.json").read_text())["engine"]
        assert engine["name"] == "gigatoken" and engine["parity_documents"] > 0


def test_documents_per_shard_splits_each_input_into_part_jobs(
    pipeline_copy, snakemake, write_config, tiny
):
    """tokenize.documents_per_shard: the plan counts every input at once (two count jobs, not
    one per DAG update), then one tokenize_part job per range; the parts, in order, are the
    whole-input shards' bytes, and the run config lists them."""
    import numpy as np

    from gptflow.data.indexed import IndexedDataset

    wd, _ = pipeline_copy
    cfg = copy.deepcopy(tiny)
    cfg["tokenize"]["documents_per_shard"] = 7
    config = write_config(wd / "parts.yaml", cfg)
    plan = snakemake(wd, config, "-n", "data")
    assert plan.returncode == 0, plan.out[-3000:]
    assert job_counts(plan.out) == {"count_documents": 2, "data": 1}
    out = snakemake(wd, config, "data")
    assert out.returncode == 0, out.out[-3000:]
    tokens = wd / "results/tokens/tiny-bpe/stdlib"
    parts = {}
    for shard in ("00000", "00001"):
        counted = json.loads((wd / f"results/documents/stdlib/{shard}.count.json").read_text())
        n = -(-counted["documents"] // 7)
        parts[shard] = [IndexedDataset(tokens / f"{shard}-{i:04d}") for i in range(n)]
        assert not (tokens / f"{shard}-{n:04d}.bin").exists()
        whole = IndexedDataset(tokens / shard)
        assert [p.num_documents for p in parts[shard]][:-1] == [7] * (n - 1)
        assert sum(p.num_documents for p in parts[shard]) == whole.num_documents
        assert np.array_equal(np.concatenate([p._bin for p in parts[shard]]), whole._bin)
        m = json.loads((tokens / f"{shard}-0001.json").read_text())
        assert m["document_range"] == [7, 14]
        assert m["sources"][0]["sha256"] == counted["sources"][0]["sha256"]
    ran = collections.Counter(re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):$", out.out, re.M))
    assert ran == {
        "count_documents": 2,
        "tokenize_part": sum(len(p) for p in parts.values()),
        "data": 1,
    }
    again = snakemake(wd, config, "-n", "train")
    assert again.returncode == 0, again.out[-3000:]
    assert job_counts(again.out) == {
        "render_run_config": 1,
        "build_data_index": 1,
        "train_gpt": 1,
        "train": 1,
    }
