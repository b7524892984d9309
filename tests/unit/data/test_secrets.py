"""Where a dataset's token goes: real HTTPS servers on loopback record every request's
Authorization header.

The token (``auth.token_env``) goes only to its configured origins -- scheme, host and port
exactly -- over https unless ``allow_http``; a redirect is re-checked hop by hop, so a hop to
another origin goes without it and a hop back to an allowed origin carries it again (curl's
rule: CVE-2018-1000007, CVE-2022-27776). The value is never in a message, a log, a sidecar
file or a command line. The servers' certificates come from a throwaway CA made with the
openssl CLI; the downloader trusts it through REQUESTS_CA_BUNDLE, as a user behind a
corporate CA would.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptflow.data.download import CHUNK, Policy, download
from gptflow.data.sources import resolve_dataset
from gptflow.data.token_scope import parse_origin, token_origins
from gptflow.errors import GptflowError
from tests.support.origins import Origin
from tests.support.ports import refused_port

CANARY = "canary-7f3e9b1c-not-for-logs"
ENV = "GPTFLOW_TEST_TOKEN"
DATA = os.urandom(200_001)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def servers(tls, monkeypatch):
    """Two HTTPS origins (same host, different ports) and one plain HTTP origin."""
    ctx, ca = tls
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca))
    monkeypatch.setenv(ENV, CANARY)
    made = [Origin(ctx), Origin(ctx), Origin()]
    yield made
    for s in made:
        s.close()


@pytest.fixture
def policy():
    return Policy(attempts=2, read_timeout=10, sleep=lambda s: None)


def test_token_goes_to_its_https_origin_only(servers, policy, tmp_path, caplog):
    a, b, plain = servers
    caplog.set_level("DEBUG")  # urllib3's request lines too
    download([a.serve("a.bin", DATA)], tmp_path / "a.bin", token_env=ENV, policy=policy)
    assert a.auth("a.bin") == [f"Bearer {CANARY}"]
    # same host, another port: another origin
    download([b.serve("b.bin", DATA)], tmp_path / "b.bin", token_env=ENV,
             token_origins=[a.origin], policy=policy)  # fmt: skip
    assert b.auth("b.bin") == [None]
    # same port, another host name
    download([a.url("a.bin", host="localhost")], tmp_path / "c.bin", token_env=ENV,
             token_origins=[a.origin], policy=policy)  # fmt: skip
    assert a.auth("a.bin") == [f"Bearer {CANARY}", None]
    # http on a host:port whose https origin is allowed: another scheme, another origin
    https_twin = f"https://127.0.0.1:{plain.port}"
    download([plain.serve("d.bin", DATA)], tmp_path / "d.bin", token_env=ENV,
             token_origins=[https_twin], allow_http=True, policy=policy)  # fmt: skip
    assert plain.auth("d.bin") == [None]
    assert CANARY not in caplog.text
    for sidecar in tmp_path.glob("*.sha256"):
        assert sidecar.read_text().split() == [SHA, sidecar.name.removesuffix(".sha256")]


def test_a_mirror_on_another_origin_gets_no_token(servers, policy, tmp_path):
    a, b, _ = servers
    r = download([a.url("gone.bin"), b.serve("m.bin", DATA)], tmp_path / "m.bin",
                 token_env=ENV, policy=policy)  # fmt: skip
    assert r.sha256 == SHA
    assert a.auth("gone.bin") == [f"Bearer {CANARY}"]  # 404; the primary's origin is the default
    assert b.auth("m.bin") == [None]


def test_http_origin_is_refused_without_allow_http_and_nothing_is_requested(
    servers, policy, tmp_path
):
    _, _, plain = servers
    url = plain.serve("p.bin", DATA)
    with pytest.raises(GptflowError) as e:
        download([url], tmp_path / "p.bin", token_env=ENV, policy=policy)
    assert str(e.value) == (
        f"--token-origin {plain.origin} is plain http: the token in ${ENV} would cross the "
        f"network unencrypted. Use https, or pass --token-allow-http (auth.allow_http: true) "
        f"if that network is trusted"
    )
    assert plain.log == [] and not list(tmp_path.iterdir())
    download([url], tmp_path / "p.bin", token_env=ENV, allow_http=True, policy=policy)
    assert plain.auth("p.bin") == [f"Bearer {CANARY}"]


REDIRECT_TARGETS = ["other port", "other host name", "scheme-relative, other host name"]


@pytest.mark.parametrize("target", REDIRECT_TARGETS)
@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_redirect_to_another_origin_drops_the_token(
    servers, policy, tmp_path, caplog, target, code
):
    a, b, _ = servers
    caplog.set_level("INFO")
    a.serve("x.bin", DATA)
    landed, location, followed = {
        "other port": (b, b.serve("x.bin", DATA), b.url("x.bin")),
        "other host name": (a, a.url("x.bin", "localhost"), a.url("x.bin", "localhost")),
        "scheme-relative, other host name": (
            a, f"//localhost:{a.port}/x.bin?sig=1", a.url("x.bin", "localhost")
        ),
    }[target]  # fmt: skip
    url = a.redirect("start.bin", location, code)
    r = download([url], tmp_path / "x.bin", token_env=ENV, policy=policy)
    assert r.sha256 == SHA
    assert a.auth("start.bin") == [f"Bearer {CANARY}"]
    assert landed.auth("x.bin") == [None]
    assert f"{url}: redirected to {followed} (without a token)" in caplog.text
    assert CANARY not in caplog.text


def test_redirect_back_to_the_allowed_origin_carries_the_token_again(servers, policy, tmp_path):
    """Decided per hop against the configured origins (curl compares each hop with the
    origin it was given, so it does the same)."""
    a, b, _ = servers
    a.serve("final.bin", DATA)
    b.redirect("bounce.bin", a.url("final.bin"), 302)
    url = a.redirect("start.bin", b.url("bounce.bin"), 302)
    download([url], tmp_path / "f.bin", token_env=ENV, policy=policy)
    assert a.auth("start.bin") == [f"Bearer {CANARY}"]
    assert b.auth("bounce.bin") == [None]
    assert a.auth("final.bin") == [f"Bearer {CANARY}"]


def test_https_to_http_downgrade_of_an_allowed_host_gets_no_token(servers, policy, tmp_path):
    """Only https origins configured: a redirect to http on an allowed host name loses it."""
    a, _, plain = servers
    plain.serve("y.bin", DATA)
    url = a.redirect("start.bin", plain.url("y.bin"), 302)
    download([url], tmp_path / "y.bin", token_env=ENV,
             token_origins=["127.0.0.1", a.origin], policy=policy)  # fmt: skip
    assert plain.auth("y.bin") == [None]


def test_netrc_credentials_are_not_sent_nor_replace_the_token(
    servers, policy, tmp_path, monkeypatch
):
    a, _, _ = servers
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine 127.0.0.1 login me password netrc-{CANARY}\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    download([a.serve("n.bin", DATA)], tmp_path / "n1.bin", policy=policy)
    download([a.url("n.bin")], tmp_path / "n2.bin", token_env=ENV, policy=policy)
    assert a.auth("n.bin") == [None, f"Bearer {CANARY}"]


def test_partial_download_state_holds_no_query_string(tmp_path, monkeypatch):
    """The .part.json kept for resuming records which URL by its sha256, not the URL (whose
    query may be a signature); the resumed request still sends If-Range."""
    from tests.support.faultserver import FaultServer

    server = FaultServer()
    try:
        url = server.add("q.bin", DATA, ("drop", 50_000), ("status", 500), ("status", 500))
        signed = f"{url}?X-Amz-Signature={CANARY}"
        policy = Policy(attempts=2, sleep=lambda s: None)
        with pytest.raises(GptflowError):
            download([signed], tmp_path / "q.bin", policy=policy)
        state = (tmp_path / "q.bin.part.json").read_text()
        assert CANARY not in state and "127.0.0.1" not in state
        download([signed], tmp_path / "q.bin", policy=policy)
        last = server.requests("q.bin")[-1]
        assert (last["range"], last["if_range"] is not None) == ("bytes=50000-", True)
        assert (tmp_path / "q.bin").read_bytes() == DATA
    finally:
        server.close()


def test_redirects_not_followed(servers, policy, tmp_path):
    a, _, _ = servers
    a.redirect("cred.bin", f"https://user:{CANARY}@127.0.0.1:{a.port}/x.bin")
    a.redirect("ftp.bin", "ftp://127.0.0.1/x.bin")
    a.redirect("loop.bin", a.url("loop.bin"))
    for name, why in [
        ("cred.bin", "redirected to a URL with a user name or password in it; not followed"),
        ("ftp.bin", "redirected to a ftp URL; not followed"),
        ("loop.bin", "more than 10 redirects"),
    ]:
        with pytest.raises(GptflowError) as e:
            download([a.url(name)], tmp_path / name, token_env=ENV, policy=policy)
        assert str(e.value) == (
            f"{name}: every URL failed ({a.url(name)}: {why}). Check the URLs, mirrors and network"
        )
    assert len(a.auth("loop.bin")) == 11


def test_messages_show_no_credentials_or_query_strings(policy, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, CANARY)
    with pytest.raises(GptflowError) as e:
        download([f"https://user:{CANARY}@example.org/a.bin"], tmp_path / "a.bin", policy=policy)
    assert str(e.value) == (
        "download: https://example.org/a.bin has a user name or password in the URL; URLs are "
        "logged and passed on command lines. Remove it and put a token in an environment "
        "variable named by auth.token_env"
    )
    with refused_port() as port:
        url = f"https://127.0.0.1:{port}/a.bin?X-Amz-Signature=SIG{CANARY}"
        with pytest.raises(GptflowError) as e:
            download([url], tmp_path / "a.bin", token_env=ENV,
                     token_origins=[f"https://127.0.0.1:{port}"], policy=policy)  # fmt: skip
    assert str(e.value) == (
        f"a.bin: every URL failed (https://127.0.0.1:{port}/a.bin: gave up after 2 attempts "
        f"(connection failed (ConnectionError))). Check the URLs, mirrors and network"
    )
    assert not list(tmp_path.iterdir())


def test_unauthorised_answers_name_the_variable_not_the_value(
    servers, policy, tmp_path, monkeypatch
):
    a, b, _ = servers
    gated = a.status("gated.bin", 401)
    with pytest.raises(GptflowError) as e:
        download([gated], tmp_path / "g.bin", token_env=ENV, policy=policy)
    assert f"{gated}: HTTP 401 (is the token in ${ENV} valid?)" in str(e.value)
    moved = a.redirect("moved.bin", b.status("gated.bin", 403))
    with pytest.raises(GptflowError) as e:
        download([moved], tmp_path / "g.bin", token_env=ENV, policy=policy)
    assert (
        f"{moved}: HTTP 403 from {b.url('gated.bin')} (the token in ${ENV} goes only to "
        f"{a.origin}; list this origin in auth.origins if it needs the token)" in str(e.value)
    )
    monkeypatch.delenv(ENV)
    with pytest.raises(GptflowError) as e:
        download([gated], tmp_path / "g.bin", token_env=ENV, policy=policy)
    assert f"{gated}: HTTP 401 (gated: ${ENV} is not set)" in str(e.value)
    assert b.auth("gated.bin") == [None] and a.auth("gated.bin") == [f"Bearer {CANARY}", None]


def test_cli_reads_the_token_from_the_environment_never_from_its_command_line(servers, tmp_path):
    """The real `gptflow download`, as the download rule runs it (output into a log file):
    the running process's command line names the variable only; the token reaches the
    server and nothing the job writes."""
    a, _, _ = servers
    data = os.urandom(1_500_000)
    url = a.serve("slow.bin", data, hold_after=CHUNK)  # mid-body until a.release()
    out, log = tmp_path / "raw" / "slow.bin", tmp_path / "slow.log"
    cmd = [str(Path(sys.executable).parent / "gptflow"), "download", url, "--out", str(out),
           "--token-env", ENV, "--token-host", a.origin, "--sha256sums", str(tmp_path / "raw" / "SHA256SUMS")]  # fmt: skip
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=os.environ)
        try:
            deadline = time.monotonic() + 600  # a hang guard only: the wait is for the state
            part = Path(f"{out}.part")
            while not (part.exists() and part.stat().st_size >= CHUNK):  # whole reads of CHUNK
                assert proc.poll() is None, f"the download ended mid-body: {log.read_text()}"
                assert time.monotonic() < deadline, f"no {CHUNK} bytes in {part} within 600 s"
                time.sleep(0.05)
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
            assert proc.poll() is None, "the download ended before its command line was read"
        finally:
            a.release()
            assert proc.wait(timeout=60) == 0, log.read_text()
    assert [b"--token-env", ENV.encode()] == cmdline[cmdline.index(b"--token-env") :][:2]
    assert not any(CANARY.encode() in arg for arg in cmdline)
    assert a.auth("slow.bin") == [f"Bearer {CANARY}"]
    assert out.read_bytes() == data
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != out]
    assert sorted(p.name for p in written) == [
        "SHA256SUMS",
        "SHA256SUMS.lock",
        "slow.bin.sha256",
        "slow.log",
    ]
    for p in written:
        assert CANARY not in p.read_text(), p


# ----------------------------------------------------------------------------- plan time


def url_dataset(urls, auth=None, mirrors=()):
    spec = {"type": "url", "files": [{"url": u} for u in urls]}
    if mirrors:
        spec["files"][0]["mirrors"] = list(mirrors)
    if auth is not None:
        spec["auth"] = auth
    return resolve_dataset("gated", spec, catalog={}, catalog_path="", source="cfg.yaml")


def test_origins_default_to_the_primary_urls_and_are_normalised():
    d = url_dataset(["https://HF.example/a.jsonl", "https://hf.example:8443/b.jsonl"],
                    {"token_env": ENV})  # fmt: skip
    assert d.token_origins == ("https://hf.example", "https://hf.example:8443")
    d = url_dataset(["https://hf.example/a.jsonl"],
                    {"token_env": ENV, "origins": ["https://cdn.example:443/"], "hosts": ["hf.example"]})  # fmt: skip
    assert (d.token_env, d.token_origins, d.token_allow_http) == (
        ENV, ("https://cdn.example", "https://hf.example"), False
    )  # fmt: skip
    d = url_dataset(["http://10.0.0.1:8080/a.jsonl"], {"token_env": ENV, "allow_http": True})
    assert (d.token_origins, d.token_allow_http) == (("http://10.0.0.1:8080",), True)
    assert url_dataset(["http://10.0.0.1/a.jsonl"]).token_origins == ()


def test_without_auth_origins_the_token_never_goes_to_a_mirror():
    """The default scope is the primary URLs' origins only: a mirror on another host (or
    another port of the same host) does not get the token, and the download job is told so
    (its --token-origin words name the primary's origin alone)."""
    d = url_dataset(
        ["https://hf.example/a.jsonl", "https://hf.example/b.jsonl"], {"token_env": ENV},
        mirrors=["https://mirror.example/a.jsonl", "https://hf.example:8443/a.jsonl"],
    )  # fmt: skip
    assert d.token_origins == ("https://hf.example",)
    assert d.remote_files["a.jsonl"].mirror_args() == [
        "--mirror", "https://mirror.example/a.jsonl", "--mirror", "https://hf.example:8443/a.jsonl"
    ]  # fmt: skip
    assert d.token_origin_args() == ["--token-origin", "https://hf.example"]
    assert token_origins({"token_env": ENV}, ["https://hf.example/a"], "w") == (
        "https://hf.example",
    )


def test_a_token_that_could_never_be_sent_is_a_plan_time_error():
    with pytest.raises(GptflowError) as e:
        url_dataset(["http://10.0.0.1:8080/a.jsonl"], {"token_env": ENV})
    assert str(e.value) == (
        "cfg.yaml: datasets.gated.auth: http://10.0.0.1:8080 (of http://10.0.0.1:8080/a.jsonl) is "
        f"plain http; the token in ${ENV} goes only over https, so it would never be sent there. "
        "Use https, or set allow_http: true in this auth if that network is trusted"
    )
    with pytest.raises(
        GptflowError, match=r"^cfg\.yaml: datasets\.gated\.auth\.origins: http://h is plain http;"
    ):
        url_dataset(["https://h/a.jsonl"], {"token_env": ENV, "origins": ["http://h"]})
    with pytest.raises(GptflowError) as e:
        url_dataset(["https://h/a.jsonl"], {"token_env": ENV, "origins": ["https://h/path?q=1"]})
    assert str(e.value) == (
        "cfg.yaml: datasets.gated.auth.origins: 'https://h/path' is not an origin (it has a path "
        "or query); the token is scoped to scheme, host and port only: write https://h"
    )


def test_credentials_in_a_config_url_are_refused_at_plan_time():
    with pytest.raises(GptflowError) as e:
        url_dataset(["https://h/a.jsonl"], mirrors=[f"https://u:{CANARY}@mirror.example/a.jsonl"])
    assert str(e.value).startswith(
        "cfg.yaml: datasets.gated: https://mirror.example/a.jsonl has a user name or password"
    )
    assert CANARY not in str(e.value)


def test_parse_origin():
    assert parse_origin("HF.example", "k") == ("https", "hf.example", 443)
    assert parse_origin("http://[::1]:80/", "k") == ("http", "::1", 80)
    with pytest.raises(
        GptflowError, match=r"^k: 'https://h:x' is not an origin; write https://HOST"
    ):
        parse_origin("https://h:x", "k")
    assert token_origins({"token_env": ENV, "origins": ["https://[::1]:8443"]}, [], "w") == (
        "https://[::1]:8443",
    )
