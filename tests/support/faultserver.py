"""A small HTTP server on loopback that misbehaves on request, and records what it was asked.

It stands in for the flaky hosts corpora come from: per path, a queue of behaviours is
consumed one request at a time (then the path is served correctly):

    "ok"                serve (honouring Range)
    ("drop", n)         announce the full length, send n bytes, close the connection
    ("short", n)        like drop, but the body is n bytes short of Content-Length and ends cleanly
    ("status", code)    answer with that status (e.g. 500, 404)
    ("retry_after", s)  429 with Retry-After: s
    "ignore_range"      always 200 with the whole body
    "corrupt"           serve other bytes of the same length
    ("from", n)         answer a Range request with a 206 from byte n instead of the byte
                        asked for (a cache or proxy that gets ranges wrong)
    ("slow", bps)       serve at about bps bytes per second
    ("no_length", bps)  like slow, without Content-Length: the body ends when the connection
                        closes (HTTP/1.1 servers streaming a body of unknown size do this)
    ("hold", n)         announce the full length, send n bytes, then nothing until release()
                        (or close()), then the rest: a download certainly mid-body for as long
                        as a test needs, however slowly the machine runs
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultServer:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.headers: dict[str, dict[str, str]] = {}
        self.plan: dict[str, list] = {}
        self.log: list[dict] = []
        self._lock = threading.Lock()
        self._released = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep the test output quiet
                pass

            def do_GET(self) -> None:
                server._handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}"

    def add(self, path: str, data: bytes, *plan, headers: dict | None = None) -> str:
        self.files["/" + path.lstrip("/")] = data
        self.plan["/" + path.lstrip("/")] = list(plan)
        self.headers["/" + path.lstrip("/")] = headers or {}
        return self.url(path)

    def requests(self, path: str) -> list[dict]:
        return [r for r in self.log if r["path"] == "/" + path.lstrip("/")]

    def release(self) -> None:
        """Held bodies ("hold") go on."""
        self._released.set()

    def close(self) -> None:
        self.release()
        self.httpd.shutdown()
        self.httpd.server_close()

    # --------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?")[0]
        with self._lock:
            queue = self.plan.get(path, [])
            action = queue.pop(0) if queue else "ok"
        record = {
            "path": path,
            "range": h.headers.get("Range"),
            "if_range": h.headers.get("If-Range"),
            "authorization": h.headers.get("Authorization"),
            "action": action,
            "sent": 0,
        }
        self.log.append(record)
        data = self.files.get(path)
        if data is None:
            return self._status(h, 404)
        name, arg = (action, None) if isinstance(action, str) else action
        if name == "status":
            return self._status(h, arg)
        if name == "retry_after":
            return self._status(h, 429, {"Retry-After": str(arg)})
        if name == "corrupt":
            data = bytes(b ^ 0xFF for b in data)
        start = 0
        rng = h.headers.get("Range")
        if rng and name != "ignore_range":
            start = int(rng.split("=")[1].split("-")[0])
            if start >= len(data):
                return self._status(h, 416, {"Content-Range": f"bytes */{len(data)}"})
            if name == "from":
                start = arg
        body = data[start:]
        h.send_response(206 if start else 200)
        if name == "no_length":
            h.send_header("Connection", "close")  # the end of the body
        else:
            h.send_header("Content-Length", str(len(body)))
        h.send_header("ETag", f'"{len(data)}-{hash(data) & 0xFFFF:x}"')
        h.send_header("Accept-Ranges", "bytes")
        for k, v in self.headers.get(path, {}).items():
            h.send_header(k, v)
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if name in ("drop", "short"):
            h.wfile.write(body[:arg])
            h.wfile.flush()
            record["sent"] = min(arg, len(body))
            h.close_connection = True
            if name == "drop":  # an abrupt end: no FIN handshake courtesy
                import socket

                h.connection.shutdown(socket.SHUT_RDWR)
            return
        if name == "hold":
            send_held(h.wfile, body, arg, self._released, lambda n: record.update(sent=n))
            return
        if name in ("slow", "no_length"):
            step = max(1, arg // 20)
            try:
                for i in range(0, len(body), step):
                    h.wfile.write(body[i : i + step])
                    h.wfile.flush()
                    record["sent"] += len(body[i : i + step])
                    time.sleep(step / arg)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        try:
            h.wfile.write(body)
            record["sent"] = len(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    @staticmethod
    def _status(h, code: int, headers: dict | None = None) -> None:
        h.send_response(code)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", "0")
        h.end_headers()


def send_held(wfile, body: bytes, n: int, released: threading.Event | None, sent=lambda n: None):
    """The first `n` bytes of `body`, then nothing until `released` is set (None: no wait),
    then the rest (FaultServer's ("hold", n), Origin's hold_after); `sent` hears the bytes
    sent so far. A client that went away ends it quietly."""
    try:
        wfile.write(body[:n])
        wfile.flush()
        sent(min(n, len(body)))
        if released is not None:
            released.wait()
        wfile.write(body[n:])
        sent(len(body))
    except (BrokenPipeError, ConnectionResetError):
        pass
