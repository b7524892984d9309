"""The downloader against a fault-injecting HTTP server on loopback.

In every case the outcome is either the right bytes under the final name or a clear error
with no final file. Backoff sleeps are recorded instead of slept (Policy.sleep).
"""

import email.utils
import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptflow.data.download import CHUNK, Policy, download, read_sha256sums, record_sha256
from gptflow.errors import GptflowError
from tests.support.faultserver import FaultServer
from tests.support.ports import refused_port

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


def assert_backoff(waits: list[float], nominal: list[float]) -> None:
    """Wait i is its nominal backoff, min(backoff_max, backoff_base * 2**i), times a jitter
    factor in [0.5, 1]."""
    assert len(waits) == len(nominal), waits
    for i, (wait, top) in enumerate(zip(waits, nominal, strict=True)):
        assert top / 2 <= wait <= top, f"wait {i + 1} is {wait}; expected in [{top / 2}, {top}]"


def test_500_then_success(server, policy, tmp_path):
    url = server.add("a.bin", DATA, ("status", 500), ("status", 503))
    fetch(url, tmp_path / "a.bin", policy, sha256=SHA)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    assert_backoff(policy.waits, [1.0, 2.0])  # Policy's default base 1 s, doubled


# seven failures in a row (5xx, and 429 without Retry-After), then the file
SEVEN_FAILURES = [("status", code) for code in (500, 503, 502, 429, 500, 504, 500)]
# base 0.5 s doubling per failure, capped at backoff_max 3 s
SEVEN_NOMINAL = [0.5, 1.0, 2.0, 3.0, 3.0, 3.0, 3.0]


@pytest.fixture
def capped_policy():
    waits = []
    p = Policy(attempts=8, backoff_base=0.5, backoff_max=3.0, read_timeout=5, sleep=waits.append)
    p.waits = waits
    return p


def test_backoff_doubles_from_the_base_up_to_the_cap_with_jitter(server, capped_policy, tmp_path):
    url = server.add("a.bin", DATA, *SEVEN_FAILURES)
    r = fetch(url, tmp_path / "a.bin", capped_policy, sha256=SHA)
    assert (tmp_path / "a.bin").read_bytes() == DATA and r.attempts == 8
    assert_backoff(capped_policy.waits, SEVEN_NOMINAL)
    factors = [w / top for w, top in zip(capped_policy.waits, SEVEN_NOMINAL, strict=True)]
    assert len(set(factors)) > 1, factors  # jittered: not the same fraction every time


@pytest.mark.parametrize(("draw", "factor"), [(0.0, 0.5), (1.0, 1.0)])
def test_backoff_jitter_spans_half_to_all_of_the_nominal_wait(
    server, capped_policy, tmp_path, monkeypatch, draw, factor
):
    """random.random() pinned to the ends of its range [0, 1): the jitter factor 0.5 + r/2
    reaches exactly half and (as its bound) all of the nominal wait, never beyond the cap."""
    monkeypatch.setattr(random, "random", lambda: draw)
    url = server.add("a.bin", DATA, *SEVEN_FAILURES)
    fetch(url, tmp_path / "a.bin", capped_policy, sha256=SHA)
    assert capped_policy.waits == [top * factor for top in SEVEN_NOMINAL]


def test_progress_restarts_the_backoff_and_the_budget(server, capped_policy, tmp_path):
    """Two failures, a dropped body that delivered bytes, two failures: after the progress the
    backoff starts again at the base (and the attempt budget again at zero)."""
    plan = [("status", 500), ("status", 500), ("drop", 1000), ("status", 500), ("status", 500)]
    url = server.add("a.bin", DATA, *plan)
    r = fetch(url, tmp_path / "a.bin", capped_policy, sha256=SHA)
    assert (tmp_path / "a.bin").read_bytes() == DATA and r.attempts == 6
    assert_backoff(capped_policy.waits, [0.5, 1.0, 0.5, 0.5, 1.0])


def test_429_honours_retry_after(server, policy, tmp_path):
    url = server.add("a.bin", DATA, ("retry_after", 7))
    fetch(url, tmp_path / "a.bin", policy)
    assert policy.waits == [7.0]
    assert (tmp_path / "a.bin").read_bytes() == DATA


