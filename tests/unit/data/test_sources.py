"""Dataset entries -> shards: the catalog, URL templates, overrides, and their errors."""

import pytest

from gptflow.config.schema import load_yaml
from gptflow.data.remote_files import load_catalog
from gptflow.data.sources import resolve_dataset
from gptflow.errors import GptflowError


@pytest.fixture(scope="module")
def schema(repo):
    return load_yaml(repo / "config/schema/config.schema.yaml")


@pytest.fixture(scope="module")
def catalog(repo, schema):
    return load_catalog(repo / "config/datasets.yaml", schema)


def resolve(name, spec, catalog):
    return resolve_dataset(
        name, spec, catalog=catalog, catalog_path="config/datasets.yaml", source="my.yaml"
    )


def test_catalog_has_the_promised_corpora(catalog):
    assert {"enwik8", "pile", "pile_subset", "pile_val", "pile_test", "oscar_1gb", "oscar"} <= set(
        catalog
    )
    assert all(entry.get("license") and entry.get("description") for entry in catalog.values())


def test_pile_expands_to_30_shards_with_mirrors(catalog):
    pile = resolve("pile", {"type": "catalog", "name": "pile"}, catalog)
    assert len(pile.shards) == 30
    first, last = pile.shards[0], pile.shards[-1]
    assert (
        first.input == "resources/raw/pile/00.jsonl.zst"
        and last.input == "resources/raw/pile/29.jsonl.zst"
    )
    assert first.remote.urls[0].endswith("/train/00.jsonl.zst") and len(first.remote.urls) == 2
    assert (first.fmt, first.json_key, first.name) == ("jsonl.zst", "text", "00000")


def test_overrides_narrow_a_catalog_entry(catalog):
    pile = resolve("pile", {"type": "catalog", "name": "pile", "parts": [3, 4]}, catalog)
    assert [s.input for s in pile.shards] == [
        "resources/raw/pile/03.jsonl.zst",
        "resources/raw/pile/04.jsonl.zst",
    ]
    oscar = resolve(
        "oscar",
        {"type": "catalog", "name": "oscar", "vars": {"lang": "de"}, "parts": [1, 2]},
        catalog,
    )
    assert oscar.shards[1].remote.urls[0].endswith("/de_meta/de_meta_part_2.jsonl.zst")
    assert oscar.shards[0].json_key == "content"
    assert (oscar.token_env, oscar.token_origins) == ("HF_TOKEN", ("https://huggingface.co",))


def test_enwik8_is_a_zip_member_read_as_one_document(catalog):
    e = resolve("enwik8", {"type": "catalog", "name": "enwik8"}, catalog)
    (shard,) = e.shards
    assert (shard.fmt, shard.member, shard.member_format) == ("zip", "enwik8", "txt")
    assert shard.reader_args() == [
        "--format",
        "zip",
        "--json-key",
        "text",
        "--member",
        "enwik8",
        "--member-format",
        "txt",
    ]


def test_errors_name_the_dataset_and_the_fix(catalog):
    with pytest.raises(
        GptflowError,
        match=r"datasets\.x\.name 'pyle' is not in the catalog .*entries: enwik8, oscar",
    ):
        resolve("x", {"type": "catalog", "name": "pyle"}, catalog)
    with pytest.raises(GptflowError, match=r"catalog entry 'enwik8' is a list of files, not a"):
        resolve("x", {"type": "catalog", "name": "enwik8", "parts": [0, 1]}, catalog)
    spec = {"type": "url", "url_template": "http://h/{lang}/{part}.jsonl", "parts": [0, 1]}
    with pytest.raises(GptflowError, match=r"needs \['lang', 'part'\] - set them with vars"):
        resolve("x", spec, catalog)
    dup = {"type": "url", "files": [{"url": "http://a/x.jsonl"}, {"url": "http://b/x.jsonl"}]}
    with pytest.raises(GptflowError, match=r"several files would be stored as \['x\.jsonl'\]"):
        resolve("x", dup, catalog)
    names = ["y", "x", "y", "z", "y", "x"]
    dup = {"type": "url", "files": [{"url": f"http://{i}/{n}.jsonl"} for i, n in enumerate(names)]}
    with pytest.raises(GptflowError, match=r"stored as \['x\.jsonl', 'y\.jsonl'\]; give"):
        resolve("x", dup, catalog)  # each name once, in order


