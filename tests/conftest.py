"""Shared fixtures: the repository, the tiny config, a tiny corpus and tokenizer built once."""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml

from tests.support.hardware import MISSING_HARDWARE

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the .venv's bin: gptflow, snakemake, torchrun

# megatron-core warns about Transformer Engine / Apex at import; irrelevant on CPU.
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ['PATH']}"

# In CI (`.ci/run` sets it) every test runs against its real parts: a skip (no root, no nginx,
# no Slurm, no Chromium, no Docker engine) is a failure there, not a quiet green. Locally a skip
# stays a skip with its exact reason. A part CI can install or start is a service; an
# instruction set the CPU lacks is not: a skip that says so (tests/support/hardware.py)
# stands on machines without it.
REQUIRE_ALL = os.environ.get("GPTFLOW_REQUIRE_ALL") == "1"


# What Snakemake and the pipeline write into their working directory. A test that runs them in
# the repository, not in its own tmp_path, shares these with every test running beside it and
# with the developer's own runs: the session fails when one changed while it ran.
REPO_SCRATCH = ("results", "logs", "resources", ".snakemake")
_STARTED = pytest.StashKey[float]()  # when the session (the controller, under xdist) began
_WRITTEN = pytest.StashKey[list[str]]()


def pytest_sessionstart(session):
    from tests.support import slurm_cluster

    # Under pytest-xdist this hook runs in the controller and in every worker: the controller
    # (or a serial session) starts the cluster early; a worker's fixture runs start-cluster.sh,
    # which waits on the script's own lock for a start under way (tests/slurm/start-cluster.sh).
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_STARTED] = time.time()
        slurm_cluster.start_early()  # why: tests/support/slurm_cluster.py


def pytest_sessionfinish(session):
    started = session.config.stash.get(_STARTED, None)
    if started is None:  # a worker: the controller looks once every test has run
        return
    written = [
        str(p.relative_to(REPO))
        for name in REPO_SCRATCH
        for p in [REPO / name, *(REPO / name).rglob("*")]
        if p.exists() and p.lstat().st_mtime >= started
    ]
    if written:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        session.config.stash[_WRITTEN] = written


def pytest_terminal_summary(terminalreporter, config):
    if written := config.stash.get(_WRITTEN, None):
        terminalreporter.write_sep("=", "tests wrote into the repository", red=True)
        terminalreporter.write_line(
            f"{', '.join(written[:5])}{', ...' if len(written) > 5 else ''} changed while the "
            f"session ran: run Snakemake and gptflow in tmp_path (--directory), not in {REPO}"
        )


# make test runs the suite on 2 pytest-xdist workers with --dist loadgroup: a test with an
# xdist_group runs on the worker that takes its group, every other test wherever a worker is
# free. The tests that use one of these session fixtures share one group: the service runs once
# per session, not once per worker, and its tests do not meet on it (the Slurm cluster's queue
# and the Torque wrappers on it, the test dockerd and podman store, the tiny pipeline that
# test_pipeline and test_harness read, nginx and the downloads it serves).
ONE_WORKER = {
    "slurm_cluster": "slurm",
    "docker_host": "container",
    "podman_env": "container",
    "pipeline": "pipeline",
    "nginx": "nginx",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks into the node ids
def pytest_collection_modifyitems(config, items):
    """One xdist_group per test that shares a cost with others: the service of ONE_WORKER it
    uses, else its module where it uses a module-scoped fixture (built once per module: split
    over two workers, it would be built twice). An xdist_group the test names itself wins."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        used = getattr(item, "fixturenames", ())
        group = next((ONE_WORKER[f] for f in ONE_WORKER if f in used), None)
        if group is None and hasattr(item, "_fixtureinfo"):
            defs = item._fixtureinfo.name2fixturedefs
            if any(d[-1].scope == "module" for d in defs.values() if d):
                group = item.nodeid.split("::")[0]
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(name=group))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if REQUIRE_ALL and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        if MISSING_HARDWARE in str(reason):
            return report
        report.outcome = "failed"
        report.longrepr = f"GPTFLOW_REQUIRE_ALL=1 (CI): this test may not skip. {reason}"
    return report


# What torch.distributed (and gptflow.train.distributed.export) reads from the environment. A test
# that sets one in the pytest process and leaves it makes every later `gptflow train` it
# starts a rank of a job that does not exist (CI once failed that way: a port in use).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")  # fmt: skip


@pytest.fixture(autouse=True)
def _no_launcher_environment_leaks(request):
    before = {k: os.environ.get(k) for k in LAUNCHER_ENV}
    yield
    after = {k: os.environ.get(k) for k in LAUNCHER_ENV}
    if after != before:
        for k, v in before.items():  # the later tests start clean; this one fails
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        pytest.fail(f"{request.node.nodeid} left launcher variables in the environment: {after}")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_config() -> dict:
    """The tests' hermetic workflow config, as a fresh dict per use (copy before editing)."""
    with open(REPO / "tests" / "config" / "config.yaml") as f:
        return yaml.safe_load(f)


@pytest.fixture
def edit_config(tiny_config):
    def make(**sections) -> dict:
        cfg = copy.deepcopy(tiny_config)
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), dict):
                cfg[key].update(value)
            else:
                cfg[key] = value
        return cfg

    return make


