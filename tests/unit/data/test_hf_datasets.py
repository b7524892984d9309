"""type: hf -- Hugging Face datasets read with the datasets library, on datasets built on disk
here (no network, ever): the same shards as the same text through type: local, and the one
line a plan prints when the library is missing or a Hub dataset is not in the cache offline."""

import itertools
import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gptflow.data.hf import collect_hf_documents
from gptflow.data.readers import collect_local_documents
from gptflow.data.shards import tokenize_to_shard
from gptflow.data.sources import local_shards, resolve_dataset
from tests.support.hub import Hub
from tests.support.ports import refused_port

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


@pytest.mark.parametrize("batch_rows", [1, 3, 4, 1000])
def test_every_shard_holds_every_non_empty_row_of_its_range(
    tmp_path, hf_cache, monkeypatch, batch_rows
):
    """23 rows (every fifth empty) cut into 1, 2, 3, 5 and 23 shards, read BATCH_ROWS rows at a
    time (fewer than a shard's rows, one, and more than the split): the shards' documents,
    in order, are every non-empty row exactly once, each with its own row number, and the
    manifests' ranges tile [0, 23)."""
    import gptflow.data.hf

    monkeypatch.setattr(gptflow.data.hf, "BATCH_ROWS", batch_rows)
    texts = ["" if i % 5 == 3 else f"row {i}\n" for i in range(23)]
    saved = tmp_path / "saved"
    hf_cache.Dataset.from_dict({"text": texts}).save_to_disk(str(saved))
    want = [(i, t) for i, t in enumerate(texts) if t]
    for shards in (1, 2, 3, 5, 23):
        d = resolve({"type": "hf", "path": str(saved), "shards": shards})
        got, ranges = [], []
        for i in range(shards):
            jsonl = tmp_path / f"{shards}-{i}.jsonl"
            manifest = collect_hf_documents(d.hf, i, shards, jsonl)
            start, stop = manifest["rows"]
            docs = [(doc["row"], doc["text"]) for doc in map(json.loads, jsonl.open())]
            assert all(start <= row < stop for row, _ in docs), (shards, i)
            ranges.append((start, stop))
            got += docs
        assert got == want, shards
        assert ranges[0][0] == 0 and ranges[-1][1] == len(texts), ranges
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), ranges


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


