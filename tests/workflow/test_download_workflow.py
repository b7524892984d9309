"""Real downloads through Snakemake: nginx on loopback serves corpora in every catalog format;
download_dataset fetches them (verified, SHA256SUMS recorded) and tokenize_shard reads them."""

import copy
import hashlib
import json
import os
import re
import subprocess

import pytest
import yaml

from gptflow.data.indexed import IndexedDataset
from gptflow.data.shards import reference_tokens
from tests.support.faultserver import FaultServer
from tests.support.noslurm import path_without_slurm
from tests.support.ports import refused_port
from tests.support.profiles import TEST_CLUSTER, edited_slurm_profile

from .conftest import REPO, job_counts, snakemake_cmd


@pytest.fixture(scope="module")
def dead_port():
    """A loopback port held bound but not listening for the module: connections are refused."""
    with refused_port() as port:
        yield port


@pytest.fixture(scope="module")
def url_config(nginx, dead_port):
    server, _ = nginx
    cfg = yaml.safe_load((REPO / "tests/config/config.yaml").read_text())
    cfg["run"] = "urls"
    sha = hashlib.sha256((server.root / "oscar-1GB.jsonl.xz").read_bytes()).hexdigest()
    cfg["datasets"] = {
        "enwik8": {"type": "url", "format": "zip", "member": "enwik8", "member_format": "txt",
                   "files": [{"url": server.url("enwik8.zip")}]},
        "pile": {"type": "url", "url_template": server.url("train/{part:02d}.jsonl.zst"), "parts": [0, 1]},
        "oscar": {"type": "url", "files": [{"url": f"http://127.0.0.1:{dead_port}/dead/oscar-1GB.jsonl.xz",
                  "mirrors": [server.url("oscar-1GB.jsonl.xz")], "sha256": sha}]},
        "c4": {"type": "url", "files": [{"url": server.url("c4-train.00000-of-00001.json.gz")}]},
        "docs": {"type": "url", "member": "docs/*", "files": [{"url": server.url("docs.tar.gz")}]},
        "pq": {"type": "url", "files": [{"url": server.url("data.parquet")}]},
    }  # fmt: skip
    cfg["download"] = {"attempts": 2}
    cfg["tokenizer"]["train"]["datasets"] = ["pile", "oscar"]
    cfg["data"]["blend"] = [{"dataset": d} for d in cfg["datasets"]]
    return cfg


@pytest.fixture(scope="module")
def fetched(tmp_path_factory, snakemake, write_config, url_config):
    wd = tmp_path_factory.mktemp("urls")
    config = write_config(wd / "config.yaml", url_config)
    plan = snakemake(wd, config, "-n", "data")
    run = snakemake(wd, config, "data")
    assert run.returncode == 0, run.out[-6000:]
    return wd, config, plan


def test_plan_downloads_every_file(fetched):
    _, _, plan = fetched
    counts = job_counts(plan.out)
    assert counts["download_dataset"] == 7  # 2 pile parts + one file for each other dataset
    assert counts["tokenize_shard"] == 7
    assert counts["sample_documents"] == 2


def test_every_format_is_fetched_verified_and_tokenized(fetched, nginx):
    wd, _, _ = fetched
    server, made = nginx
    tok = str(wd / "results/tokenizers/tiny-bpe/tokenizer.json")
    layout = {
        "enwik8": ["enwik8.zip"],
        "pile": ["train/00.jsonl.zst", "train/01.jsonl.zst"],
        "oscar": ["oscar-1GB.jsonl.xz"],
        "c4": ["c4-train.00000-of-00001.json.gz"],
        "docs": ["docs.tar.gz"],
        "pq": ["data.parquet"],
    }
    for dataset, files in layout.items():
        sums = (wd / "resources/raw" / dataset / "SHA256SUMS").read_text()
        for i, rel in enumerate(files):
            raw = wd / "resources/raw" / dataset / rel.split("/")[-1]
            digest = hashlib.sha256((server.root / rel).read_bytes()).hexdigest()
            assert hashlib.sha256(raw.read_bytes()).hexdigest() == digest
            assert f"{digest}  {raw.name}" in sums
            prefix = wd / f"results/tokens/tiny-bpe/{dataset}/{i:05d}"
            ds = IndexedDataset(prefix)
            expected = [t for t in reference_tokens(made[rel], tok, "<|endoftext|>") if t]
            assert [ds[j].tolist() for j in range(len(ds))] == expected, f"{dataset} {rel}"
            manifest = json.loads(prefix.with_suffix(".json").read_text())
            assert manifest["sources"][0]["sha256"] == digest


def test_dead_primary_fell_over_to_the_mirror(fetched, dead_port):
    wd, _, _ = fetched
    log = (wd / "logs/download_dataset/oscar/oscar-1GB.jsonl.xz.log").read_text()
    assert f"http://127.0.0.1:{dead_port}/dead/oscar-1GB.jsonl.xz: gave up after 2 attempts" in log
    assert "(given)" in log  # verified against the configured sha256


def test_second_run_downloads_nothing(fetched, snakemake, nginx):
    wd, config, _ = fetched
    server, _ = nginx
    before = len(server.log_lines())
    again = snakemake(wd, config, "data")
    assert "Nothing to be done" in again.out
    assert len(server.log_lines()) == before