def test_a_broken_catalog_entry_names_the_catalog(tmp_path, schema):
    bad = tmp_path / "datasets.yaml"
    bad.write_text("mine:\n  files: [{url: 'http://h/a.jsonl'}]\n  licence: typo\n")
    with pytest.raises(
        GptflowError,
        match=r"datasets\.yaml \(entry mine\): unknown key 'licence' \(did you mean 'license'\?\)",
    ):
        load_catalog(bad, schema)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://h/d/a%24(touch%20x).jsonl", "is not a plain file name"),  # $(...) decoded
        ("https://h/d/%60id%60.jsonl", "is not a plain file name"),  # backquotes
        ("https://h/d/..%2F..%2Fetc%2Fcron.jsonl", "is not a plain file name"),  # ../ decoded
        ("https://h/d/x%0A.jsonl", "is not a plain file name"),  # a newline
        ("https://h/d/-rf.jsonl", "is not a plain file name"),  # an option
        ("https://h/d/.hidden.jsonl", "is not a plain file name"),
        ("https://h/d/SHA256SUMS", "keeps for its own files"),
        ("https://h/d/x.jsonl.sha256", "keeps for its own files"),
        ("https://h/d/x.jsonl.part", "keeps for its own files"),
        ("https://h/d/" + "a" * 201 + ".jsonl", "longer than 200 bytes"),
    ],
)
def test_a_stored_name_from_a_url_is_a_plain_file_name(catalog, url, why):
    """A URL is someone else's text: the file name it gives becomes a path and a wildcard."""
    spec = {"type": "url", "format": "jsonl", "files": [{"url": url}]}
    with pytest.raises(GptflowError, match=rf"my\.yaml: .*stored name .*{why}.*set name:"):
        resolve("x", spec, catalog)
    named = {"type": "url", "format": "jsonl", "files": [{"url": url, "name": "x.jsonl"}]}
    assert resolve("x", named, catalog).shards[0].input == "resources/raw/x/x.jsonl"


def test_templated_names_are_checked_too(catalog):
    spec = {"type": "url", "url_template": "https://h/{v}-{part}.jsonl", "parts": [0, 0]}
    with pytest.raises(GptflowError, match=r"stored name '\$\(x\)-0\.jsonl'"):
        resolve("x", {**spec, "vars": {"v": "$(x)"}}, catalog)
    ok = resolve("x", {**spec, "vars": {"v": "en_part+1"}}, catalog)
    assert ok.shards[0].input == "resources/raw/x/en_part+1-0.jsonl"


def test_credentials_in_a_url_are_refused_without_being_shown(catalog):
    spec = {"type": "url", "files": [{"url": "https://me:s3cret@h/d/"}]}  # no file name either
    with pytest.raises(GptflowError, match="user name or password") as e:
        resolve("x", spec, catalog)
    assert "s3cret" not in str(e.value)


def test_tokenizer_files_get_the_same_checks():
    from gptflow.data.remote_files import tokenizer_file_name

    ok = {"url": "https://h/gpt2/vocab.json", "mirrors": ["https://m/vocab.json"]}
    assert tokenizer_file_name("vocab", ok, "c.yaml") == "vocab.json"
    with pytest.raises(GptflowError, match=r"c\.yaml: tokenizer\.vocab: .*user name or password"):
        tokenizer_file_name("vocab", {**ok, "mirrors": ["https://u:p@m/vocab.json"]}, "c.yaml")
    with pytest.raises(GptflowError, match=r"tokenizer\.merges: the stored name 'SHA256SUMS'"):
        tokenizer_file_name("merges", {"url": "https://h/x/SHA256SUMS"}, "c.yaml")


def test_the_rules_options_of_a_shard_and_a_download(catalog, tmp_path):
    """One param per option: a shard's archive member and member format (nothing when unset),
    a download's mirrors and sha256, a gated dataset's token scope (nothing without a token);
    a tokenizer file's sha256 as the config spells it."""
    from gptflow.data.remote_files import RemoteFile, tokenizer_remote_file
    from gptflow.data.sources import Shard

    enwik8 = resolve("enwik8", {"type": "catalog", "name": "enwik8"}, catalog).shards[0]
    assert (enwik8.member_args(), enwik8.member_format_args()) == (
        ["--member", "enwik8"], ["--member-format", "txt"],
    )  # fmt: skip
    plain = Shard("00000", "a.jsonl", "jsonl")
    assert plain.member_args() == plain.member_format_args() == []
    f = RemoteFile("o.xz", ("https://a/o.xz", "https://m1/o.xz", "https://m2/o.xz"), "ab" * 32)
    assert f.mirror_args() == ["--mirror", "https://m1/o.xz", "--mirror", "https://m2/o.xz"]
    assert f.sha256_args() == ["--sha256", "ab" * 32]
    bare = RemoteFile("o.xz", ("https://a/o.xz",), None)
    assert bare.mirror_args() == bare.sha256_args() == []
    oscar = resolve("oscar", {"type": "catalog", "name": "oscar"}, catalog)
    assert oscar.token_env_args() == ["--token-env", "HF_TOKEN"]
    assert oscar.token_origin_args() == ["--token-origin", "https://huggingface.co"]
    assert oscar.token_allow_http_args() == []
    spec = {
        "url": "https://h/tok/tokenizer.json",
        "mirrors": ["https://m/t.json"],
        "sha256": "AB" * 32,
    }
    tok = tokenizer_remote_file("url", spec, "my.yaml")
    assert (tok.name, tok.mirror_args(), tok.sha256_args()) == (
        "tokenizer.json", ["--mirror", "https://m/t.json"], ["--sha256", "AB" * 32],
    )  # fmt: skip


