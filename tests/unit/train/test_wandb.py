"""train.wandb: refused at planning when it cannot work, and, offline, for real: the trainer's
W&B run holds the metrics.jsonl records and keeps its id across a restart (read back from
W&B's own files with tests/support/wandb_records.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gptflow.errors import GptflowError
from gptflow.plan.workflow_config import load_workflow_config
from gptflow.train.metrics import scalars
from gptflow.train.run_config import RunConfig
from tests.support.wandb_records import history, read_records, run_ids

BIN = Path(sys.executable).parent
FAKE_KEY = "0123456789abcdef" * 2 + "f00dcafe"  # 40 hex digits, the shape of a W&B API key


def load(repo, tiny_config, **wandb):
    cfg = {**tiny_config, "train": {**tiny_config["train"], "wandb": wandb}}
    return load_workflow_config(
        cfg,
        schema_path=repo / "config/schema/config.schema.yaml",
        models_dir=repo / "config/models",
        source="my.yaml",
    )


def test_defaults_are_off_and_offline(repo, tiny_config):
    cfg = load(repo, tiny_config)
    assert cfg["train"]["wandb"] == {
        "enabled": False, "mode": "offline", "project": "gptflow", "entity": None, "name": None,
    }  # fmt: skip


def test_enabled_without_the_package_is_refused_at_planning(repo, tiny_config, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    load(repo, tiny_config, enabled=False)  # off: no need for the package
    with pytest.raises(GptflowError) as e:
        load(repo, tiny_config, enabled=True)
    assert str(e.value) == (
        f"my.yaml: train.wandb.enabled is true, but the wandb package is not installed in "
        f"{sys.prefix}; install it with pip install 'gptflow[wandb]' (or set "
        f"train.wandb.enabled: false)"
    )


def test_snakemake_n_refuses_it_too(repo, tiny_config, tmp_path):
    """The planning of the real workflow, in a Python where wandb cannot be found
    (sys.modules['wandb'] = None, set by a sitecustomize): refused before any job."""
    import yaml

    (tmp_path / "site").mkdir()
    (tmp_path / "site/sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    cfg = {**tiny_config, "train": {**tiny_config["train"], "wandb": {"enabled": True}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [str(BIN / "snakemake"), "--snakefile", str(repo / "Snakefile"), "--directory",
         str(tmp_path / "wd"), "--profile", str(repo / "profiles/local"), "--configfile",
         str(tmp_path / "c.yaml"), "-n"],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    said = out.stdout + out.stderr
    assert out.returncode != 0
    assert "train.wandb.enabled is true, but the wandb package is not installed" in said
    assert "pip install 'gptflow[wandb]'" in said
    assert not (tmp_path / "wd/results").exists()


def test_online_needs_the_key_in_the_environment(repo, tiny_config, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    load(repo, tiny_config, enabled=True)  # offline needs no key
    with pytest.raises(GptflowError, match=r"train\.wandb\.mode is 'online', but \$WANDB_API_KEY"):
        load(repo, tiny_config, enabled=True, mode="online")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert (
        load(repo, tiny_config, enabled=True, mode="online")["train"]["wandb"]["mode"] == "online"
    )


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("api_key", FAKE_KEY, "api_key"),  # no such key: the key comes from the environment
        ("mode", "cloud", "mode"),
        ("project", "my project", "project"),
    ],
)
def test_bad_keys_are_refused_by_name(repo, tiny_config, key, value, says):
    with pytest.raises(GptflowError, match=rf"train\.wandb\.{says}") as e:
        load(repo, tiny_config, **{"enabled": True, key: value})
    assert FAKE_KEY not in str(e.value)


def gptflow_train(run_dir: Path, *extra: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "gptflow"), "train", "--config", str(run_dir / "run.yaml"), "--threads", "1"]
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=600, env=env)


def by_step(rows: list[dict]) -> dict[int, dict]:
    """Values per step: the records' scalars, or W&B's history rows without its own keys."""
    out: dict[int, dict] = {}
    for step, values in rows:
        out.setdefault(step, {}).update(values)
    return out


def test_offline_run_holds_the_records_and_resumes_its_id_across_a_restart(make_run):
    """Stopped after step 4 (exit 75) and rerun: one W&B run id, kept in the run directory,
    in both attempts' offline directories; between them every metrics.jsonl number at its
    step (MFU, null on a CPU, is not logged); the API key in the environment is written
    nowhere."""
    env = {**os.environ, "WANDB_API_KEY": FAKE_KEY, "WANDB_MODE": "online"}  # config wins
    run_dir = make_run(
        "wb", train_iters=6, log_interval=1, eval_interval=3, eval_iters=1,
        wandb={"enabled": True, "project": "gptflow-test"},
    )  # fmt: skip
    first = gptflow_train(run_dir, "--exit-interval", "4", env=env)
    assert first.returncode == 75, first.stderr[-3000:]
    second = gptflow_train(run_dir, env=env)
    assert second.returncode == 0, second.stderr[-3000:]

    run = RunConfig.load(run_dir / "run.yaml")
    series = run.series
    run_id = (run_dir / "wandb" / f"{series}.id").read_text().strip()
    attempts = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(attempts) == 2, sorted(p.name for p in (run_dir / "wandb").iterdir())
    files = [a / f"run-{run_id}.wandb" for a in attempts]
    assert [run_ids(f) for f in files] == [{run_id}, {run_id}]
    names = {r.run.display_name for f in files for r in read_records(f) if r.HasField("run")}
    assert names == {f"{run.run}-{series}"}  # train.wandb.name unset: RUN-SERIES
    assert f"W&B run {run_id} (offline, project gptflow-test)" in first.stderr

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = by_step([(r["step"], scalars(r)) for r in records])
    rows = [row for f in files for row in history(f)]
    got = by_step([(row["_step"], {k: v for k, v in row.items() if not k.startswith("_")})
                   for row in rows])  # fmt: skip
    assert sorted(got) == list(range(7))
    assert got == want
    assert {"train/loss", "train/grad_norm", "train/lr", "eval/val_loss"} <= set(got[3])
    assert all("train/mfu" not in values for values in got.values())

    for path in run_dir.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), path
    assert FAKE_KEY not in first.stderr + first.stdout + second.stderr + second.stdout