def test_retry_after_is_capped_and_read_as_an_http_date(server, policy, tmp_path):
    """Retry-After beyond retry_after_max waits retry_after_max; an HTTP-date means the time
    until then (no jitter on either: the server said when)."""
    policy.retry_after_max = 30.0
    t0 = time.time()
    when = email.utils.formatdate(t0 + 20, usegmt=True)
    url = server.add("a.bin", DATA, ("retry_after", 1000), ("retry_after", when))
    fetch(url, tmp_path / "a.bin", policy, sha256=SHA)
    took = time.time() - t0
    assert (tmp_path / "a.bin").read_bytes() == DATA
    capped, dated = policy.waits
    assert capped == 30.0
    # the header holds whole seconds (up to 1 s before t0 + 20), read at some moment of the
    # fetch: not a fixed allowance for how long the requests took, which a busy machine exceeds
    assert 19.0 - took <= dated <= 20.0, (dated, took)


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
    with pytest.raises(GptflowError, match=r"^a\.bin: every URL failed \(") as e:
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


def test_a_given_sha256_the_lock_contradicts_is_refused_before_downloading(
    server, policy, tmp_path
):
    """The catalog's sha256 and the SHA256SUMS lock disagree (a catalog entry updated for a
    new upstream file, the lock still the old one's): refused before any request -- checked
    after the download, it was refused only once the whole file had been fetched, and
    published under its name."""
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  a.bin\n")
    url = server.add("a.bin", DATA)
    with pytest.raises(GptflowError) as e:
        fetch(url, tmp_path / "a.bin", policy, sha256=SHA, sha256sums=sums)
    assert str(e.value) == (
        f"{sums}: records sha256 {'0' * 64} for a.bin, but {SHA} is given (the catalog's "
        f"sha256, or --sha256): one of them is out of date. If the given one is right, delete "
        f"that line; nothing was downloaded"
    )
    assert server.requests("a.bin") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SHA256SUMS"]
    sums.write_text(f"{SHA}  a.bin\n")  # the lock agrees: downloaded and checked
    assert fetch(url, tmp_path / "a.bin", policy, sha256=SHA, sha256sums=sums).sha256 == SHA


def test_the_lock_never_changes_a_recorded_sha256(tmp_path):
    """record_sha256 adds a file's first verified sha256 and refuses another one for it later
    (two jobs racing past the check before the download, the upstream file changed between
    them): the recorded line stays, the others are kept."""
    sums = tmp_path / "SHA256SUMS"
    record_sha256(sums, "a.bin", SHA)
    record_sha256(sums, "b.bin", "1" * 64)
    record_sha256(sums, "a.bin", SHA)  # the same again: nothing to do
    with pytest.raises(GptflowError, match=rf"records sha256 {SHA} for a\.bin, the download has "
                       rf"{'2' * 64}; the upstream file changed"):  # fmt: skip
        record_sha256(sums, "a.bin", "2" * 64)
    assert read_sha256sums(sums) == {"a.bin": SHA, "b.bin": "1" * 64}


def test_host_published_sha256_is_checked(server, policy, tmp_path):
    url = server.add("a.bin", DATA, headers={"X-Linked-Etag": f'"{"f" * 64}"'})
    with pytest.raises(GptflowError, match=r"expected f{64} \(published by 127\.0\.0\.1\)"):
        fetch(url, tmp_path / "a.bin", policy)
    good = server.add("b.bin", DATA, headers={"X-Linked-Etag": f'"{SHA}"'})
    r = fetch(good, tmp_path / "b.bin", policy)
    assert r.checksum_source == "published by 127.0.0.1"


def test_a_file_already_there_is_checked_not_trusted(server, policy, tmp_path):
    """A file under the final name (copied in by hand, or left by another tool) is checked
    against the sha256 the catalog gives or the lock recorded; a wrong one is an error naming
    both and the fix, and nothing is fetched over it."""
    url = server.add("a.bin", DATA)
    out = tmp_path / "a.bin"
    out.write_bytes(DATA[:-1] + b"!")
    wrong = hashlib.sha256(out.read_bytes()).hexdigest()
    with pytest.raises(GptflowError, match=rf"a\.bin: exists but its sha256 is {wrong}, "
                       rf"expected {SHA} \(given\); delete it"):  # fmt: skip
        fetch(url, out, policy, sha256=SHA)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{SHA}  a.bin\n")
    with pytest.raises(GptflowError, match=rf"expected {SHA} \(recorded in {sums}\)"):
        fetch(url, out, policy, sha256sums=sums)
    assert server.requests("a.bin") == [] and out.read_bytes() != DATA


def test_a_sha256_in_capitals_is_the_same_sha256(server, policy, tmp_path):
    """sha256 values are compared as hex, whatever their case (sha256sum writes lowercase,
    some catalogs and web pages uppercase)."""
    url = server.add("a.bin", DATA)
    r = fetch(url, tmp_path / "a.bin", policy, sha256=SHA.upper())
    assert r.sha256 == SHA and r.checksum_source == "given"
    fetch(url, tmp_path / "a.bin", policy, sha256=SHA.upper())  # present: checked, not fetched
    assert len(server.requests("a.bin")) == 1


