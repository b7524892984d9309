"""``gptflow`` subcommands of the data stages: download, catalog, sample-documents,
convert-tokenizer, train-tokenizer, tokenize, count-documents, merge, import-megatron, inspect
(their place in ``gptflow --help``: :data:`gptflow.cli.COMMANDS`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gptflow.errors import GptflowError


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
    from gptflow.data.engines import ENGINES

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
        choices=ENGINES,
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
    from gptflow.data.shards import read_counts, tokenize_to_shard

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
    from gptflow.data.shards import count_documents

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


def add_merge_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--input", nargs="+", required=True, metavar="PREFIX", help="shards, in order")
    s.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json"
    )


def cmd_merge(a: argparse.Namespace) -> int:
    from gptflow.data.shards import merge_shards

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
