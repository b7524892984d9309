"""Loopback download throughput: `gptflow download` vs `curl`, same nginx, same file.

Both run as whole commands (process start included), best of N each, interleaved. gptflow
also verifies the sha256 and fsyncs before publishing, which plain curl does not do; the second
line is curl doing the same (curl, then a sha256 with OpenSSL's CLI, then sync), the careful
manual equivalent.

Usage: python bench/download.py [--mb 1024] [--repeats 3] [--smoke]
(--smoke: 2 MB once: the test suite's run, tests/unit/test_bench.py, whose figures mean
nothing. Without nginx or curl it says so in one line and exits 1.)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.nginx import Nginx, ensure_nginx  # noqa: E402

# --smoke: the smallest run that still prints every line (explicit options still win)
SMOKE = dict(mb=2, repeats=1)


def timed(cmd: list[str], out: Path) -> float:
    for p in (out, Path(f"{out}.sha256")):
        p.unlink(missing_ok=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=1024, help="file size in MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help=f"seconds: {SMOKE}")
    a = p.parse_args()
    if a.smoke:  # its values as the defaults: an option given on the command line still wins
        p.set_defaults(**SMOKE)
        a = p.parse_args()
    if not shutil.which("curl"):  # the baseline
        sys.exit("bench/download.py cannot run here: no curl on PATH (apt-get install curl)")
    binary, why = ensure_nginx()
    if not binary:
        sys.exit(f"bench/download.py cannot run here: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        www = tmp / "www"
        www.mkdir()
        data = os.urandom(a.mb * 1_000_000)
        (www / "blob.bin").write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        server = Nginx(binary, www, tmp / "nginx")
        try:
            url = server.url("blob.bin")
            gptflow = str(Path(sys.executable).parent / "gptflow")
            ours, theirs, careful = [], [], []
            c_out = tmp / "c.bin"
            hasher = "openssl dgst -sha256" if shutil.which("openssl") else "sha256sum"
            manual = f"curl -sf -o {c_out} {url} && {hasher} {c_out} >/dev/null && sync {c_out}"
            for _ in range(a.repeats):
                theirs.append(timed(["curl", "-sf", "-o", str(c_out), url], c_out))
                careful.append(timed(["bash", "-c", manual], c_out))
                ours.append(
                    timed(
                        [gptflow, "download", url, "--out", str(tmp / "g.bin"), "--sha256", sha],
                        tmp / "g.bin",
                    )
                )
            assert (tmp / "g.bin").read_bytes() == data
        finally:
            server.stop()
    mb = a.mb
    c, m, g = min(theirs), min(careful), min(ours)
    print(f"loopback download of {mb} MB from nginx (best of {a.repeats}):")
    print(f"  curl -o                              {c:6.2f} s  {mb / c:7.1f} MB/s")
    print(f"  curl -o && {hasher.split()[0]} sha256 && sync    {m:6.2f} s  {mb / m:7.1f} MB/s")
    print(
        f"  gptflow download --sha256 (fsync)    {g:6.2f} s  {mb / g:7.1f} MB/s  "
        f"= {c / g:.2f}x plain curl, {m / g:.2f}x curl+sha256+sync"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
