"""The downloader against a fault-injecting HTTP server on loopback.

In every case the outcome is either the right bytes under the final name or a clear error
with no final file. Backoff sleeps are recorded instead of slept (Policy.sleep).
"""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptflow.data.download import Policy, download, read_sha256sums
from gptflow.errors import GptflowError
from tests.support.faultserver import FaultServer

DATA = os.urandom(3_000_001)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def server():
    s = FaultServer()
    yield s
    s.close()


@pytest.fixture
def policy():
    waits = []
    p = Policy(attempts=4, read_timeout=5, sleep=waits.append)
    p.waits = waits
    return p


def fetch(url, out, policy, **kw):
    return download([url] if isinstance(url, str) else url, out, policy=policy, **kw)


def test_plain_download_records_the_checksum_and_is_not_repeated(server, policy, tmp_path):
    url = server.add("a.bin", DATA)
    out = tmp_path / "raw" / "a.bin"
    sums = tmp_path / "raw" / "SHA256SUMS"
    r = fetch(url, out, policy, sha256sums=sums)
    assert out.read_bytes() == DATA and r.sha256 == SHA
    assert read_sha256sums(sums) == {"a.bin": SHA}
    assert (tmp_path / "raw" / "a.bin.sha256").read_text().split()[0] == SHA
    assert not list((tmp_path / "raw").glob("*.part*"))
    fetch(url, out, policy, sha256sums=sums)  # present and verified: no request
    assert len(server.requests("a.bin")) == 1


def test_connection_dropped_mid_body_resumes_with_range(server, policy, tmp_path):
    url = server.add("a.bin", DATA, ("drop", 1_000_000), ("drop", 500_000))
    r = fetch(url, tmp_path / "a.bin", policy, sha256=SHA)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    ranges = [q["range"] for q in server.requests("a.bin")]
    assert ranges == [None, "bytes=1000000-", "bytes=1500000-"]
    assert sum(q["sent"] for q in server.requests("a.bin")) == len(DATA)  # no byte fetched twice
    assert r.attempts == 3


def test_500_then_success(server, policy, tmp_path):
    url = server.add("a.bin", DATA, ("status", 500), ("status", 503))
    fetch(url, tmp_path / "a.bin", policy, sha256=SHA)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    assert len(policy.waits) == 2 and policy.waits[1] > policy.waits[0] / 2  # exponential backoff


def test_429_honours_retry_after(server, policy, tmp_path):
    url = server.add("a.bin", DATA, ("retry_after", 7))
    fetch(url, tmp_path / "a.bin", policy)
    assert policy.waits == [7.0]
    assert (tmp_path / "a.bin").read_bytes() == DATA


def test_body_shorter_than_content_length_is_completed(server, policy, tmp_path):
    url = server.add("a.bin", DATA, ("short", 2_000_000))
    fetch(url, tmp_path / "a.bin", policy, sha256=SHA)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    assert [q["range"] for q in server.requests("a.bin")] == [None, "bytes=2000000-"]


def test_server_ignoring_range_restarts_instead_of_appending(server, policy, tmp_path):
    url = server.add("a.bin", DATA, ("drop", 1_000_000), "ignore_range")
    fetch(url, tmp_path / "a.bin", policy, sha256=SHA)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    assert server.requests("a.bin")[1]["range"] == "bytes=1000000-"  # asked to resume...
    assert server.requests("a.bin")[1]["sent"] == len(DATA)  # ...got everything, kept it once


def test_wrong_checksum_is_an_error_and_leaves_no_file(server, policy, tmp_path):
    url = server.add("a.bin", DATA, "corrupt", "corrupt")
    with pytest.raises(GptflowError) as e:
        fetch(url, tmp_path / "a.bin", policy, sha256=SHA)
    msg = str(e.value)
    assert f"a.bin: every URL failed (http://127.0.0.1:{server.port}/a.bin: sha256 mismatch" in msg
    assert "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_checksum_recorded_by_the_first_download_guards_later_ones(server, policy, tmp_path):
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  a.bin\n")
    url = server.add("a.bin", DATA)
    with pytest.raises(GptflowError, match=rf"expected {'0' * 64} \(recorded in {sums}\)"):
        fetch(url, tmp_path / "a.bin", policy, sha256sums=sums)
    assert not (tmp_path / "a.bin").exists()


