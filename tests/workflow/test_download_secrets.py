"""The download rule hands the job a token's variable NAME, never its value: a canary token in
the environment of a real Snakemake run, downloading from an HTTPS origin on loopback, reaches
the server (the job reads it from its environment) and nothing Snakemake prints or writes."""

import os
import subprocess

import yaml

from tests.support.origins import Origin

from .conftest import REPO, snakemake_cmd

CANARY = "canary-5d1f0a9e-not-for-logs"
ENV = "GPTFLOW_TEST_TOKEN"


def gated_config(url: str) -> dict:
    cfg = yaml.safe_load((REPO / "tests/config/config.yaml").read_text())
    cfg["datasets"]["gated"] = {"type": "url", "files": [{"url": url}], "auth": {"token_env": ENV}}
    cfg["data"]["blend"].append({"dataset": "gated", "weight": 1.0})
    return cfg


def run(wd, config, *args, env):
    return subprocess.run(
        snakemake_cmd(wd, config, *args), env=env, capture_output=True, text=True, timeout=600
    )


def test_token_reaches_its_origin_and_nothing_snakemake_prints_or_writes(
    tmp_path, tls, write_config
):
    ctx, ca = tls
    origin = Origin(ctx)
    try:
        data = b'{"text": "gated document"}\n' * 1000
        url = origin.serve("gated.jsonl", data)
        wd = tmp_path / "wd"
        config = write_config(tmp_path / "config.yaml", gated_config(url))
        env = {**os.environ, ENV: CANARY, "REQUESTS_CA_BUNDLE": str(ca)}
        target = "resources/raw/gated/gated.jsonl"
        plan = run(wd, config, "-n", target, env=env)
        assert plan.returncode == 0, plan.stdout + plan.stderr
        assert f"--token-env {ENV} --token-origin {origin.origin}" in plan.stdout
        done = run(wd, config, target, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        origin.close()
    assert origin.auth("gated.jsonl") == [f"Bearer {CANARY}"]
    assert (wd / target).read_bytes() == data
    for out in (plan, done):
        assert CANARY not in out.stdout + out.stderr
    written = [p for p in wd.rglob("*") if p.is_file() and not p.is_symlink()]
    assert wd / "logs/download_dataset/gated/gated.jsonl.log" in written
    assert any(".snakemake" in p.parts for p in written)  # its metadata and log, checked too
    assert [p for p in written if CANARY.encode() in p.read_bytes()] == []


def test_a_token_for_plain_http_stops_the_plan_with_the_fix(tmp_path, write_config, snakemake):
    config = write_config(tmp_path / "config.yaml", gated_config("http://127.0.0.1:9/g.jsonl"))
    plan = snakemake(tmp_path / "wd", config, "-n")
    assert plan.returncode != 0
    assert "Traceback" not in plan.out
    assert (
        "datasets.gated.auth: http://127.0.0.1:9 (of http://127.0.0.1:9/g.jsonl) is plain http; "
        f"the token in ${ENV} goes only over https, so it would never be sent there. Use https, "
        "or set allow_http: true in this auth if that network is trusted" in plan.out
    ), plan.out
