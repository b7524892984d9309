"""The example configs plan cleanly (no network is touched by a dry run): the exact jobs of each
recipe, and download commands with the URLs and mirrors its config and the catalog name."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import BIN, REPO, job_counts
from .test_pipeline import AFTER_RUN_CONFIG

# planned through their own profile elsewhere: hf-trainer-wikitext through profiles/pbs
# (test_pbs.py), as its users run it
ELSEWHERE = {"hf-trainer-wikitext"}
EXAMPLES = sorted(
    p for p in (REPO / "config" / "examples").glob("*.yaml") if p.stem not in ELSEWHERE
)
AFTER_DATA = {**AFTER_RUN_CONFIG, "all": 1}  # the stages after the data
PLANS = {
    # Pile shard 00 + enwik8.zip; the NeoX-20B tokenizer.json by URL; documents_per_shard
    # counts both inputs first (count_documents is a checkpoint: the tokenize_part jobs are
    # planned once the counts exist)
    "neox-pile-enwik8": {
        "download_dataset": 2,
        "download_tokenizer_file": 1,
        "import_tokenizer": 1,
        "count_documents": 2,
        **AFTER_DATA,
    },
    # OSCAR-1GB, one shard; GPT-2 vocab.json + merges.txt downloaded and converted
    "megatron-oscar-gpt2": {
        "download_dataset": 1,
        "download_tokenizer_file": 2,
        "convert_gpt2_tokenizer": 1,
        "tokenize_shard": 1,
        **AFTER_DATA,
    },
}


def download_command(url: str, mirrors: list[str]) -> str:
    return " ".join([f"gptflow download {url}", *(f"--mirror {m}" for m in mirrors)])


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_config_dry_runs(example, tmp_path, snakemake):
    out = snakemake(tmp_path, example, "-n")
    assert out.returncode == 0, out.out[-3000:]
    assert job_counts(out.out) == PLANS[example.stem]
    cfg = yaml.safe_load(example.read_text())
    catalog = yaml.safe_load((REPO / "config/datasets.yaml").read_text())
    tok = cfg["tokenizer"]
    for key in ("url", "vocab", "merges"):
        if key in tok:
            remote = tok[key]
            assert download_command(remote["url"], remote.get("mirrors", [])) in out.out, key
    for name, spec in cfg["datasets"].items():
        for f in catalog[spec["name"]]["files"]:
            file = f["url"].rsplit("/", 1)[1]
            mirrors = " ".join(f"--mirror {m}" for m in f["mirrors"])
            want = f"gptflow download {f['url']} --out resources/raw/{name}/{file} {mirrors}"
            assert want in out.out, want
    assert not list(tmp_path.glob("resources/**/*.part")) and not (tmp_path / "results").exists()


LAYOUTS = sorted((REPO / "config" / "examples" / "layouts").glob("*.yaml"))
# the published GPU counts (Pythia's ymls, GPT-NeoX's configs/20B.yml, Megatron-LM's 2021
# table), global batches and tensor x pipeline splits each layout file states
PUBLISHED = {
    **{f"pythia-{n}": (gpus, 1024, tp, 1) for n, gpus, tp in [
        ("14m", 32, 1), ("31m", 32, 1), ("70m", 32, 1), ("160m", 32, 1), ("410m", 32, 1),
        ("1b", 64, 1), ("1.4b", 64, 1), ("2.8b", 64, 1), ("6.9b", 128, 2), ("12b", 256, 4)]},
    "gpt-neox-20b": (96, 1536, 2, 4),
    **{f"megatron-gpt3-{size}": (gpus, batch, tp, pp) for size, gpus, batch, tp, pp in [
        ("1.7b", 32, 512, 1, 1), ("3.6b", 64, 512, 2, 1), ("7.5b", 128, 512, 4, 1),
        ("18.4b", 256, 1024, 8, 1), ("39.1b", 512, 1536, 8, 2), ("76.1b", 1024, 1792, 8, 4),
        ("145.6b", 1536, 2304, 8, 8), ("310.1b", 1920, 2160, 8, 16)]},
}  # fmt: skip


def layout_recipe(layout: Path) -> tuple[Path, int]:
    """The data recipe and the node count a layout file's header names."""
    text = layout.read_text()
    (recipe,) = set(re.findall(r"config/examples/([a-z0-9-]+)\.yaml", text))
    (nodes,) = {int(n) for n in re.findall(r"nodes: (\d+)", text)}
    return REPO / "config" / "examples" / f"{recipe}.yaml", nodes