def test_host_published_sha256_is_checked(server, policy, tmp_path):
    url = server.add("a.bin", DATA, headers={"X-Linked-Etag": f'"{"f" * 64}"'})
    with pytest.raises(GptflowError, match=r"expected f{64} \(published by 127\.0\.0\.1\)"):
        fetch(url, tmp_path / "a.bin", policy)
    good = server.add("b.bin", DATA, headers={"X-Linked-Etag": f'"{SHA}"'})
    r = fetch(good, tmp_path / "b.bin", policy)
    assert r.checksum_source == "published by 127.0.0.1"


def test_dead_primary_fails_over_to_the_mirror(server, policy, tmp_path):
    dead = "http://127.0.0.1:9/a.bin"  # nothing listens on the discard port
    mirror = server.add("a.bin", DATA)
    r = fetch([dead, server.url("missing.bin"), mirror], tmp_path / "a.bin", policy, sha256=SHA)
    assert r.url == mirror
    assert r.tried[0].startswith(
        "http://127.0.0.1:9/a.bin: gave up after 4 attempts (connection failed"
    )
    assert r.tried[1] == f"http://127.0.0.1:{server.port}/missing.bin: HTTP 404"


def test_every_url_failing_names_them_all(policy, tmp_path):
    with pytest.raises(GptflowError) as e:
        fetch(["http://127.0.0.1:9/x.zip", "http://127.0.0.1:7/x.zip"], tmp_path / "x.zip", policy)
    msg = str(e.value)
    assert msg.startswith(
        "x.zip: every URL failed (http://127.0.0.1:9/x.zip: gave up after 4 attempts"
    )
    assert "http://127.0.0.1:7/x.zip: gave up" in msg
    assert msg.endswith("Check the URLs, mirrors and network")
    assert not list(tmp_path.iterdir())


def test_token_goes_only_to_its_host_and_is_never_printed(
    server, policy, tmp_path, caplog, monkeypatch
):
    monkeypatch.setenv("MY_TOKEN", "s3cr3t-t0ken")
    url = server.add("a.bin", DATA, ("drop", 10))
    caplog.set_level("INFO")
    fetch(url, tmp_path / "a.bin", policy, token_env="MY_TOKEN", token_hosts=["127.0.0.1"])
    assert {q["authorization"] for q in server.requests("a.bin")} == {"Bearer s3cr3t-t0ken"}
    other = server.add("b.bin", DATA)
    fetch(other, tmp_path / "b.bin", policy, token_env="MY_TOKEN", token_hosts=["hf.example"])
    assert server.requests("b.bin")[0]["authorization"] is None
    assert "s3cr3t" not in caplog.text


def start_slow_download(server, tmp_path, size, bps, min_part_bytes):
    """`gptflow download` (the real CLI) of a slowly served file, once its .part holds
    `min_part_bytes`. Returns (process, command, output path, data)."""
    data = os.urandom(size)
    url = server.add("big.bin", data, ("slow", bps))
    out = tmp_path / "big.bin"
    cmd = [str(Path(sys.executable).parent / "gptflow"), "download", url, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    part = Path(f"{out}.part")
    deadline = time.time() + 60
    while time.time() < deadline and (not part.exists() or part.stat().st_size < min_part_bytes):
        time.sleep(0.05)
    return proc, cmd, out, data


def test_sigkilled_download_resumes_fetching_only_the_missing_bytes(server, tmp_path):
    """The real CLI, killed with SIGKILL mid-body, then rerun."""
    proc, cmd, out, data = start_slow_download(server, tmp_path, 4_000_000, 1_000_000, 1_000_000)
    part = Path(f"{out}.part")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = part.stat().st_size
    assert 1_000_000 <= kept < len(data) and not out.exists()
    rerun = subprocess.run(
        [*cmd, "--sha256", hashlib.sha256(data).hexdigest()], capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"resumed at byte {kept}" in rerun.stdout
    assert out.read_bytes() == data
    second = server.requests("big.bin")[1]
    assert second["range"] == f"bytes={kept}-"
    assert second["sent"] == len(data) - kept  # only the missing bytes crossed the wire


def test_second_downloader_of_the_same_file_is_refused(server, tmp_path):
    first, cmd, _, _ = start_slow_download(server, tmp_path, 2_000_000, 500_000, 0)
    try:
        second = subprocess.run(cmd, capture_output=True, text=True)
        assert second.returncode == 1
        assert "another download of this file is running" in second.stderr
    finally:
        first.kill()
        first.wait()
