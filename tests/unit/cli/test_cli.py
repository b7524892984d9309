"""The README's command-line promises, through the installed `gptflow` command: `catalog`
lists the catalog, `convert-tokenizer` turns GPT-2 vocab.json + merges.txt into a tokenizer
that tokenizes exactly as the original, and bad input is one line naming what and how to fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
GPTFLOW = str(Path(sys.executable).parent / "gptflow")

# the catalog the README names, in the order of config/datasets.yaml
README_DATASETS = ["enwik8", "pile", "pile_subset", "pile_val", "pile_test", "oscar_1gb", "oscar",
                   "wikitext-2", "wikitext-103", "pile-10k"]  # fmt: skip


def gptflow(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([GPTFLOW, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_catalog_lists_every_dataset_with_its_size_and_gating():
    out = gptflow("catalog")
    assert out.returncode == 0, out.stderr
    catalog = yaml.safe_load((REPO / "config/datasets.yaml").read_text())
    lines = out.stdout.splitlines()
    assert list(catalog) == README_DATASETS
    for line, (name, entry) in zip(lines, catalog.items(), strict=True):
        words = line.split()
        assert words[0] == name, line
        if "size_gb" in entry:
            assert words[1:3] == [f"{entry['size_gb']:g}", "GB"], line
        else:
            assert words[1].rstrip(",") == "?", line
        assert ("gated" in line) == bool(entry.get("gated")), line
        assert entry["description"].split(". ")[0] in line, line
    assert "oscar" in {line.split()[0] for line in lines if ", gated" in line}


def test_catalog_of_a_given_file_prints_one_exact_line_per_entry(tmp_path):
    (tmp_path / "cat.yaml").write_text(
        "web:\n  description: Some web text. More words.\n  size_gb: 1.5\n"
        "secret:\n  description: Needs a token\n  gated: true\n"
    )
    out = gptflow("catalog", "--catalog", str(tmp_path / "cat.yaml"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{'web':14s} {'1.5 GB':>9s}  Some web text",
        f"{'secret':14s} {'?':>9s}, gated  Needs a token",
    ]


def test_catalog_outside_the_checkout_names_the_file_and_the_fix(tmp_path):
    out = gptflow("catalog", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("gptflow catalog: error: config/datasets.yaml: no such file"), line
    assert "--catalog" in line  # how to fix it


def test_version_prints_what_gptflow_runs_on_one_per_line():
    """gptflow.environment.versions(), which reads them from the distributions' metadata."""
    from importlib import metadata

    out = gptflow("--version")
    assert out.returncode == 0 and out.stderr == ""
    lines = out.stdout.splitlines()
    assert lines[:6] == [
        f"gptflow {__import__('gptflow').__version__}",
        f"python {sys.version.split()[0]}",
        f"torch {metadata.version('torch')}",
        f"deepspeed {metadata.version('deepspeed')}",
        f"snakemake {metadata.version('snakemake')}",
        f"snakemake-executor-plugin-slurm {metadata.version('snakemake-executor-plugin-slurm')}",
    ]
    assert lines[6:] in ([], [f"cuda {__import__('torch').version.cuda}"])


def test_summary_without_a_finished_run_says_how_to_make_one(tmp_path):
    out = gptflow("summary", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        "gptflow summary: error: no finished runs under results/runs/ (no DONE.json); "
        "run `make run`"
    ]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory, tokenizer_json):
    """vocab.json + merges.txt in GPT-2's layout, from the session's trained ByteLevel BPE."""
    from gptflow.data.tokenizer import load_tokenizer

    out = tmp_path_factory.mktemp("gpt2")
    model = json.loads(load_tokenizer(tokenizer_json).to_str())["model"]
    (out / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert len(merges) > 200
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return out / "vocab.json", out / "merges.txt"


def test_convert_tokenizer_tokenizes_the_corpus_exactly_as_the_original(
    tmp_path, gpt2_files, tokenizer_json, corpus_jsonl, shards
):
    """The converted tokenizer gives byte-identical shards to the original's (`gptflow
    tokenize` on a whole corpus shard), and equals transformers' GPT2Tokenizer (an independent,
    pure-Python reader of vocab.json + merges.txt) text by text."""
    from transformers import GPT2Tokenizer

    from gptflow.data.readers import iter_texts
    from gptflow.data.tokenizer import load_tokenizer

    vocab, merges = gpt2_files
    out = tmp_path / "tokenizer.json"
    run = gptflow("convert-tokenizer", "--vocab", str(vocab), "--merges", str(merges),
                  "--out", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"{out}: GPT-2 BPE, 512 tokens"
    converted = load_tokenizer(out)
    assert converted.token_to_id("<|endoftext|>") == 0

    prefix = tmp_path / "converted"
    run = gptflow("tokenize", "--input", str(corpus_jsonl[0]), "--tokenizer", str(out),
                  "--output-prefix", str(prefix), "--append-eod")  # fmt: skip
    assert run.returncode == 0, run.stderr
    for ext in (".bin", ".idx"):
        assert Path(f"{prefix}{ext}").read_bytes() == Path(f"{shards[0]}{ext}").read_bytes()

    reference = GPT2Tokenizer(str(vocab), str(merges))
    original = load_tokenizer(tokenizer_json)
    texts = [*list(iter_texts(corpus_jsonl[1]))[:10], "naïve café — 日本語 🙂\n\tdef x(): pass"]
    for text in texts:
        ids = converted.encode(text).ids
        assert ids == original.encode(text).ids, text[:80]
        assert ids == reference.encode(text), text[:80]
        assert converted.decode(ids) == text
    # like Megatron's GPT2BPETokenizer, a literal "<|endoftext|>" in a text is text
    literal = "a <|endoftext|> b"
    assert converted.encode(literal).ids == reference.encode(literal, split_special_tokens=True)
    assert 0 not in converted.encode(literal).ids


def test_convert_tokenizer_with_a_missing_merges_file_names_it(tmp_path, gpt2_files):
    vocab, _ = gpt2_files
    out = tmp_path / "tokenizer.json"
    run = gptflow("convert-tokenizer", "--vocab", str(vocab), "--merges",
                  str(tmp_path / "nope.txt"), "--out", str(out))  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"gptflow convert-tokenizer: error: {tmp_path / 'nope.txt'}: no such file"
    ]
    assert not out.exists() and not list(tmp_path.glob(".*"))


def test_the_data_subcommands_start_without_importing_torch(tmp_path, tokenizer_json):
    """`gptflow tokenize` (a Snakemake job per shard or part) and the other data subcommands
    import neither torch nor DeepSpeed: ~1.3 s of CPU per job (each test that starts the CLI
    paid it) since the run lock's wait (checkpoint.LOCK_WAIT_S, a default of `gptflow train`)
    came with checkpoint's import of the snapshot writer, and with it torch."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "def f(): pass"}\n')
    args = ["tokenize", "--input", str(src), "--tokenizer", str(tokenizer_json),
            "--output-prefix", str(tmp_path / "out"), "--append-eod"]  # fmt: skip
    code = (
        "import json, sys; from gptflow.cli import main; code = main(sys.argv[1:]); "
        "print(json.dumps([code, *(m in sys.modules for m in ('torch', 'deepspeed'))]))"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [0, False, False]
    assert (tmp_path / "out.bin").stat().st_size > 0