def test_parts_of_an_input_and_their_document_ranges(tmp_path):
    """tokenize.documents_per_shard: ceil(documents / per part) parts, at least one; part p
    reads documents [p * n, (p + 1) * n) (the last range may pass the end)."""
    from gptflow.data.sources import counted_parts, part_count, part_documents

    assert [part_count(d, 7) for d in (0, 1, 7, 8, 14, 15)] == [1, 1, 1, 2, 2, 3]
    assert [part_documents(p, 7) for p in range(3)] == ["0:7", "7:14", "14:21"]
    (tmp_path / "c.json").write_text('{"documents": 20, "sources": []}')
    assert counted_parts(tmp_path / "c.json", 7) == 3


def test_the_datasets_a_config_needs_and_the_stamps_of_local_files(tmp_path):
    from gptflow.data.sources import file_stamps, needed_datasets

    cfg = {
        "data": {"blend": [{"dataset": "a"}, {"dataset": "b"}]},
        "tokenizer": {"source": "train", "train": {"datasets": ["b", "c"]}},
    }
    assert needed_datasets(cfg) == ["a", "b", "c"]
    cfg["tokenizer"] = {"source": "file"}
    assert needed_datasets(cfg) == ["a", "b"]
    f = tmp_path / "x.txt"
    f.write_text("hello")
    st = f.stat()
    assert file_stamps([str(f)]) == [[str(f), 5, st.st_mtime_ns]]


def test_eval_extra_takes_files_on_disk_and_shards_the_plan_makes(tmp_path):
    """eval.extra is checked when the workflow is planned (issue 25): a prefix whose files
    exist, or a shard (part, merged shard) a dataset of the plan makes, passes; any other is
    one line naming eval.extra and the missing file."""
    from gptflow.data.sources import Dataset, Shard, check_eval_extra

    made = {"wiki": Dataset("wiki", "collect", (Shard("00000", "x.jsonl", "jsonl"),))}
    on_disk = tmp_path / "old" / "00007"
    on_disk.parent.mkdir()
    for ext in (".bin", ".idx"):
        on_disk.with_suffix(ext).write_bytes(b"")
    ok = [str(on_disk), "results/tokens/t/wiki/00000", "results/tokens/t/wiki/merged"]
    check_eval_extra({"a": ok}, made, "t", False, "c.yaml")
    check_eval_extra({"a": ["results/tokens/t/wiki/00000-0003"]}, made, "t", True, "c.yaml")
    for bad, parts in [
        ("results/tokens/t/wiki/00001", True),  # no such shard
        ("results/tokens/t/wiki/00000-0003", False),  # no parts without documents_per_shard
        ("results/tokens/other/wiki/00000", True),  # another tokenizer's
        (str(on_disk.parent / "00008"), True),
    ]:
        with pytest.raises(GptflowError) as e:
            check_eval_extra({"a": [str(on_disk), bad]}, made, "t", parts, "c.yaml")
        assert str(e.value).startswith(f"c.yaml: eval.extra.a[1] is {bad!r}, but {bad}.bin does ")
        assert "\n" not in str(e.value)


def test_a_local_datasets_files_and_shards_are_in_path_order(tmp_path):
    """The files a local dataset matches, in sorted path order, each once however many
    patterns match it, cut into contiguous shards: the plan and every collection job are
    separate processes, each with its own string hashing, so an order that came from a set
    of paths would cut other shards in each of them."""
    from gptflow.data.sources import local_shards

    names = [f"{d}/{i:02d}.py" for d in ("b", "a", "c/deep") for i in (7, 3, 11, 0, 5)]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    spec = {"root": str(tmp_path), "include": ["**/*.py", "a/*.py"], "exclude": ["**/05.py"],
            "shards": 4}  # fmt: skip
    shards = local_shards("d", spec)
    assert [p for shard in shards for p in shard] == sorted(
        tmp_path / n for n in names if not n.endswith("05.py")
    )
    assert [len(shard) for shard in shards] == [3, 3, 3, 3]