@pytest.fixture(scope="session")
def corpus_jsonl(tmp_path_factory, tiny_config) -> list[Path]:
    """Two JSONL shards of real text (the tiny config's stdlib slice)."""
    from gptflow.data.readers import collect_local_documents
    from gptflow.data.sources import expand_root, local_shards

    spec = tiny_config["datasets"]["stdlib"]
    out = tmp_path_factory.mktemp("corpus")
    paths = []
    for i, files in enumerate(local_shards("stdlib", spec)):
        path = out / f"{i:05d}.jsonl"
        collect_local_documents(files, expand_root(spec["root"]), path)
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory, corpus_jsonl) -> Path:
    """A 512-token ByteLevel BPE trained on the corpus."""
    from gptflow.data.tokenizer import sample_texts, train_bpe

    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(
        sample_texts([str(p) for p in corpus_jsonl], "text", 2_000_000),
        path,
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|padding|>"],
    )
    return path


@pytest.fixture(scope="session")
def shards(tmp_path_factory, corpus_jsonl, tokenizer_json) -> list[str]:
    """The corpus tokenized into two shard prefixes."""
    from gptflow.data.shards import tokenize_to_shard

    out = tmp_path_factory.mktemp("tokens")
    prefixes = []
    for path in corpus_jsonl:
        prefix = str(out / path.stem)
        tokenize_to_shard([str(path)], str(tokenizer_json), prefix)
        prefixes.append(prefix)
    return prefixes


@pytest.fixture(scope="session")
def megatron_shards(tmp_path_factory, corpus_jsonl, tokenizer_json) -> list[str]:
    """The corpus as Megatron-LM's preprocess_data.py --append-eod writes it with the same
    tokenizer (megatron-core's tokenizer and writer): two prefixes, PREFIX_text_document."""
    from tests.support.megatron_preprocess import megatron_tokenizer, preprocess, read_texts

    out = tmp_path_factory.mktemp("megatron")
    tok = megatron_tokenizer(tokenizer_json, out / "tokenizer")
    return [
        preprocess(read_texts(p), tok, out / f"corpus_{i:02d}") for i, p in enumerate(corpus_jsonl)
    ]


@pytest.fixture
def write_jsonl():
    """write_jsonl(path, records): dicts become JSON lines, strings are written verbatim."""

    def write(path: Path, records: list) -> Path:
        with open(path, "w") as f:
            for r in records:
                f.write(r if isinstance(r, str) else json.dumps(r))
                f.write("\n")
        return path

    return write


@pytest.fixture(scope="session")
def nginx(tmp_path_factory):
    """A real nginx on loopback serving fixture corpora in every catalog format.

    Yields (server, {relative path: documents}). Installs Debian's nginx when missing (root).
    """
    from tests.support.corpora import documents, write_all
    from tests.support.nginx import Nginx, ensure_nginx

    binary, why = ensure_nginx()
    if binary is None:
        pytest.skip(f"the download tests need a real nginx on loopback and none can be had: {why}")
    root = tmp_path_factory.mktemp("www")
    made = write_all(root, documents())
    server = Nginx(binary, root, tmp_path_factory.mktemp("nginx"))
    yield server, made
    server.stop()


def render_run(repo, tiny_config, tokenizer_json, shards, run_dir: Path, model=None, **train):
    """A run directory with run.yaml rendered from the tiny config (model and train keys
    overridden), for `gptflow train`."""
    from gptflow.plan.workflow_config import load_workflow_config
    from gptflow.train.run_config import render_run_config, write_run_config

    cfg = load_workflow_config(
        {
            **tiny_config,
            "model": {**tiny_config["model"], **(model or {})},
            "train": {**tiny_config["train"], **train},
        },
        schema_path=repo / "config/schema/config.schema.yaml",
        models_dir=repo / "config/models",
        source="test",
    )
    run_dir.mkdir()
    run = render_run_config(
        cfg, tokenizer_path=str(tokenizer_json), shards={"stdlib": shards}, run_dir=str(run_dir)
    )
    write_run_config(run, run_dir / "run.yaml")
    return run_dir


@pytest.fixture
def make_run(repo, tiny_config, tokenizer_json, shards, tmp_path):
    """make_run(name, model=None, **train) -> a run directory with run.yaml rendered from the
    tiny config (model and train keys overridden), for `gptflow train`."""

    def make(name="run", model=None, **train) -> Path:
        return render_run(
            repo, tiny_config, tokenizer_json, shards, tmp_path / name, model, **train
        )

    return make


@pytest.fixture(scope="module")
def make_module_run(repo, tiny_config, tokenizer_json, shards, tmp_path_factory):
    """make_run for a module fixture that trains runs once for several tests to read (each
    test copies a run before changing it: tests/support/in_turn.py's copy_run)."""
    where = tmp_path_factory.mktemp("module-runs")

    def make(name="run", model=None, **train) -> Path:
        return render_run(repo, tiny_config, tokenizer_json, shards, where / name, model, **train)

    return make


@pytest.fixture(scope="session")
def tls(tmp_path_factory):
    """(server context, CA file): a throwaway CA and a certificate for 127.0.0.1 and localhost,
    for the loopback HTTPS origins of the token tests (tests/support/origins.py)."""
    from tests.support.origins import make_tls

    made = make_tls(tmp_path_factory.mktemp("tls"))
    if made is None:
        pytest.skip(
            "the openssl CLI is not on PATH: the test CA and server certificate are made with "
            "it (apt-get install openssl)"
        )
    return made