def run_checks(tmp_path, env, specs, prelude=""):
    """gptflow.data.hf.check_planned on a dataset of each of `specs`, in one fresh Python with
    `env` (after `prelude`): per spec, its one line, or its warnings ('WARNING: ...') and 'ok'."""
    script = textwrap.dedent(
        f"""
        {prelude}
        from gptflow.data.hf import check_planned
        from gptflow.data.sources import resolve_dataset
        from gptflow.errors import GptflowError
        for spec in {specs!r}:
            d = resolve_dataset("wiki", spec, catalog={{}}, catalog_path="-", source="my.yaml")
            try:
                for warning in check_planned({{"wiki": d}}, "my.yaml") or []:
                    print("WARNING:", warning)
                print("ok")
            except GptflowError as e:
                print(e)
            print("--")
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
    return [block.splitlines() for block in out.stdout.split("--\n")[:-1]]


def run_check(tmp_path, env, spec, prelude=""):
    """run_checks of one spec."""
    (lines,) = run_checks(tmp_path, env, [spec], prelude)
    return lines


@pytest.fixture
def hub():
    server = Hub({"wikitext": ["main", "v1"]})
    yield server
    server.close()


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


def test_online_a_hub_dataset_is_asked_for_once_and_a_missing_one_is_one_line(tmp_path, hub):
    """Online (HF_ENDPOINT at a loopback Hub): one request per Hub dataset at planning; an
    existing dataset plans, a missing path or revision is one line naming the key, the value
    and the fix. Offline, the Hub is not asked (the cache is, as before)."""
    online = {"HF_ENDPOINT": hub.url}
    missing_dir = tmp_path / "no" / "such dir"  # not a directory here, and not a Hub name
    specs = [
        WIKITEXT,
        {**WIKITEXT, "revision": "v1"},
        {**WIKITEXT, "path": "nobody/wikitxt"},
        {**WIKITEXT, "revision": "v9"},
        {**WIKITEXT, "path": str(missing_dir)},
    ]
    found, revision, missing, bad_revision, bad_name = run_checks(tmp_path, online, specs)
    assert found == revision == ["ok"]
    assert missing == [
        f"my.yaml: datasets.wiki.path is 'nobody/wikitxt': no dataset of that name on the Hub "
        f"({hub.url}: 404 Repository not found) and no directory {Path.cwd() / 'nobody/wikitxt'}"
        f" here; set it to a Hub dataset name (e.g. 'Salesforce/wikitext') or an existing "
        f"directory (a private dataset also needs a token: hf auth login, or HF_TOKEN)"
    ]
    assert bad_revision == [
        f"my.yaml: datasets.wiki.revision is 'v9': 'wikitext' on the Hub ({hub.url}) has no "
        f"such branch, tag or commit; set revision to one it has, or null for the default branch"
    ]
    (line,) = bad_name
    assert line.startswith(
        f"my.yaml: datasets.wiki.path is {str(missing_dir)!r}: no directory {missing_dir} here, "
        f"and not a Hub dataset name ("
    )
    assert hub.asked == [  # one request per Hub name; the invalid one not sent
        "/api/datasets/wikitext",
        "/api/datasets/wikitext/revision/v1",
        "/api/datasets/nobody/wikitxt",
        "/api/datasets/wikitext/revision/v9",
    ]

    offline = {**online, "HF_HUB_OFFLINE": "1"}
    (line,) = run_check(tmp_path, offline, {**WIKITEXT, "path": "nobody/wikitxt"})
    assert "cannot be loaded offline (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE)" in line
    assert len(hub.asked) == 4


def test_online_an_unreachable_hub_is_a_warning_and_planning_does_not_wait(tmp_path):
    """A Hub that refuses connections, or accepts and never answers (a listening socket that
    never accepts: the kernel completes the handshake), plans with a warning naming the
    dataset, the endpoint and what to do where jobs have no internet -- within the request's
    timeout (HUB_TIMEOUT_S, lowered here), not a hang. Not an error: the Hub may be down for a
    minute, or the dataset cached already (the job's load_dataset falls back to the cache)."""
    short = "import gptflow.data.hf; gptflow.data.hf.HUB_TIMEOUT_S = 0.5"
    with refused_port() as port:
        refused, ok = run_check(tmp_path, {"HF_ENDPOINT": f"http://127.0.0.1:{port}"}, WIKITEXT)
    assert ok == "ok"
    assert refused.startswith(
        f"WARNING: my.yaml: datasets.wiki ('wikitext'): could not ask the Hub "
        f"(http://127.0.0.1:{port}) whether it exists (ConnectionRefusedError: "
    )
    assert refused.endswith(
        "planned without that check: its collect job downloads it. Where jobs have no "
        'internet, fetch it on a login node with the same HF_HOME (python -c "from datasets '
        "import load_dataset; load_dataset('wikitext', 'wikitext-2-raw-v1', split='train')\") "
        "and plan with HF_HUB_OFFLINE=1"
    )
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        silence, ok = run_check(tmp_path, {"HF_ENDPOINT": endpoint}, WIKITEXT, short)
        took = time.monotonic() - started
    assert ok == "ok"
    assert f"could not ask the Hub ({endpoint}) whether it exists (TimeoutError: " in silence
    assert took < 30, took  # a fresh Python importing datasets, then 0.5 s


def test_the_data_card_names_the_dataset_its_configuration_and_split():
    """The report's data card: an hf dataset's origin is its path, name, split and revision
    (not its configuration name alone)."""
    from gptflow.results.report import _origin

    assert _origin({**WIKITEXT, "revision": None}) == "hf: wikitext wikitext-2-raw-v1 train"
    assert _origin({**WIKITEXT, "revision": "v1"}) == "hf: wikitext wikitext-2-raw-v1 train v1"
