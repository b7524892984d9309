"""type: hf -- Hugging Face datasets read with the datasets library, on datasets built on disk
here (no network, ever): the same shards as the same text through type: local, and the one
line a plan prints when the library is missing or a Hub dataset is not in the cache offline."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gptflow.data.hf import collect_hf_documents
from gptflow.data.readers import collect_local_documents
from gptflow.data.sources import local_shards, resolve_dataset
from gptflow.data.tokenize import tokenize_to_shard

# Rows as a Hub text dataset has them: wikitext-like lines, an empty row and a whitespace row
# (dropped, as an empty file of a local dataset is), non-ASCII text.
TEXTS = [
    " = Valkyria Chronicles III = \n",
    "",
    " Senjō no Valkyria 3 : Unrecorded Chronicles is a tactical role @-@ playing game .\n",
    "   \n",
    "def f(x):\n    return {'a': x}\n",
    "Ünïcödé — ✓ and tabs\tinside.\n",
    " The game began development in 2010 , carrying over a large portion of the work .\n",
]


def resolve(spec):
    return resolve_dataset("d", spec, catalog={}, catalog_path="-", source="my.yaml")


def shard_bytes(prefix):
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def local_token_shards(tmp_path, tokenizer_json, num_shards, texts=TEXTS, manifests=None):
    """`texts` as a type: local dataset (one file per row, in order) -> token shard bytes
    (and each shard's collect manifest appended to `manifests`)."""
    root = tmp_path / "local"
    root.mkdir(parents=True)
    for i, text in enumerate(texts):
        # newline="": written as given (a U+2028 or CR row stays that row's bytes)
        (root / f"row{i:03d}.txt").write_text(text, encoding="utf-8", newline="")
    spec = {"root": str(root), "include": ["*.txt"], "shards": num_shards}
    out = []
    for i, files in enumerate(local_shards("d", spec)):
        jsonl = tmp_path / f"local{i}.jsonl"
        manifest = collect_local_documents(files, root, jsonl)
        if manifests is not None:
            manifests.append(manifest)
        tokenize_to_shard([str(jsonl)], str(tokenizer_json), str(tmp_path / f"local{i}"))
        out.append(shard_bytes(tmp_path / f"local{i}"))
    return out


def hf_token_shards(tmp_path, tokenizer_json, spec, tag):
    """A type: hf dataset entry -> (token shard bytes, manifests), through collect_hf_documents."""
    d = resolve({"type": "hf", **spec})
    out, manifests = [], []
    for i, shard in enumerate(d.shards):
        jsonl = tmp_path / f"{tag}{i}.jsonl"
        manifests.append(collect_hf_documents(d.hf, int(shard.name), len(d.shards), jsonl))
        tokenize_to_shard([str(jsonl)], str(tokenizer_json), str(tmp_path / f"{tag}{i}"))
        out.append(shard_bytes(tmp_path / f"{tag}{i}"))
    return out, manifests


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """The datasets library offline, its cache in tmp_path (load_dataset of a directory of data
    files writes Arrow files there)."""
    import datasets  # the test extra installs it (gptflow[hf-datasets]): missing is a failure

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return datasets


def test_hf_shards_equal_local_shards_of_the_same_text(tmp_path, tokenizer_json, hf_cache):
    """The same rows as a saved DatasetDict (2 shards: contiguous row ranges, like a local
    dataset's file ranges) and as a directory of JSON lines (streamed, 1 shard) give
    byte-identical .bin/.idx to type: local; the manifest names the split and its fingerprint."""
    datasets = hf_cache
    saved = tmp_path / "saved"
    train = datasets.Dataset.from_dict({"id": list(range(len(TEXTS))), "text": TEXTS})
    other = datasets.Dataset.from_dict({"id": [0], "text": ["not this split"]})
    datasets.DatasetDict({"train": train, "validation": other}).save_to_disk(str(saved))
    files = tmp_path / "files"
    files.mkdir()
    train.to_json(str(files / "train.jsonl"))

    shards, manifests = hf_token_shards(
        tmp_path, tokenizer_json, {"path": str(saved), "split": "train", "shards": 2}, "saved"
    )
    assert shards == local_token_shards(tmp_path / "two", tokenizer_json, 2)
    fingerprint = datasets.load_from_disk(str(saved))["train"]._fingerprint
    assert [(m["rows"], m["documents"], m["dropped"], m["fingerprint"]) for m in manifests] == [
        ([0, 4], 2, {"empty": 2}, fingerprint),
        ([4, 7], 3, {}, fingerprint),
    ]
    assert manifests[0] | {"path": str(saved), "name": None, "split": "train"} == manifests[0]
    assert manifests[0]["revision"] is None and manifests[0]["split_rows"] == len(TEXTS)

    streamed, (manifest,) = hf_token_shards(
        tmp_path, tokenizer_json, {"path": str(files), "streaming": True}, "streamed"
    )
    assert streamed == local_token_shards(tmp_path / "one", tokenizer_json, 1)
    assert (manifest["rows"], manifest["documents"], manifest["streaming"]) == ([0, 7], 5, True)


# Rows of Unicode whitespace only: NBSP, the ideographic space, the line and paragraph
# separators, a narrow NBSP with ASCII space and newline. Empty, as "   " is, on both paths.
UNICODE_BLANK = ["\u00a0", "\u3000\n", "\u2028", "\u2029\u202f \n", " \t\r\n"]


def test_rows_of_unicode_whitespace_are_empty_for_hf_and_local_alike(
    tmp_path, tokenizer_json, hf_cache
):
    """One rule for "empty" (gptflow.data.readers.blank): rows holding only Unicode
    whitespace are dropped and counted by type: hf and type: local alike, the text around
    them kept, and the two give byte-identical shards. (Megatron's preprocess_data has no
    files-to-documents step; it tokenizes the JSONL these steps write, as ours does.)"""
    texts = ["first \u00a0 text\n", *UNICODE_BLANK, "\u3000last\u2028text\n"]
    saved = tmp_path / "saved"
    hf_cache.Dataset.from_dict({"text": texts}).save_to_disk(str(saved))
    shards, (hf_manifest,) = hf_token_shards(
        tmp_path, tokenizer_json, {"path": str(saved), "shards": 1}, "saved"
    )
    local_manifests = []
    assert shards == local_token_shards(
        tmp_path / "local", tokenizer_json, 1, texts, local_manifests
    )
    blank = len(UNICODE_BLANK)
    assert (hf_manifest["documents"], hf_manifest["dropped"]) == (2, {"empty": blank})
    assert [(m["documents"], m["dropped"]) for m in local_manifests] == [(2, {"empty": blank})]


def run_check(tmp_path, env, spec):
    """gptflow.data.hf.check_planned on a dataset of `spec` in a fresh Python with `env`: its
    one line (stdout), or 'ok'."""
    script = textwrap.dedent(
        f"""
        from gptflow.data.hf import check_planned
        from gptflow.data.sources import resolve_dataset
        from gptflow.errors import GptflowError
        d = resolve_dataset("wiki", {spec!r}, catalog={{}}, catalog_path="-", source="my.yaml")
        try:
            check_planned({{"wiki": d}}, "my.yaml")
            print("ok")
        except GptflowError as e:
            print(e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={"PATH": "/usr/bin:/bin", "HF_HOME": str(tmp_path / "hf-home"), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


WIKITEXT = {"type": "hf", "path": "wikitext", "name": "wikitext-2-raw-v1", "split": "train"}


def test_without_the_datasets_library_planning_names_the_install_command(tmp_path):
    """A Python in which `import datasets` fails (a datasets package raising ImportError, first
    on sys.path): one line naming pip install 'gptflow[hf-datasets]'."""
    broken = tmp_path / "shadow" / "datasets"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('datasets is not installed here')\n")
    assert run_check(tmp_path, {"PYTHONPATH": str(tmp_path / "shadow")}, WIKITEXT) == [
        f"my.yaml: datasets.wiki is a Hugging Face dataset, but the datasets library cannot be "
        f"imported in {sys.prefix} (datasets is not installed here); install it with pip "
        f"install 'gptflow[hf-datasets]'"
    ]


def test_offline_a_hub_dataset_not_in_the_cache_is_one_line_with_the_fetch_command(tmp_path):
    """HF_DATASETS_OFFLINE=1 and an empty cache: one line naming the dataset and the command
    that fetches it (the datasets library's own offline refusal, caught); online, the plan
    leaves the download to the job (nothing is fetched: the check returns before)."""
    (line,) = run_check(tmp_path, {"HF_DATASETS_OFFLINE": "1"}, WIKITEXT)
    assert line.startswith(
        "my.yaml: datasets.wiki ('wikitext', name 'wikitext-2-raw-v1', split 'train'): cannot "
        "be loaded offline (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE) from the cache "
        f"{tmp_path / 'hf-home' / 'datasets'} ("
    )
    assert line.endswith(
        '); fetch it on a login node with the same HF_HOME: python -c "from datasets import '
        "load_dataset; load_dataset('wikitext', 'wikitext-2-raw-v1', split='train')\""
    )
    assert run_check(tmp_path, {}, WIKITEXT) == ["ok"]


def test_the_data_card_names_the_dataset_its_configuration_and_split():
    """The report's data card: an hf dataset's origin is its path, name, split and revision
    (not its configuration name alone)."""
    from gptflow.report import _origin

    assert _origin({**WIKITEXT, "revision": None}) == "hf: wikitext wikitext-2-raw-v1 train"
    assert _origin({**WIKITEXT, "revision": "v1"}) == "hf: wikitext wikitext-2-raw-v1 train v1"