def test_unreachable_urls_fail_with_one_line_naming_dataset_and_urls(
    tmp_path, snakemake, write_config, url_config
):
    cfg = copy.deepcopy(url_config)
    cfg["tokenizer"]["train"]["datasets"] = ["gone"]
    cfg["data"]["blend"] = [{"dataset": "gone"}]
    wd = tmp_path / "wd"
    with refused_port() as a, refused_port() as b:
        primary, mirror = (
            f"http://127.0.0.1:{a}/a/x.jsonl.zst",
            f"http://127.0.0.1:{b}/b/x.jsonl.zst",
        )
        cfg["datasets"] = {
            "gone": {"type": "url", "files": [{"url": primary, "mirrors": [mirror]}]}
        }
        out = snakemake(wd, write_config(tmp_path / "c.yaml", cfg), "data")
    assert out.returncode == 1
    assert "Error in rule download_dataset:" in out.out
    log = (wd / "logs/download_dataset/gone/x.jsonl.zst.log").read_text().splitlines()
    errors = [line for line in log if line.startswith("gptflow download: error:")]
    assert errors == [
        f"gptflow download: error: dataset gone: x.jsonl.zst: every URL failed ({primary}: gave "
        "up after 2 attempts (connection failed (ConnectionError)); "
        f"{mirror}: gave up after 2 attempts (connection failed (ConnectionError))). "
        "Check the URLs, mirrors and network"
    ]
    assert not (wd / "resources/raw/gone/x.jsonl.zst").exists()


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ({"type": "catalog", "name": "the_pile"},
         "datasets.d.name 'the_pile' is not in the catalog"),
        ({"type": "url", "format": "rar", "files": [{"url": "http://h/x.rar"}]},
         "'datasets.d.format' is 'rar'; expected one of"),
        ({"type": "url", "files": [{"url": "http://h/corpus.bin"}]},
         "datasets.d: cannot tell the format of 'corpus.bin' from its name; set format"),
        ({"type": "catalog", "name": "pile", "parts": [5, 2]},
         "datasets.d.parts is [5, 2], but catalog entry 'pile' has parts [0, 29]; give "
         "[first, last] with 0 <= first <= last <= 29"),
    ],
)  # fmt: skip
def test_bad_dataset_entries_stop_before_any_job(
    tmp_path, snakemake, write_config, url_config, dataset, message
):
    cfg = copy.deepcopy(url_config)
    cfg["datasets"] = {"d": dataset}
    cfg["tokenizer"]["train"]["datasets"] = ["d"]
    cfg["data"]["blend"] = [{"dataset": "d"}]
    out = snakemake(tmp_path / "wd", write_config(tmp_path / "c.yaml", cfg), "-n")
    assert out.returncode != 0
    lines = [line for line in out.out.splitlines() if line.startswith("gptflow config:")]
    assert len(lines) == 1 and message in lines[0], out.out[-3000:]


TOKENIZER_JSON = b'{"version": "1.0", "model": {"type": "BPE"}}\n'
CORPUS = b"(zstd frame of a corpus, bytes only)"


@pytest.mark.parametrize("localrule", [True, False])
def test_download_localrule_runs_downloads_on_the_machine_running_snakemake(
    tmp_path, write_config, tiny_config, localrule
):
    """docs/data.md: "Set download.localrule: true when compute nodes have no internet: downloads
    then run on the machine running Snakemake."

    Snakemake through profiles/slurm (the Slurm executor, the quick start's edits) on a PATH
    without Slurm's commands,
    a loopback HTTP server holding the files. With localrule both download rules run here as
    local rules: the server is asked once for each file and the files arrive. Without it they
    are submitted to Slurm (here: the submission fails, there is no Slurm) and nothing is
    fetched from this machine."""
    server = FaultServer()
    try:
        cfg = copy.deepcopy(tiny_config)
        cfg["datasets"] = {
            "web": {"type": "url", "files": [{"url": server.add("a.jsonl.zst", CORPUS)}]}
        }
        cfg["tokenizer"] = {
            "name": "tok",
            "source": "url",
            "eod_token": "<|endoftext|>",
            "url": {"url": server.add("tokenizer.json", TOKENIZER_JSON)},
        }
        cfg["data"]["blend"] = [{"dataset": "web"}]
        cfg["download"] = {"localrule": localrule}
        wd = tmp_path / "wd"
        targets = ["resources/raw/web/a.jsonl.zst", "resources/tokenizers/tok/url/tokenizer.json"]
        cmd = snakemake_cmd(wd, write_config(tmp_path / "c.yaml", cfg))
        # profiles/slurm as the README's quick start has a user fill it in (a profile left
        # with its <...> placeholders submits nothing: tests/workflow/test_slurm.py)
        profile = edited_slurm_profile(tmp_path / "profile", TEST_CLUSTER)
        cmd[cmd.index("--profile") + 1] = str(profile)
        cmd += ["--slurm-init-seconds-before-status-checks", "1", "--keep-going"]
        env = {**os.environ, "PATH": path_without_slurm(tmp_path / "bin")}
        run = subprocess.run(
            ["timeout", "300", *cmd[:1], *targets, *cmd[1:]],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        requests = [r["path"] for r in server.log]
    finally:
        server.close()
    jobs = {line for line in run.stdout.splitlines() if re.fullmatch(r"(local)?rule \w+:", line)}
    if localrule:
        assert run.returncode == 0, run.stdout[-3000:]
        assert jobs == {"localrule download_dataset:", "localrule download_tokenizer_file:"}
        assert sorted(requests) == ["/a.jsonl.zst", "/tokenizer.json"]
        assert (wd / targets[0]).read_bytes() == CORPUS
        assert (wd / targets[1]).read_bytes() == TOKENIZER_JSON
    else:
        assert run.returncode == 1, run.stdout[-3000:]
        assert jobs == {"rule download_dataset:", "rule download_tokenizer_file:"}
        for rule in ("download_dataset", "download_tokenizer_file"):
            assert f"Error in rule {rule}:\n    message: Job submission failed" in run.stdout
        assert requests == []
        assert not (wd / "resources").exists()
