"""Real HTTP(S) origins on loopback that record the Authorization header of every request,
and a throwaway CA (made with the openssl CLI) whose certificate covers 127.0.0.1 and
localhost -- for the tests of where a download token goes."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.faultserver import send_held


class Origin:
    """A real HTTP(S) server on 127.0.0.1: per path, bytes to serve (optionally held mid-body
    until release()), a redirect or a bare status; records (path, Authorization) of every
    request."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.routes: dict[str, tuple] = {}
        self.log: list[tuple[str, str | None]] = []
        self._released = threading.Event()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                origin._handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.scheme = "https" if tls else "http"
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}/{path}"

    @property
    def origin(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def serve(self, path: str, data: bytes, hold_after: int | None = None) -> str:
        """`data` at `path`; with `hold_after`, the body stops after that many bytes until
        release() (or close()): a download certainly mid-body however slowly it started."""
        self.routes["/" + path] = ("file", data, hold_after)
        return self.url(path)

    def release(self) -> None:
        self._released.set()

    def redirect(self, path: str, location: str, code: int = 302) -> str:
        self.routes["/" + path] = ("redirect", code, location)
        return self.url(path)

    def status(self, path: str, code: int) -> str:
        self.routes["/" + path] = ("status", code)
        return self.url(path)

    def auth(self, path: str) -> list[str | None]:
        """The Authorization header of each request for `path`, in order."""
        return [a for p, a in self.log if p == "/" + path]

    def close(self) -> None:
        self.release()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        self.log.append((path, h.headers.get("Authorization")))
        route = self.routes.get(path, ("status", 404))
        if route[0] == "status":
            h.send_response(route[1])
            h.send_header("Content-Length", "0")
            h.end_headers()
        elif route[0] == "redirect":
            h.send_response(route[1])
            h.send_header("Location", route[2])
            h.send_header("Content-Length", "0")
            h.end_headers()
        else:
            _, data, hold_after = route
            h.send_response(200)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if hold_after is None:
                send_held(h.wfile, data, len(data), None)
            else:
                send_held(h.wfile, data, hold_after, self._released)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_tls(d: Path) -> tuple[ssl.SSLContext, Path] | None:
    """(server context, CA file) for 127.0.0.1 and localhost, made in `d`; None without the
    openssl CLI."""
    if not shutil.which("openssl"):
        return None
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=gptflow test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    _openssl("req", *ec, "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=localhost", cwd=d)
    (d / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    _openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "srv.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)  # fmt: skip
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "srv.pem", d / "srv.key")
    return ctx, d / "ca.pem"
