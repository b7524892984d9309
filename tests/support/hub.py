"""A real HTTP server on loopback standing in for the Hugging Face Hub's API (a test points
HF_ENDPOINT at it): what gptflow.data.hf asks at planning, answered as huggingface.co answers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Hub:
    """A real HTTP server on loopback standing in for the Hub's API (HF_ENDPOINT points at it):
    GET /api/datasets/<path>[/revision/<rev>] answers as huggingface.co does -- 200 and the
    dataset's info for the datasets in `known`, else 404 with X-Error-Code RepoNotFound (or
    RevisionNotFound for a known dataset's unknown revision). Records the paths asked."""

    def __init__(self, known: dict[str, list[str]]):
        self.asked: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.asked.append(self.path)
                repo, _, revision = self.path.removeprefix("/api/datasets/").partition("/revision/")
                if repo not in known:
                    status, code, body = 404, "RepoNotFound", {"error": "Repository not found"}
                elif revision and revision not in known[repo]:
                    status, code, body = 404, "RevisionNotFound", {"error": "Invalid rev id"}
                else:
                    status, code, body = 200, None, {"id": repo, "sha": "0" * 40}
                data = json.dumps(body).encode()
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