def slurm_profile(directory: Path, nodes: int) -> Path:
    """profiles/slurm with train_gpt's nodes edited, as a layout's header says to."""
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    profile["set-resources"]["train_gpt"]["nodes"] = nodes
    directory.mkdir()
    (directory / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return directory


@pytest.mark.parametrize("layout", LAYOUTS, ids=[p.stem for p in LAYOUTS])
def test_each_published_layout_splits_over_the_nodes_its_header_names(layout):
    """The layout on the ranks of the profile edited as its header says (nodes x 8 GPUs): the
    published GPU count, tensor x pipeline x data = the ranks, the global batch made of
    micro-batches over the data-parallel ranks, and the model checks -n makes (heads, MLP and
    layers divide; ZeRO stage allowed), on the config merged as Snakemake merges it."""
    from snakemake.utils import update_config

    from gptflow.config.settings import TrainConfig
    from gptflow.plan.workflow_config import load_workflow_config
    from gptflow.train.distributed import launched_ranks

    recipe, nodes = layout_recipe(layout)
    cfg = yaml.safe_load(recipe.read_text())
    update_config(cfg, yaml.safe_load(layout.read_text()))
    cfg = load_workflow_config(
        cfg, schema_path=REPO / "config/schema/config.schema.yaml",
        models_dir=REPO / "config/models", source=layout.name,
    )  # fmt: skip
    gpus, batch, tp, pp = PUBLISHED[layout.stem]
    tasks = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())["set-resources"][
        "train_gpt"
    ]["tasks_per_node"]
    ranks = launched_ranks(nodes=nodes, tasks_per_node=tasks)
    assert ranks == gpus
    train = TrainConfig(**cfg["train"])
    assert (train.tensor_parallel, train.pipeline_parallel, train.global_batch_size) == (
        tp,
        pp,
        batch,
    )
    dp = train.data_parallel_size(ranks)
    assert dp * tp * pp == gpus
    assert train.micro_batch_size * train.grad_accum_steps(ranks) * dp == batch
    # and it fits the GPUs it ran on (GPT-NeoX-20B: 40 GB A100s, by its config's own comment;
    # the others checked against 80 GB), by the preflight's estimate with the NeoX tokenizer's
    # vocabulary (GPT-2's for Megatron's table)
    from gptflow.plan import gpu_memory, placement, run_size

    vocab = 50277 if "neox" in recipe.stem else 50257
    gpu = placement.Placement(gpu_mem_mb=(40 if layout.stem == "gpt-neox-20b" else 80) * 1024)
    fit = gpu_memory.memory_per_gpu(run_size.model_config(cfg, vocab), train, ranks, gpu)
    assert fit.fits, (fit.total / 2**30, fit.terms)
    assert cfg["model"]["preset"] == layout.stem  # each layout trains its own model


EVALUATE_PLANS = {
    "pythia-12b": "  evaluate: fp32 on 1 GPU(s)",
    "gpt-neox-20b": "  evaluate: bf16 on 1 GPU(s)",
    "megatron-gpt3-310.1b": "  evaluate: bf16 on 11 GPU(s)",
}


@pytest.mark.parametrize("name", ["pythia-12b", "gpt-neox-20b", "megatron-gpt3-310.1b"])
def test_layouts_plan_through_the_slurm_profile(name, tmp_path):
    """`snakemake --profile <profiles/slurm with the header's nodes> -n train`, with the data
    recipe and the layout: the data recipe's jobs, and training as one srun of nodes x 8
    ranks. A dry run submits nothing, so it needs no cluster."""
    layout = REPO / "config" / "examples" / "layouts" / f"{name}.yaml"
    recipe, nodes = layout_recipe(layout)
    cmd = [
        str(BIN / "snakemake"), "-n", "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(tmp_path), "--profile", str(slurm_profile(tmp_path / "profile", nodes)),
        "--replace-workflow-config", "--configfile", str(recipe), str(layout),
    ]  # fmt: skip
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert out.returncode == 0, out.stdout[-3000:]
    assert job_counts(out.stdout) == PLANS[recipe.stem]
    assert f"srun --kill-on-bad-exit=1 --nodes={nodes} --ntasks-per-node=8 " in out.stdout
    # the jobs after training, sized from the model on the profile's 80 GB GPUs (issue 24):
    # fp32 on one GPU where it fits, else bf16 over the fewest GPUs; past one node, a warning
    assert EVALUATE_PLANS[name] in out.stdout, out.stdout[-3000:]
    assert "  export_hf: " in out.stdout
    warned = "evaluation across nodes is not supported" in out.stdout
    assert warned == (name == "megatron-gpt3-310.1b")


def test_the_largest_layout_is_refused_on_the_shipped_profile(tmp_path):
    """Megatron's 310B layout (tensor 8 x pipeline 16 = 128 ranks a copy) on the shipped
    profile's 8 ranks (1 node x 8 GPUs): refused at -n with the way on named, not after the
    queue."""
    layout = REPO / "config" / "examples" / "layouts" / "megatron-gpt3-310.1b.yaml"
    recipe, _ = layout_recipe(layout)
    cmd = [
        str(BIN / "snakemake"), "-n", "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(tmp_path), "--profile", str(REPO / "profiles" / "slurm"),
        "--replace-workflow-config", "--configfile", str(recipe), str(layout),
    ]  # fmt: skip
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert out.returncode != 0
    assert (
        "train.tensor_parallel 8 x train.pipeline_parallel 16 = 128 does not divide the 8 "
        "training ranks; give the training rule a multiple of 128 ranks"
    ) in out.stdout


def test_examples_cover_the_recipes():
    assert {p.stem for p in EXAMPLES} == set(PLANS) >= {"neox-pile-enwik8", "megatron-oscar-gpt2"}
    assert all((REPO / "config" / "examples" / f"{name}.yaml").is_file() for name in ELSEWHERE)
