"""Config validation and the helpers rules call; every rule-level computation lives here."""

from pathlib import Path

from snakemake.exceptions import WorkflowError

from gptflow.config import load_workflow_config
from gptflow.data import sources
from gptflow.environment import put_interpreter_bin_first
from gptflow.errors import GptflowError

REPO = Path(workflow.basedir)
put_interpreter_bin_first()  # jobs run the `gptflow` installed beside this Snakemake
CONFIG_SOURCE = " + ".join(str(p) for p in workflow.configfiles) or "--config"

try:
    CFG = load_workflow_config(
        config,
        schema_path=REPO / "config" / "schema" / "config.schema.yaml",
        models_dir=REPO / "config" / "models",
        source=CONFIG_SOURCE,
    )
except GptflowError as e:
    raise WorkflowError(f"gptflow config: {e}") from None

RUN = CFG["run"]
TOKENIZER = CFG["tokenizer"]["name"]
BLENDED = [item["dataset"] for item in CFG["data"]["blend"]]


wildcard_constraints:
    dataset="[A-Za-z0-9][A-Za-z0-9_-]*",
    shard=r"\d{5}",
    run=RUN,
    tokenizer=TOKENIZER,


# --------------------------------------------------------------------------- datasets


def needed_datasets():
    names = list(BLENDED)
    if CFG["tokenizer"]["source"] == "train":
        names += [n for n in CFG["tokenizer"]["train"]["datasets"] if n not in names]
    return names


def list_shards(dataset):
    """{shard name: [files]} of a local dataset, from the config's globs."""
    shards = sources.local_shards(dataset, CFG["datasets"][dataset], CONFIG_SOURCE)
    return dict(zip(sources.shard_names(len(shards)), shards))


# Globs are resolved once, here, so that one matching nothing stops the workflow at once.
try:
    SHARDS = {name: list_shards(name) for name in needed_datasets()}
except GptflowError as e:
    raise WorkflowError(f"gptflow config: {e}") from None


def local_shards(dataset):
    return SHARDS[dataset]


def shard_names(dataset):
    return list(local_shards(dataset))


def get_local_shard_files(wildcards):
    return [str(p) for p in local_shards(wildcards.dataset)[wildcards.shard]]


def get_local_root(wildcards):
    return CFG["datasets"][wildcards.dataset]["root"]


def documents_path(dataset, shard):
    return f"results/documents/{dataset}/{shard}.jsonl"


# --------------------------------------------------------------------------- tokenizer


def tokenizer_json():
    return f"results/tokenizers/{TOKENIZER}/tokenizer.json"


def get_tokenizer_documents(wildcards):
    return [
        documents_path(name, shard)
        for name in CFG["tokenizer"]["train"]["datasets"]
        for shard in shard_names(name)
    ]


def get_tokenizer_file(wildcards):
    return CFG["tokenizer"]["path"]


def get_eod_token(wildcards):
    return CFG["tokenizer"]["eod_token"]


# --------------------------------------------------------------------------- shards


def shard_prefix(dataset, shard):
    return f"results/tokens/{TOKENIZER}/{dataset}/{shard}"


def get_shard_documents(wildcards):
    return documents_path(wildcards.dataset, wildcards.shard)


def get_append_eod_flag(wildcards):
    return "--append-eod" if CFG["tokenize"]["append_eod"] else ""


def dataset_prefixes(dataset):
    return [shard_prefix(dataset, s) for s in shard_names(dataset)]


def get_blend_prefixes(wildcards):
    return {name: dataset_prefixes(name) for name in BLENDED}


def get_blend_shard_files(wildcards):
    return [
        f"{prefix}{ext}"
        for name in BLENDED
        for prefix in dataset_prefixes(name)
        for ext in (".bin", ".idx", ".json")
    ]


# --------------------------------------------------------------------------- training


def run_dir():
    return f"results/runs/{RUN}"


def get_run_settings(wildcards):
    """What run.yaml is rendered from: a change here re-renders it (and so reruns training)."""
    return {
        "run": CFG["run"],
        "tokenizer": {"eod_token": CFG["tokenizer"]["eod_token"]},
        "data": CFG["data"],
        "model": CFG["model"],
        "train": CFG["train"],
    }


def get_train_hyperparameters(wildcards):
    """Model and optimisation settings; Snakemake reruns training when one changes."""
    return {"model": CFG["model"], "train": CFG["train"], "data": CFG["data"]}


def get_train_launcher(wildcards):
    """Empty on one machine; the Slurm profile sets resources mpi="srun"."""
    return ""


def get_final_outputs():
    return [f"{run_dir()}/DONE.json"]
