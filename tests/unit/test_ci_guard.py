"""The CI guard of tests/conftest.py: under GPTFLOW_REQUIRE_ALL=1 a skip is a failure, but a
skip for an instruction set this machine's CPU lacks (tests/support/hardware.py); serially and
on pytest-xdist workers (make test), where the report is made in a worker and counted in the
controller."""

import os
import subprocess
import sys

import pytest

SAMPLE = """
import pytest
from tests.support.hardware import NO_CPU_FP16

@pytest.fixture
def engine():
    pytest.skip("no frobnicator on this machine")

def test_needs_engine(engine):
    pass

def test_skips_itself():
    pytest.skip("no nginx")

def test_runs():
    pass

def test_needs_cpu_fp16():
    pytest.skip(NO_CPU_FP16)
"""


def run_sample(tmp_path, repo, require_all: bool, workers: int) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {**os.environ, "PYTHONPATH": str(repo)}
    env.pop("GPTFLOW_REQUIRE_ALL", None)
    if require_all:
        env["GPTFLOW_REQUIRE_ALL"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    if workers:
        cmd += ["-n", str(workers), "--dist", "loadgroup"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)


WORKERS = pytest.mark.parametrize("workers", [0, 2], ids=["serial", "xdist"])


@WORKERS
def test_a_skip_stays_a_skip_locally(tmp_path, repo, workers):
    out = run_sample(tmp_path, repo, require_all=False, workers=workers)
    assert out.returncode == 0, out.stdout
    assert "1 passed, 3 skipped" in out.stdout


@WORKERS
def test_a_skip_fails_the_run_in_ci(tmp_path, repo, workers):
    out = run_sample(tmp_path, repo, require_all=True, workers=workers)
    assert out.returncode == 1, out.stdout
    assert "1 failed, 1 passed, 1 skipped, 1 error" in out.stdout
    assert "this test may not skip. Skipped: no nginx" in out.stdout
    assert "this test may not skip. Skipped: no frobnicator on this machine" in out.stdout