def test_a_partial_file_longer_than_the_file_is_not_taken_for_it(server, policy, tmp_path):
    """A .part longer than the file now is (the upstream file was replaced by a shorter one):
    the server answers the resume with 416 and the file's length, and the download starts
    again from byte 0 -- with no sha256 to catch it, the stale bytes would be published."""
    url = server.add("a.bin", DATA)
    (tmp_path / "a.bin.part").write_bytes(os.urandom(len(DATA) + 10))
    fetch(url, tmp_path / "a.bin", policy)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    assert [q["range"] for q in server.requests("a.bin")] == [f"bytes={len(DATA) + 10}-", None]


def test_a_resume_answered_from_another_byte_restarts(server, policy, tmp_path):
    """A 206 whose Content-Range starts elsewhere than the Range asked (a cache or proxy that
    gets ranges wrong) is not appended: the file starts again from byte 0. Without a sha256
    to catch it, a splice would be published."""
    url = server.add("a.bin", DATA, ("drop", 1_000_000), ("from", 1_500_000))
    fetch(url, tmp_path / "a.bin", policy)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    assert [q["range"] for q in server.requests("a.bin")] == [None, "bytes=1000000-", None]


def test_dead_primary_fails_over_to_the_mirror(server, policy, tmp_path):
    mirror = server.add("a.bin", DATA)
    with refused_port() as port:
        dead = f"http://127.0.0.1:{port}/a.bin"
        r = fetch([dead, server.url("missing.bin"), mirror], tmp_path / "a.bin", policy, sha256=SHA)
    assert r.url == mirror
    assert r.tried[0].startswith(f"{dead}: gave up after 4 attempts (connection failed")
    assert r.tried[1] == f"http://127.0.0.1:{server.port}/missing.bin: HTTP 404"
    assert_backoff(policy.waits, [1.0, 2.0, 4.0])  # the 4th failure moves on without a wait


def test_every_url_failing_names_them_all(policy, tmp_path):
    with refused_port() as a, refused_port() as b:
        urls = [f"http://127.0.0.1:{a}/x.zip", f"http://127.0.0.1:{b}/x.zip"]
        with pytest.raises(GptflowError, match=r"^x\.zip: every URL failed \(") as e:
            fetch(urls, tmp_path / "x.zip", policy)
    msg = str(e.value)
    assert msg.startswith(f"x.zip: every URL failed ({urls[0]}: gave up after 4 attempts")
    assert f"; {urls[1]}: gave up after 4 attempts" in msg
    assert msg.endswith("Check the URLs, mirrors and network")
    assert not list(tmp_path.iterdir())


def test_token_over_http_only_when_allowed_and_on_every_resumed_request(
    server, policy, tmp_path, caplog, monkeypatch
):
    """More in test_secrets.py (https origins, redirects, the command line)."""
    monkeypatch.setenv("MY_TOKEN", "s3cr3t-t0ken")
    url = server.add("a.bin", DATA, ("drop", 10))
    origin = f"http://127.0.0.1:{server.port}"
    with pytest.raises(GptflowError) as e:
        fetch(url, tmp_path / "a.bin", policy, token_env="MY_TOKEN")
    assert str(e.value) == (
        f"--token-origin {origin} is plain http: the token in $MY_TOKEN would cross the network "
        f"unencrypted. Use https, or pass --token-allow-http (auth.allow_http: true) if that "
        f"network is trusted"
    )
    assert server.requests("a.bin") == []  # refused before any request
    caplog.set_level("DEBUG")
    fetch(url, tmp_path / "a.bin", policy, token_env="MY_TOKEN", allow_http=True)
    assert [q["authorization"] for q in server.requests("a.bin")] == ["Bearer s3cr3t-t0ken"] * 2
    other = server.add("b.bin", DATA)
    fetch(other, tmp_path / "b.bin", policy, token_env="MY_TOKEN", token_origins=["hf.example"])
    assert server.requests("b.bin")[0]["authorization"] is None
    assert "s3cr3t" not in caplog.text


# The downloader writes whole reads of CHUNK bytes: a body held after its first CHUNK bytes
# is on disk up to there, and nothing more arrives until the server releases it.
HELD = CHUNK


