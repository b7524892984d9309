"""Where the workflow's files live: each path pattern once, for the rules and the package.

The patterns are relative to the working directory (DESIGN.md, Outputs) and use the rules'
wildcard names: Snakemake fills them in rules (``output: paths.RUN_YAML``), the package with
the functions below. A run's files are found through the run directory that run.yaml records
(``run_dir``), not through :data:`RUN_DIR`: :func:`in_run_dir` puts a run pattern there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

# downloads, each with a NAME.sha256 sidecar; SHA256SUMS records the first verified digest
RAW_FILE = "resources/raw/{dataset}/{file}"
RAW_SHA256SUMS = "resources/raw/{dataset}/SHA256SUMS"
TOKENIZER_FILE = "resources/tokenizers/{tokenizer}/{key}/{file}"  # key: url, vocab, merges
TOKENIZER_SHA256SUMS = "resources/tokenizers/{tokenizer}/SHA256SUMS"

# documents collected from local files, and the document counts of inputs cut into parts
DOCUMENTS = "results/documents/{dataset}/{shard}.jsonl"
DOCUMENTS_MANIFEST = "results/documents/{dataset}/{shard}.manifest.json"
DOCUMENT_COUNT = "results/documents/{dataset}/{shard}.count.json"

# data.quality: each step's outputs under its name NN-KIND-KEY (gptflow.data.quality.recipe);
# a deduplication group ({group}: _blend or a dataset) shares one removal list
QUALITY_DOCUMENTS = "results/quality/{step}/{dataset}/{shard}.jsonl"
QUALITY_MANIFEST = "results/quality/{step}/{dataset}/{shard}.manifest.json"
# each kept document's ordinal in the collected shard (gptflow.data.quality.origins)
QUALITY_ORIGINS = "results/quality/{step}/{dataset}/{shard}.origins.npy"
EXACT_HASHES = "results/quality/{step}/{dataset}/{shard}.hashes"
MINHASH_SIGNATURES = "results/quality/{step}/{dataset}/{shard}.minhash.npy"
MINHASH_PAIRS = "results/quality/{step}/groups/{group}/band{band}.pairs.npy"
FILTER_SIGNALS = "results/quality/{signals}/{dataset}/{shard}.signals.jsonl"  # one line a document
LANGUAGE_SCORES = "results/quality/{scores}/{dataset}/{shard}.language.jsonl"  # one line a document
QUALITY_REMOVED = "results/quality/{step}/groups/{group}.remove.npy"
QUALITY_GROUP_STATS = "results/quality/{step}/groups/{group}.json"
QUALITY_PAGE = "results/quality/report/data-quality.html"  # the report's "Data quality" page
QUALITY_SUMMARY = (
    "results/quality/report/data-quality.json"  # its numbers (a study page reads them)
)

TOKENIZER_SAMPLE = "results/tokenizers/{tokenizer}/samples/{dataset}.jsonl"
TOKENIZER_JSON = "results/tokenizers/{tokenizer}/tokenizer.json"

# token shards: PREFIX.bin, PREFIX.idx and the manifest PREFIX.json
SHARD_FILES = (".bin", ".idx", ".json")
SHARD = "results/tokens/{tokenizer}/{dataset}/{shard}"
PART = "results/tokens/{tokenizer}/{dataset}/{shard}-{part}"  # tokenize.documents_per_shard
MERGED = "results/tokens/{tokenizer}/{dataset}/merged"  # tokenize.merge
# a study run's own data.quality recipe (a data ablation): a dataset's shards tokenized from
# that recipe's documents; {variant} is its last step's name, or 'raw' (the collected ones)
VARIANT_SHARD = "results/tokens/{tokenizer}/{dataset}/{variant}/{shard}"

# the training image, named by its recipe hash (gptflow.container.image.recipe_hash)
IMAGE_RECORD = "results/containers/gptflow-{hash}.json"
IMAGE = "results/containers/gptflow-{hash}.{format}"  # format: sqsh or sif

# the data index (document, sample and shuffle indices) of every run that reads the same
# samples of the same shards: named by gptflow.train.run_config.data_index_name, shared by a study
DATA_INDEX = "results/data-index/{index}.json"
DATA_INDEX_DIR = "results/data-index/{index}"

RUN_DIR = "results/runs/{run}"
RUN_YAML = "results/runs/{run}/run.yaml"
# a run's own data index, before indices were shared (a run.yaml without data_index)
RUN_DATA_INDEX = "results/runs/{run}/data-index.json"
RUN_DATA_INDEX_DIR = "results/runs/{run}/data-index"
CHECKPOINTS = "results/runs/{run}/checkpoints"  # not a Snakemake output (DESIGN.md)
TRAIN_LOCK = "results/runs/{run}/train.lock"
TRAIN_LOG = "results/runs/{run}/train.log"
METRICS = "results/runs/{run}/metrics.jsonl"
SAMPLES = "results/runs/{run}/samples.jsonl"  # train.log_samples: each rank's samples a step
TENSORBOARD_DIR = "results/runs/{run}/tensorboard"
WANDB_DIR = "results/runs/{run}/wandb"
DONE = "results/runs/{run}/DONE.json"
EVAL = "results/runs/{run}/eval.json"
HF_EXPORT = "results/runs/{run}/hf"
HARNESS = "results/runs/{run}/harness.json"  # eval.harness: lm-evaluation-harness
HARNESS_STEP = "results/runs/{run}/harness/step{step}.json"  # eval.harness.every
HARNESS_PAGE = "results/runs/{run}/report/harness.html"  # its tables and curves
HARNESS_CURVE = "results/runs/{run}/report/harness_curve.svg"
REPORT_DIR = "results/runs/{run}/report"
REPORT_CARD = "results/runs/{run}/report/card.html"

OUT_OF_MEMORY_DIR = "results/runs/{run}/out_of_memory"  # an autotune trial's ranks that ran out

# autotune (workflow config `autotune`): its trials are results/runs/{run}.tune.*/, its ranking
# the run's own (the run trains after it, with best.yaml)
AUTOTUNE_DIR = "results/runs/{run}/autotune"
AUTOTUNE_JSON = "results/runs/{run}/autotune/autotune.json"
AUTOTUNE_PAGE = "results/runs/{run}/autotune/autotune.html"
AUTOTUNE_BEST = "results/runs/{run}/autotune/best.yaml"

# a study (workflow config `study`): its runs are results/runs/{run}/, its comparison here
STUDY_DIR = "results/studies/{study}"

# a job's log: logs/{rule}/{the job's wildcards}.log
LOG = "logs/{rule}/{job}.log"


def log(rule: str, job: str) -> str:
    """The log of a job of `rule`: ``log("train_gpt", "{run}")`` in a rule, or with the
    wildcards filled in (``log("train_gpt", "tiny")``)."""
    return LOG.format(rule=rule, job=job)


def in_run_dir(pattern: str, run_dir: str | os.PathLike) -> Path:
    """Run pattern `pattern` (one of the ``results/runs/{run}/...`` above) inside `run_dir`,
    the run directory run.yaml records."""
    return Path(run_dir) / PurePosixPath(pattern).relative_to(RUN_DIR)


def shard_files(prefix: str) -> list[str]:
    """PREFIX.bin, PREFIX.idx and PREFIX.json: the files of a token shard."""
    return [f"{prefix}{ext}" for ext in SHARD_FILES]


def shard_manifest(prefix: str) -> str:
    """PREFIX.json: written last and atomically by the job that makes the shard, with its .bin's
    and .idx's sha256, so it is new whenever they are: the one file of each shard that the jobs
    reading shards (the data index, run.yaml) take as input."""
    return f"{prefix}{SHARD_FILES[2]}"


def tokenizer_json(tokenizer: str) -> str:
    return TOKENIZER_JSON.format(tokenizer=tokenizer)


def shard_prefix(tokenizer: str, dataset: str, shard: str) -> str:
    return SHARD.format(tokenizer=tokenizer, dataset=dataset, shard=shard)


def variant_prefix(tokenizer: str, dataset: str, variant: str, shard: str) -> str:
    return VARIANT_SHARD.format(tokenizer=tokenizer, dataset=dataset, variant=variant, shard=shard)


def merged_prefix(tokenizer: str, dataset: str) -> str:
    return MERGED.format(tokenizer=tokenizer, dataset=dataset)


def part_prefix(tokenizer: str, dataset: str, shard: str, part: int | str) -> str:
    """Part `part` of a shard (documents_per_shard): 4 digits, or a glob such as ``*``."""
    part = f"{part:04d}" if isinstance(part, int) else part
    return PART.format(tokenizer=tokenizer, dataset=dataset, shard=shard, part=part)


def choice_pattern(names: Iterable[str]) -> str:
    """A regex matching exactly one of `names` (anchored at both ends; '' for no names): a
    wildcard constraint such as {run}'s. Written as a trie, each shared prefix once, so that a
    study's names (lr0.001-weight_decay0, lr0.001-weight_decay0.01, ...) make a pattern a
    fraction of their joined length: Snakemake compiles it into every output pattern holding
    the wildcard, a cost per character (a 100-run study: 0.5 kB, not 2.9 kB, per pattern)."""
    trie: dict = {}
    for name in names:
        node = trie
        for char in name:
            node = node.setdefault(char, {})
        node[""] = {}  # a name ends here
    return _trie_pattern(trie)


def _trie_pattern(node: dict) -> str:
    branches = [re.escape(char) + _trie_pattern(child) for char, child in node.items() if char]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
    if "" not in node:  # no name ends here
        return body
    return f"{body}?" if len(branches) > 1 else f"(?:{body})?"
