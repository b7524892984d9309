"""Resumable, verified HTTP downloads: nothing reaches its final name unless it is complete.

``download(urls, out)`` fetches the first URL that works (mirrors are tried in order) into
``out.part``, resuming with an HTTP ``Range`` request after any interruption -- a dropped
connection, a short body, a killed process -- and checks the sha256 before the atomic rename
to ``out``. Details that matter:

* retries with exponential backoff (and jitter) on connection errors, timeouts, 5xx and 429,
  honouring ``Retry-After``; attempts that made progress do not count against the budget;
* a server that ignores ``Range`` (200 instead of 206) or whose file changed (``If-Range``
  with the recorded ETag/Last-Modified fails) restarts the file from byte 0, never appends;
* the expected sha256 comes from the catalog, else from the lock file ``SHA256SUMS`` beside
  the data (recorded by the first verified download, checked by every later one), else from
  the host itself when it publishes one (Hugging Face's ``X-Linked-Etag``);
* a bearer token for gated hosts is read from an environment variable (never from a command
  line) and sent only to the origins it is configured for -- scheme, host and port, https
  unless allowed otherwise -- including across redirects: we follow them ourselves and a hop
  to another origin goes without the token, as curl does since CVE-2018-1000007 (the token's
  scope: :mod:`gptflow.data.token_scope`); URLs with a user name or password in them are
  refused, and messages show URLs without query strings (they may carry signatures);
* one downloader per file: the ``.part`` file is locked while written.

Over 500 lines: one call, :func:`download`, and what it needs to be safe -- the checksum lock,
the progress line, the resumable fetch and its redirects -- which share one file's state
(``.part``, its metadata, the running sha256) and are tested together against the fault server.
"""

from __future__ import annotations

import contextlib
import email.utils
import fcntl
import hashlib
import json
import logging
import os
import queue
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urljoin, urlsplit

from gptflow.data.token_scope import (
    DEFAULT_PORTS,
    TokenScope,
    refuse_credentials_in_urls,
    safe_url,
    scope_for,
)
from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write, fsync_dir, sha256_file
from gptflow.progress import Progress, progress_line

log = logging.getLogger("gptflow.download")

CHUNK = 1 << 20  # bytes per read
HEX64 = re.compile(r"^[0-9a-f]{64}$")
REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 10


@dataclass
class Policy:
    """How hard to try. Times in seconds."""

    connect_timeout: float = 15.0
    read_timeout: float = 60.0
    attempts: int = 8  # per URL, counting only attempts that made no progress
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    retry_after_max: float = 300.0
    report_every: float = 10.0  # seconds between progress lines when not on a terminal
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)


class _Retry(Exception):
    def __init__(self, why: str, wait: float | None = None):
        super().__init__(why)
        self.wait = wait


class _NextUrl(Exception):
    pass


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    with contextlib.suppress(TypeError, ValueError):
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    return None


def _published_sha256(headers) -> str | None:
    """A sha256 the server states for the body (Hugging Face: X-Linked-Etag of LFS files)."""
    for name in ("X-Linked-Etag", "X-Linked-ETag"):
        value = headers.get(name, "").strip('"').lower()
        if HEX64.match(value):
            return value
    return None


def _host(url: str) -> str:
    return urlsplit(url).hostname or ""


# ----------------------------------------------------------------------------- checksum lock


def read_sha256sums(path: Path) -> dict[str, str]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and HEX64.match(parts[0]):
                out[parts[1].lstrip("*")] = parts[0]
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def record_sha256(path: Path, name: str, digest: str) -> None:
    """Add ``digest  name`` to a SHA256SUMS lock file (atomic, safe under parallel jobs)."""
    with _locked(path):
        sums = read_sha256sums(path)
        if sums.get(name) == digest:
            return
        if name in sums:
            raise GptflowError(
                f"{path}: records sha256 {sums[name]} for {name}, the download has {digest}; "
                f"the upstream file changed. If the new one is right, delete that line"
            )
        sums[name] = digest
        with atomic_write(path) as f:
            f.writelines(f"{d}  {n}\n" for n, d in sorted(sums.items()))


# ----------------------------------------------------------------------------- progress


