"""A real nginx (Debian's package) serving a directory on loopback, for tests and benchmarks.

`ensure_nginx()` installs the package when it is missing and we are root (policy-rc.d keeps
the package from starting its own service during the install); otherwise it says why not.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

POLICY_RC = Path("/usr/sbin/policy-rc.d")


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def ensure_nginx() -> tuple[str | None, str]:
    """(path to nginx, "") or (None, the reason it cannot be had here)."""
    found = find_nginx()
    if found:
        return found, ""
    if os.geteuid() != 0:
        return None, "nginx is not installed and installing it (apt-get install nginx) needs root"
    if not shutil.which("apt-get"):
        return None, "nginx is not installed and this system has no apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    created_policy = False
    if not POLICY_RC.exists():
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")  # do not start services during install
        POLICY_RC.chmod(0o755)
        created_policy = True
    try:
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "nginx"]):
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                return None, f"`{' '.join(cmd)}` failed: {out.stderr.strip()[-300:]}"
    finally:
        if created_policy:
            POLICY_RC.unlink(missing_ok=True)
    found = find_nginx()
    return (found, "") if found else (None, "apt-get installed nginx but no nginx binary was found")


def free_port() -> int:
    """A port that was free a moment ago: another process may take it before nginx binds it,
    which `Nginx` notices and answers with another port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(Exception):
    pass


class Nginx:
    """nginx in the foreground on 127.0.0.1:<free port>, serving `root`; stop() ends it.

    Race-free: a port taken between free_port() and nginx's bind() makes nginx fail with
    "Address already in use", and it is started again on another port. It is up when its pid
    file names it: nginx writes that file only after its listening socket is bound (so a
    connect that succeeds is never some other process holding the port).
    """

    START_TRIES = 5

    def __init__(self, binary: str, root: Path, workdir: Path) -> None:
        self.binary = binary
        self.root = Path(root)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.workdir / d).mkdir(exist_ok=True)
        self.access_log = self.workdir / "access.log"
        self.error_log = self.workdir / "error.log"
        self.pid_file = self.workdir / "nginx.pid"
        taken = []
        for _ in range(self.START_TRIES):
            try:
                self._start(free_port())
                return
            except PortTaken as e:
                taken.append(str(e))
        raise RuntimeError(f"nginx found every port taken: {'; '.join(taken)}")

    def _start(self, port: int) -> None:
        self.port = port
        conf = self.workdir / "nginx.conf"
        user = "user root;" if os.geteuid() == 0 else ""  # read the test's private tmp dirs
        conf.write_text(
            f"""{user}
daemon off;
worker_processes 1;
pid {self.pid_file};
error_log {self.error_log} warn;
events {{ worker_connections 64; }}
http {{
    default_type application/octet-stream;
    sendfile on;
    log_format ranges '$request_uri $status $http_range $bytes_sent';
    access_log {self.access_log} ranges;
    client_body_temp_path {self.workdir}/body;
    proxy_temp_path {self.workdir}/proxy;
    fastcgi_temp_path {self.workdir}/fastcgi;
    uwsgi_temp_path {self.workdir}/uwsgi;
    scgi_temp_path {self.workdir}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {self.root};
        autoindex on;
    }}
}}
"""
        )
        self.pid_file.unlink(missing_ok=True)
        self.error_log.write_text("")
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(conf), "-p", str(self.workdir), "-e", str(self.error_log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                error = self.proc.stderr.read().decode() + self.error_log.read_text()
                if "Address already in use" in error:
                    raise PortTaken(f"127.0.0.1:{port}: {error.strip().splitlines()[-1]}")
                raise RuntimeError(f"nginx exited: {error[-500:]}")
            if self._pid() == self.proc.pid:
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx did not bind 127.0.0.1:{port} within 20 s")

    def _pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}"

    def log_lines(self) -> list[str]:
        return self.access_log.read_text().splitlines() if self.access_log.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
