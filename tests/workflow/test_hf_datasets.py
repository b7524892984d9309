"""type: hf through Snakemake: collect_hf_documents reads a dataset saved on disk, offline."""

import json

from .conftest import job_counts


def test_collect_hf_documents_writes_each_row_range_offline(
    tmp_path, snakemake, write_config, tiny_config, monkeypatch
):
    """HF_DATASETS_OFFLINE=1, a DatasetDict saved on disk as a 2-shard hf dataset of the blend:
    the plan has a collect_hf_documents job per shard, and the jobs (the script adapter and its
    params) write the train split's rows in two contiguous ranges, empty rows dropped, with the
    dataset's path, split and fingerprint in each manifest."""
    import datasets  # the test extra installs it (gptflow[hf-datasets]): missing is a failure

    rows = ["first row\n", "", "second row\n", "third row\n", "fourth row\n"]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": rows}),
            "test": datasets.Dataset.from_dict({"text": ["no"]}),
        }
    ).save_to_disk(str(saved))
    fingerprint = datasets.load_from_disk(str(saved))["train"]._fingerprint
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = dict(tiny_config)
    cfg["datasets"] = {**cfg["datasets"], "wiki": {"type": "hf", "path": str(saved), "shards": 2}}
    cfg["data"] = {
        **cfg["data"],
        "blend": [*cfg["data"]["blend"], {"dataset": "wiki", "weight": 1.0}],
    }
    config = write_config(tmp_path / "config.yaml", cfg)
    wd = tmp_path / "wd"
    targets = [f"results/documents/wiki/0000{i}.manifest.json" for i in (0, 1)]

    run = snakemake(wd, config, *targets)
    assert run.returncode == 0, run.out[-3000:]
    assert job_counts(run.out) == {"collect_hf_documents": 2}
    documents = [
        [json.loads(line) for line in (wd / f"results/documents/wiki/0000{i}.jsonl").open()]
        for i in (0, 1)
    ]
    assert documents == [
        [{"text": "first row\n", "row": 0}],
        [{"text": "second row\n", "row": 2}, {"text": "third row\n", "row": 3}, {"text": "fourth row\n", "row": 4}],
    ]  # fmt: skip
    manifests = [json.loads((wd / t).read_text()) for t in targets]
    assert [(m["shard"], m["rows"], m["dropped"]) for m in manifests] == [
        ("00000", [0, 2], {"empty": 1}),
        ("00001", [2, 5], {}),
    ]
    assert {(m["path"], m["split"], m["fingerprint"]) for m in manifests} == {
        (str(saved), "train", fingerprint)
    }
