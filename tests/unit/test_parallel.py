"""make test runs the suite on pytest-xdist workers with --dist loadgroup (README, Development):
the tests that share a service or a module-scoped fixture (tests/conftest.py, ONE_WORKER and
pytest_collection_modifyitems) run on one worker, so the cost is paid once. Checked on a sample
session with two real workers: a grouping that xdist silently drops (as xdist 3.8.0 does under
pytest 9.2, pytest-xdist#1386) leaves the suite green but pays every cost twice."""

import os
import subprocess
import sys

CONFTEST = """
import os
import pytest
from tests.conftest import pytest_collection_modifyitems  # the grouping under test


def record(what):
    with open(os.environ["SAMPLE_LOG"], "a") as f:
        f.write(f"{what} {os.environ.get('PYTEST_XDIST_WORKER', 'main')}\\n")


@pytest.fixture(scope="session")
def pipeline():  # a service of ONE_WORKER
    record("built-pipeline")
"""

SERVICE = """
import pytest
from conftest import record


@pytest.mark.parametrize("i", range(6))
def test_reads_the_pipeline(pipeline, i):
    record("pipeline-user")


@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    record("alone")
"""

MODULE = """
import pytest
from conftest import record


@pytest.fixture(scope="module")
def built():
    record("built-module-fixture")


@pytest.mark.parametrize("i", range(6))
def test_reads_the_module_fixture(built, i):
    record("module-user")
"""


def test_a_service_and_a_module_fixture_are_built_once_for_their_tests_on_one_worker(
    tmp_path, repo
):
    sample = tmp_path / "sample"
    sample.mkdir()
    (sample / "conftest.py").write_text(CONFTEST)
    (sample / "test_service.py").write_text(SERVICE)
    (sample / "test_module.py").write_text(MODULE)
    log = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{sample}", "SAMPLE_LOG": str(log)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
           "--dist", "loadgroup", str(sample)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=sample, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "18 passed" in out.stdout, out.stdout
    seen: dict[str, list[str]] = {}
    for line in log.read_text().splitlines():
        what, worker = line.split()
        seen.setdefault(what, []).append(worker)
    assert len(seen["built-pipeline"]) == 1, seen  # once, not once per worker
    assert len(seen["built-module-fixture"]) == 1, seen
    assert set(seen["pipeline-user"]) == set(seen["built-pipeline"]), seen
    assert set(seen["module-user"]) == set(seen["built-module-fixture"]), seen
    assert set(seen["built-pipeline"]) | set(seen["built-module-fixture"]) <= {"gw0", "gw1"}
    assert {w for workers in seen.values() for w in workers} == {"gw0", "gw1"}, seen  # parallel