def start_held_download(server, tmp_path, size):
    """`gptflow download` (the real CLI) of a file whose body the server stops after HELD
    bytes and holds open (until server.release()). Returns once those bytes are in the .part:
    the download is mid-body, holding its lock, however long the CLI took to start.
    Returns (process, command, output path, data)."""
    data = os.urandom(size)
    url = server.add("big.bin", data, ("hold", HELD))
    out = tmp_path / "big.bin"
    cmd = [str(Path(sys.executable).parent / "gptflow"), "download", url, "--out", str(out)]
    log = tmp_path / "first.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh)
    part = Path(f"{out}.part")
    deadline = time.monotonic() + 600  # a hang guard only: the wait is for the state
    while not (part.exists() and part.stat().st_size >= HELD):
        if proc.poll() is not None:
            pytest.fail(f"the download ended (exit {proc.returncode}) before byte {HELD}: "
                        f"{log.read_text()[-2000:]}")  # fmt: skip
        assert time.monotonic() < deadline, f"no {HELD} bytes in {part} within 600 s"
        time.sleep(0.05)
    return proc, cmd, out, data


def test_sigkilled_download_resumes_fetching_only_the_missing_bytes(server, tmp_path):
    """The real CLI, killed with SIGKILL mid-body, then rerun."""
    proc, cmd, out, data = start_held_download(server, tmp_path, 4_000_000)
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
    """A second `gptflow download` of a file while the first is mid-body (held there by the
    server, so the first still runs when the second starts, however slowly either starts)."""
    first, cmd, out, data = start_held_download(server, tmp_path, 2_000_000)
    try:
        second = subprocess.run(cmd, capture_output=True, text=True)
        assert second.returncode == 1, second.stdout + second.stderr
        assert "another download of this file is running" in second.stderr
        assert first.poll() is None and not out.exists()  # the first was running all along
        server.release()  # and it finishes, untouched by the refused second
        assert first.wait(timeout=120) == 0 and out.read_bytes() == data
    finally:
        server.release()
        first.kill()
        first.wait()


@pytest.fixture
def log_stream(monkeypatch):
    """What a job's log file receives: the gptflow loggers' lines on a stream that is not a
    terminal (jobs run without one, so no tqdm bar)."""
    import io
    import logging

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("gptflow")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(old_level)


SIZE = r"[\d.]+ [kMG]?B"
RATE = r"[\d.]+ MB/s"


def own_lines(stream, name: str) -> list[str]:
    """The download's own lines (a thread a test elsewhere left running may log too)."""
    return [line for line in stream.getvalue().splitlines() if line.startswith(f"{name}:")]


@pytest.fixture
def small_reads(monkeypatch):
    """Reads of 128 KiB instead of 1 MiB: a 2 MB body is ~16 updates of the progress, not two,
    so the count of lines does not hang on when two reads return on a loaded machine."""
    import gptflow.data.download as module

    monkeypatch.setattr(module, "CHUNK", 128 * 1024)


def test_progress_lines_with_share_rate_and_eta_then_the_totals(
    server, tmp_path, log_stream, small_reads
):
    """2 MB served at ~2 MB/s, a line every 0.3 s: several lines with the share, rate and
    ETA of the announced length, then the closing line with the totals."""
    data = os.urandom(2_000_000)
    url = server.add("a.bin", data, ("slow", 2_000_000))
    fetch(url, tmp_path / "a.bin", Policy(report_every=0.3))
    lines = own_lines(log_stream, "a.bin")
    progress = [line for line in lines if "ETA" in line]
    assert len(progress) >= 2, lines
    for line in progress:
        assert re.fullmatch(rf"a\.bin: {SIZE} of 2\.0 MB \([\d.]+%\) at {RATE}, ETA .+", line)
    assert re.fullmatch(
        rf"a\.bin: done, 2\.0 MB in [\d.]+ s at {RATE} from {re.escape(url)}, sha256 "
        rf"{hashlib.sha256(data).hexdigest()} \(none published; recorded now\)",
        lines[-1],
    ), lines


def test_progress_without_content_length_says_the_total_is_unknown(
    server, tmp_path, log_stream, small_reads
):
    data = os.urandom(2_000_000)
    url = server.add("a.bin", data, ("no_length", 2_000_000))
    fetch(url, tmp_path / "a.bin", Policy(report_every=0.3))
    assert (tmp_path / "a.bin").read_bytes() == data
    lines = own_lines(log_stream, "a.bin")
    progress = [line for line in lines if "unknown" in line]
    assert len(progress) >= 2, lines
    for line in progress:
        assert re.fullmatch(
            rf"a\.bin: {SIZE} at {RATE} \(total unknown: the server sent no Content-Length\)", line
        )
    assert lines[-1].startswith("a.bin: done, 2.0 MB in "), lines