class _TerminalBar:
    """tqdm's bar, for a download run by hand on a terminal (jobs log lines instead)."""

    def __init__(self, name: str, total: int | None, start: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, initial=start, unit="B", unit_scale=True, desc=name, leave=False
        )

    def update(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _progress(name: str, total: int | None, start: int, every: float) -> _TerminalBar | Progress:
    if sys.stderr.isatty():
        return _TerminalBar(name, total, start)
    unknown = "the server sent no Content-Length"
    return Progress(
        name, log.info, every=every, total_bytes=total, start_bytes=start, unknown=unknown
    )


# ----------------------------------------------------------------------------- download


@dataclass
class Result:
    path: str
    url: str
    sha256: str
    bytes: int
    seconds: float
    resumed_from: int
    attempts: int
    checksum_source: str
    tried: list[str]


def download(
    urls: list[str],
    out: str | os.PathLike,
    *,
    sha256: str | None = None,
    sha256sums: str | os.PathLike | None = None,
    token_env: str | None = None,
    token_origins: list[str] | None = None,
    allow_http: bool = False,
    policy: Policy | None = None,
    session=None,
) -> Result:
    """Download the first of `urls` that works to `out`; see the module docstring.

    The token in ``$token_env`` goes to `token_origins` (``https://host[:port]``; a bare host
    means https on port 443; default the origin of the first URL), over http only with
    `allow_http`."""
    import requests

    refuse_credentials_in_urls(urls, "download")
    policy = policy or Policy()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sums_path = Path(sha256sums) if sha256sums else None
    expected, source = _expected_sha256(sha256, sums_path, out.name)
    if out.exists():
        return _already_there(out, expected, source, sums_path)
    scope = scope_for(urls, token_env, token_origins, allow_http)
    session = session or requests.Session()
    part = Path(f"{out}.part")
    meta_path = Path(f"{out}.part.json")
    errors: list[str] = []
    t0 = time.monotonic()
    with open(part, "ab") as lock_fh:
        try:
            fcntl.flock(lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GptflowError(
                f"{part}: another download of this file is running; wait for it"
            ) from None
        hasher = _RunningHash()
        try:
            result = _first_that_works(
                urls, errors, session, part, meta_path, expected, source, scope, policy, out.name, hasher
            )  # fmt: skip
        finally:
            hasher.close()
        if result is not None:
            return _publish(out, part, meta_path, sums_path, result, errors, t0)
        if part.exists() and part.stat().st_size == 0:  # nothing to resume from: leave no trace
            part.unlink()
            meta_path.unlink(missing_ok=True)
    tried = "; ".join(errors) or "no URLs given"
    raise GptflowError(
        f"{out.name}: every URL failed ({tried}). Check the URLs, mirrors and network"
    )


def _expected_sha256(
    sha256: str | None, sums_path: Path | None, name: str
) -> tuple[str | None, str | None]:
    """The sha256 the file must have and where that comes from: given, recorded in the
    SHA256SUMS lock by an earlier verified download, or (None, None): not known yet. A given
    sha256 the lock contradicts is refused here, before any byte is fetched (checked after the
    download, it cost a whole download, and its retries, to be refused)."""
    recorded = read_sha256sums(sums_path).get(name) if sums_path else None
    if sha256:
        if not HEX64.match(sha256.lower()):
            raise GptflowError(f"--sha256 {sha256!r} is not a sha256 (64 hex digits)")
        if recorded and recorded != sha256.lower():
            raise GptflowError(
                f"{sums_path}: records sha256 {recorded} for {name}, but {sha256.lower()} is "
                f"given (the catalog's sha256, or --sha256): one of them is out of date. If the "
                f"given one is right, delete that line; nothing was downloaded"
            )
        return sha256.lower(), "given"
    return (recorded, f"recorded in {sums_path}") if recorded else (None, None)


def _already_there(out: Path, expected: str | None, source: str | None, sums_path) -> Result:
    """A file downloaded before: checked against the expected sha256, not fetched again."""
    digest = sha256_file(out)
    if expected and digest != expected:
        raise GptflowError(
            f"{out}: exists but its sha256 is {digest}, expected {expected} ({source}); "
            f"delete it to download it again"
        )
    _finish(out, digest, sums_path)
    return Result(str(out), "", digest, out.stat().st_size, 0.0, 0, 0, source or "none", [])


def _publish(out: Path, part: Path, meta_path: Path, sums_path, result, errors, t0) -> Result:
    """The verified ``.part`` made durable and renamed to `out`, its sha256 recorded."""
    url, (digest, resumed_from, attempts, checksum_source) = result
    with open(part, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(part, out)
    fsync_dir(out.parent)
    meta_path.unlink(missing_ok=True)
    _finish(out, digest, sums_path)
    seconds = time.monotonic() - t0
    size = out.stat().st_size
    done = progress_line(
        out.name, seconds=seconds, nbytes=size, start_bytes=resumed_from, final=True
    )
    resumed = f", resumed at byte {resumed_from}" if resumed_from else ""
    log.info("%s from %s%s, sha256 %s (%s)", done, safe_url(url), resumed, digest, checksum_source)
    return Result(str(out), safe_url(url), digest, size, seconds, resumed_from, attempts,
                  checksum_source, [*errors, f"{safe_url(url)}: ok"])  # fmt: skip


def _first_that_works(
    urls, errors, session, part, meta_path, expected, source, scope, policy, name, hasher
):
    """(url, _fetch_one's result) of the first URL that delivers; failures go to `errors`."""
    for url in urls:
        try:
            return url, _fetch_one(
                session, url, part, meta_path, expected, source, scope, policy, name, hasher
            )
        except _NextUrl as e:
            errors.append(f"{safe_url(url)}: {e}")
            log.warning("%s: %s; trying the next URL", safe_url(url), e)
    return None


def _finish(out: Path, digest: str, sums_path: Path | None) -> None:
    with atomic_write(f"{out}.sha256") as f:
        f.write(f"{digest}  {out.name}\n")
    if sums_path:
        record_sha256(sums_path, out.name, digest)


class _RunningHash:
    """sha256 of the ``.part`` file, updated by a background thread as the bytes arrive.

    hashlib releases the GIL on large buffers, so hashing overlaps the network and the disk
    instead of costing a second pass over the file after the download.
    """

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.n = 0
        self._q: queue.Queue = queue.Queue(maxsize=32)
        self._thread = threading.Thread(target=self._run, daemon=True, name="sha256")
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            self._h.update(item)
            self.n += len(item)
            self._q.task_done()

    def feed(self, chunk: bytes) -> None:
        self._q.put(chunk)

    def sync_to(self, part: Path, offset: int) -> None:
        """Make the hash cover exactly bytes [0, offset) of `part`."""
        self._q.join()
        if self.n == offset:
            return
        self._h, self.n = hashlib.sha256(), 0
        if offset:
            with open(part, "rb") as f:
                remaining = offset
                while remaining and (block := f.read(min(CHUNK * 4, remaining))):
                    self._h.update(block)
                    self.n += len(block)
                    remaining -= len(block)

    def hexdigest(self) -> str:
        self._q.join()
        return self._h.hexdigest()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


class _Flusher:
    """Writes the file back to disk in the background (every FLUSH_BYTES) while it downloads,
    so the fsync before publishing finds little left to do."""

    FLUSH_BYTES = 128 << 20

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pending = 0
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="flush")
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            with contextlib.suppress(OSError):
                os.fdatasync(self.fd)

    def wrote(self, n: int) -> None:
        self.pending += n
        if self.pending >= self.FLUSH_BYTES:
            self.pending = 0
            self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()


def _fetch_one(session, url, part, meta_path, expected, source, scope, policy, name, hasher):
    """Download `url` into `part` until complete and verified. Returns (sha256, resumed_from,
    attempts, checksum source); raises _NextUrl when this URL cannot deliver."""
    import requests

    failures = 0
    attempts = 0
    resumed_from = part.stat().st_size if part.exists() else 0
    while True:
        attempts += 1
        offset = part.stat().st_size if part.exists() else 0
        before = offset
        try:
            outcome = _attempt(session, url, part, meta_path, offset, scope, policy, name, hasher)
        except _Retry as e:
            progressed = (part.stat().st_size if part.exists() else 0) > before
            failures = 0 if progressed else failures + 1
            if failures >= policy.attempts:
                raise _NextUrl(f"gave up after {attempts} attempts ({e})") from None
            wait = e.wait
            if wait is None:
                wait = min(policy.backoff_max, policy.backoff_base * 2 ** max(0, failures - 1))
                wait *= 0.5 + random.random() / 2
            wait = min(wait, policy.retry_after_max)
            log.warning("%s: %s; retrying in %.1f s", safe_url(url), e, wait)
            policy.sleep(wait)
            continue
        except (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema) as e:
            # the exception's text may quote the URL with its query string: name the type only
            raise _NextUrl(f"invalid URL ({type(e).__name__})") from None
        published = outcome
        hasher.sync_to(part, part.stat().st_size)
        digest = hasher.hexdigest()
        want, why = expected, source
        if want is None and published:
            want, why = published, f"published by {_host(url)}"
        if want is not None and digest != want:
            part.unlink(missing_ok=True)
            meta_path.unlink(missing_ok=True)
            raise _NextUrl(
                f"sha256 mismatch: got {digest}, expected {want} ({why}); the partial file was removed"
            )
        return digest, resumed_from, attempts, why or "none published; recorded now"


def _attempt(session, url, part, meta_path, offset, scope, policy, name, hasher) -> str | None:
    """One HTTP request. Returns the server-published sha256 (or None) when the body is complete."""
    import requests

    try:
        at, resp = _get(session, url, _request_headers(url, meta_path, offset), scope, policy)
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
        raise _Retry(f"connection failed ({type(e).__name__})") from None
    with resp:
        body = _body_of(resp, at, url, part, offset, scope, name)
        if body is None:  # 416 for a part file that was already complete
            return _published_sha256(resp.headers)
        mode, offset, total = body
        _write_meta(meta_path, url, resp.headers)
        progress = _progress(name, total, offset, policy.report_every)
        try:
            received = _stream(resp, part, mode, offset, hasher, progress)
        finally:
            if isinstance(progress, _TerminalBar):
                progress.close()
        expected_body = (total - offset) if total is not None else None
        if expected_body is not None and received < expected_body:
            raise _Retry(f"body ended after {received} of {expected_body} bytes")
        if expected_body is not None and received > expected_body:
            _truncate(part)
            raise _Retry(
                f"body longer than announced ({received} > {expected_body}); restarting", 0
            )
        return _published_sha256(resp.headers)


def _request_headers(url: str, meta_path: Path, offset: int) -> dict:
    """Identity encoding; from `offset` on, a Range, and If-Range with the validator the
    server gave this URL's earlier response (so a changed file is sent whole, not spliced)."""
    headers = {"Accept-Encoding": "identity", "User-Agent": "gptflow-download"}
    if offset > 0:
        headers["Range"] = f"bytes={offset}-"
        meta = _read_meta(meta_path)
        if meta.get("url_sha256") == _digest(url):
            validator = meta.get("etag") or meta.get("last_modified")
            if validator:
                headers["If-Range"] = validator
    return headers


def _body_of(resp, at: str, url: str, part: Path, offset: int, scope, name: str):
    """What the response's status means for the part file: (open mode, offset the body
    starts at, total bytes or None); None when a 416 says the part file is complete. Errors
    and mismatched ranges raise _Retry (this URL again) or _NextUrl (the next mirror)."""
    status = resp.status_code
    if status == 429 or status >= 500:
        raise _Retry(f"HTTP {status}", _retry_after(resp.headers.get("Retry-After")))
    if status in (401, 403):
        via = f" from {safe_url(at)}" if at != url else ""
        raise _NextUrl(f"HTTP {status}{via}{scope.hint(at)}")
    if status == 416 and offset > 0:
        if _content_range_total(resp.headers.get("Content-Range")) == offset:
            return None
        _truncate(part)
        raise _Retry("HTTP 416 for a stale partial file; restarting from byte 0", 0)
    if status not in (200, 206):
        raise _NextUrl(f"HTTP {status}")
    if status == 206:
        start = _content_range_start(resp.headers.get("Content-Range"))
        if start != offset:
            _truncate(part)
            raise _Retry(f"server resumed at byte {start}, not {offset}; restarting from byte 0", 0)
        return "ab", offset, _content_range_total(resp.headers.get("Content-Range"))
    # 200: the whole body, whatever we asked for (Range ignored or If-Range failed)
    if offset:
        log.info(
            "%s: server sent the whole file (Range not honoured); restarting from byte 0", name
        )
    total = int(resp.headers["Content-Length"]) if "Content-Length" in resp.headers else None
    return "wb", 0, total


def _stream(resp, part: Path, mode: str, offset: int, hasher, progress) -> int:
    """The body into the part file (appended, or from byte 0), hashed and reported as it
    comes; returns the bytes received. Every byte that arrived is kept."""
    import requests

    # Read the raw stream ourselves: urllib3 would raise on a short body and drop the bytes
    # of the read in progress; we keep every byte that arrived and check the length after.
    resp.raw.enforce_content_length = False
    hasher.sync_to(part, offset)
    received = 0
    with open(part, mode) as fh:
        flusher = _Flusher(fh.fileno())
        try:
            while chunk := resp.raw.read(CHUNK, decode_content=False):
                fh.write(chunk)
                hasher.feed(chunk)
                received += len(chunk)
                flusher.wrote(len(chunk))
                progress.update(len(chunk))
        except (requests.exceptions.RequestException, OSError, *_urllib3_errors()) as e:
            raise _Retry(f"connection lost after {received} bytes ({type(e).__name__})") from None
        finally:
            flusher.close()
    return received


def _get(session, url: str, headers: dict, scope: TokenScope, policy: Policy):
    """GET `url`, following redirects ourselves so that every hop gets the token only if its
    own origin is in scope (requests' own rule differs across versions: older ones carried it
    to another port or scheme of the same host). Returns (final URL, response)."""
    for _ in range(MAX_REDIRECTS + 1):
        resp = session.get(
            url,
            headers={**headers, **scope.headers_for(url)},
            stream=True,
            timeout=(policy.connect_timeout, policy.read_timeout),
            allow_redirects=False,
            auth=_no_netrc,
        )
        location = resp.headers.get("Location")
        if resp.status_code not in REDIRECTS or not location:
            return url, resp
        resp.close()
        target = urljoin(url, location)
        parts = urlsplit(target)
        if parts.scheme not in DEFAULT_PORTS:
            raise _NextUrl(f"redirected to a {parts.scheme or 'scheme-less'} URL; not followed")
        if parts.username is not None or parts.password is not None:
            raise _NextUrl("redirected to a URL with a user name or password in it; not followed")
        token = "with the token" if scope.headers_for(target) else "without a token"
        log.info("%s: redirected to %s (%s)", safe_url(url), safe_url(target), token)
        url = target
    raise _NextUrl(f"more than {MAX_REDIRECTS} redirects")


def _no_netrc(request):
    """An explicit no-op auth: requests otherwise adds ~/.netrc credentials (Basic) to any
    request without one, replacing our Authorization header. As with curl without --netrc,
    the only credential a download sends is the token of auth.token_env."""
    return request


def _urllib3_errors() -> tuple[type[BaseException], ...]:
    import urllib3.exceptions as u

    return (u.ProtocolError, u.ReadTimeoutError, u.HTTPError)


def _content_range_start(value: str | None) -> int | None:
    m = re.match(r"bytes (\d+)-\d+/(\d+|\*)", value or "")
    return int(m.group(1)) if m else None


def _content_range_total(value: str | None) -> int | None:
    m = re.match(r"bytes (?:\d+-\d+|\*)/(\d+)", value or "")
    return int(m.group(1)) if m else None


def _truncate(part: Path) -> None:
    with open(part, "wb"):
        pass


def _read_meta(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _digest(url: str) -> str:
    """Which URL a partial file came from, without writing the URL (its query may be a
    signature) to disk."""
    return hashlib.sha256(url.encode()).hexdigest()


def _write_meta(path: Path, url: str, headers) -> None:
    meta = {
        "url_sha256": _digest(url),
        "etag": headers.get("ETag"),
        "last_modified": headers.get("Last-Modified"),
    }
    with atomic_write(path) as f:
        json.dump(meta, f)
