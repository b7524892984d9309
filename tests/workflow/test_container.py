"""The container stage for real: Debian's docker.io engine (dockerd, started here with its own
data root and socket) builds envs/Dockerfile on a Debian base made here with debootstrap
(no registry is reachable, so the cluster default nvcr.io base cannot be pulled), and the
built-in converter writes enroot's image format into a .sqsh.

enroot, Pyxis and Apptainer are not installable here (no Debian or PyPI package); their
command lines are checked in tests/unit/container/test_container.py and by `snakemake -n`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, job_counts

PACKAGES = {"dockerd": "docker.io", "mksquashfs": "squashfs-tools", "debootstrap": "debootstrap"}
BASE = "localhost/gptflow-test-base:bookworm"


def _apt_install(packages: list[str]) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
        check=True, env=env, timeout=900, stdout=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.fixture(scope="session")
def docker_host(tmp_path_factory):
    """A dockerd of this test session (its own socket, data and exec roots), stopped by PID."""
    if os.geteuid() != 0:
        pytest.skip(
            f"runs as uid {os.geteuid()}: starting dockerd and chroot'ing into the unpacked "
            "image need root"
        )
    missing = [pkg for tool, pkg in PACKAGES.items() if not shutil.which(tool)]
    if missing:
        if not shutil.which("apt-get"):
            pytest.skip(
                f"Debian packages {', '.join(missing)} are not installed and there is no apt-get "
                "to install them: these tests build a real image with dockerd and squash it "
                "with mksquashfs on a debootstrap'ed base"
            )
        _apt_install(missing)
    # /tmp paths must stay short: dockerd's containerd socket lives under the exec root
    root = Path(tmp_path_factory.mktemp("dockerd"))
    sock = root / "docker.sock"
    log = open(root / "dockerd.log", "w")  # noqa: SIM115 (open for the daemon's lifetime)
    proc = subprocess.Popen(
        ["dockerd", "--host", f"unix://{sock}", "--data-root", str(root / "data"),
         "--exec-root", str(root / "exec"), "--pidfile", str(root / "docker.pid"),
         "--iptables=false", "--ip6tables=false", "--bridge=none"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    env = {**os.environ, "DOCKER_HOST": f"unix://{sock}"}
    deadline = time.monotonic() + 60
    while subprocess.run(["docker", "info"], env=env, capture_output=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"dockerd did not start: {(root / 'dockerd.log').read_text()[-3000:]}")
        time.sleep(0.5)
    yield env
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()
    subprocess.run(["umount", "-R", str(root / "exec")], capture_output=True)


@pytest.fixture(scope="session")
def base_tar(tmp_path_factory, docker_host):
    """A Debian 12 minbase with python3-pip (debootstrap from the machine's Debian mirror), as
    a tar: what an NGC PyTorch base is on a cluster, minus CUDA and torch."""
    rootfs = tmp_path_factory.mktemp("rootfs")
    mirror = "http://deb.debian.org/debian"
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.is_file():
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:"):
                mirror = line.split()[1]
                break
    out = subprocess.run(
        ["debootstrap", "--variant=minbase", "--include=python3-pip", "bookworm", str(rootfs),
         mirror],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (rootfs / junk).glob("*"):
            if p.is_file():
                p.unlink()
    tar = rootfs.parent / "base.tar"
    subprocess.run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tar), "."], check=True)
    shutil.rmtree(rootfs, ignore_errors=True)
    return tar


IMPORT_CHANGES = [
    "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "--change", 'CMD ["/bin/bash"]',
]  # fmt: skip


@pytest.fixture(scope="session")
def base_image(base_tar, docker_host):
    """The base imported into the test dockerd as BASE."""
    subprocess.run(
        ["docker", "import", *IMPORT_CHANGES, str(base_tar), BASE],
        env=docker_host, check=True, capture_output=True,
    )  # fmt: skip
    return BASE


@pytest.fixture(scope="session")
def podman_env(base_tar, tmp_path_factory):
    """Podman with storage of its own, the base imported; docker made unreachable, so that
    builder auto must pick podman.

    containers.conf sets runc and lower rlimits: this sandbox's cgroup v1 hybrid layout makes
    crun refuse to start containers, and root cannot raise the hard rlimits that podman asks
    for (reference/container-build.md). Clusters need neither."""
    missing = [pkg for tool, pkg in {"podman": "podman", "runc": "runc"}.items()
               if not shutil.which(tool)]  # fmt: skip
    if missing:
        _apt_install(missing)
    root = tmp_path_factory.mktemp("podman")
    (root / "containers.conf").write_text(
        '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]\n'
        '[engine]\nruntime = "runc"\n'
    )
    (root / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{root}/graph"\nrunroot = "{root}/run"\n'
    )
    env = {
        **os.environ,
        "CONTAINERS_CONF": str(root / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(root / "storage.conf"),
        "DOCKER_HOST": f"unix://{root}/no-docker.sock",
    }
    subprocess.run(
        ["podman", "import", *IMPORT_CHANGES, str(base_tar), BASE],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    yield env
    subprocess.run(["podman", "rmi", "--all", "--force"], env=env, capture_output=True)
    subprocess.run(["podman", "system", "reset", "--force"], env=env, capture_output=True)


def container_config(dockerfile: Path, builder: str = "docker") -> dict:
    cfg = yaml.safe_load((REPO / "tests" / "config" / "config.yaml").read_text())
    cfg["container"] = {
        "builder": builder,
        "dockerfile": str(dockerfile),
        "base_image": BASE,
        # the base has no torch or PyPI access: install gptflow alone (Debian's setuptools)
        "build_args": {"GPTFLOW_PIP_ARGS": "--no-deps --no-build-isolation"},
        "build_options": ["--network=none"],
        "squash_options": ["-comp", "lz4"],  # fast here; enroot's lzo -noD is the default
    }
    return cfg


def run_snakemake(wd: Path, config: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    from .conftest import snakemake_cmd

    return subprocess.run(
        ["timeout", "-k", "30", "900", *snakemake_cmd(wd, config, *args)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip


def read_environment(rootfs: Path) -> dict[str, str]:
    """/etc/environment as enroot reads it: KEY=VALUE lines, unquoted."""
    env = {}
    for line in (rootfs / "etc" / "environment").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    return env


def run_in_rootfs(rootfs: Path, *argv: str, stdin: str = "") -> subprocess.CompletedProcess:
    """Start the unpacked image as enroot does: its /etc/environment only, /bin/sh /etc/rc,
    in new mount and PID namespaces, chroot'ed; `stdin` is the container's standard input."""
    return subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", f"--mount-proc={rootfs / 'proc'}",
         "chroot", str(rootfs), "/bin/sh", "/etc/rc", *argv],
        env=read_environment(rootfs), input=stdin, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def built(base_image, docker_host, tmp_path_factory, write_config):
    wd = tmp_path_factory.mktemp("container")
    dockerfile = wd / "Dockerfile"
    shutil.copy(REPO / "envs" / "Dockerfile", dockerfile)
    config = write_config(wd / "config.yaml", container_config(dockerfile))
    run = run_snakemake(wd, config, docker_host, "container")
    assert run.returncode == 0, run.stdout[-5000:]
    (sqsh,) = (wd / "results" / "containers").glob("gptflow-*.sqsh")
    digest = sqsh.name.removeprefix("gptflow-").removesuffix(".sqsh")
    assert sorted(p.name for p in (wd / "results/containers").iterdir()) == [
        f"gptflow-{digest}.json", sqsh.name,
    ]  # fmt: skip
    build_log = (wd / f"logs/build_image/{digest}.log").read_text()
    assert f"building localhost/gptflow:{digest} with docker: docker build -f " in build_log
    return wd, config, dockerfile, sqsh


def test_the_image_is_built_and_squashed_in_enroot_format(built, docker_host, tmp_path):
    wd, _, _, sqsh = built
    digest = sqsh.name.removeprefix("gptflow-").removesuffix(".sqsh")
    record = json.loads(sqsh.with_suffix(".json").read_text())
    assert record["recipe_hash"] == digest and record["tag"] == f"localhost/gptflow:{digest}"
    assert record["builder"] == "docker" and record["image_id"].startswith("sha256:")
    inspect = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", record["tag"]],
        env=docker_host, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert inspect.stdout.strip() == record["image_id"]
    assert "-comp lz4" in (wd / f"logs/squash_image/{digest}.sqsh.log").read_text()

    listing = subprocess.run(
        ["unsquashfs", "-l", str(sqsh)], capture_output=True, text=True, check=True
    ).stdout.split()
    for path in ("etc/rc", "etc/rc.local", "etc/environment", "etc/fstab", "workspace",
                 "usr/local/lib/python3.11/dist-packages/gptflow/__init__.py"):  # fmt: skip
        assert f"squashfs-root/{path}" in listing, path
    assert not any(p.startswith("squashfs-root/dev/") for p in listing)  # enroot mounts /dev
    owners = subprocess.run(
        ["unsquashfs", "-lls", str(sqsh)], capture_output=True, text=True, check=True
    ).stdout
    assert "root/root" in owners and not any(
        line.split()[1] != "root/root" for line in owners.splitlines() if line[:1] in "-dl"
    )  # -all-root, as enroot squashes

    rootfs = tmp_path / "rootfs"
    subprocess.run(["unsquashfs", "-q", "-no-progress", "-d", str(rootfs), str(sqsh)], check=True)
    env = read_environment(rootfs)
    assert env["GPTFLOW_IMAGE"] == digest and env["PYTHONUNBUFFERED"] == "1"
    rc = (rootfs / "etc/rc").read_text()
    assert rc.startswith(f"# enroot-provenance: dockerd://localhost/gptflow:{digest}\n")
    assert 'cd "/workspace" && unset OLDPWD || exit 1' in rc
    # the image's CMD (bash) from /etc/rc, as `enroot start` runs it, reading commands on stdin
    shell = run_in_rootfs(rootfs, stdin='echo "$0|$PWD|$GPTFLOW_IMAGE"; exit 7\n')
    assert (shell.returncode, shell.stdout) == (7, f"/bin/bash|/workspace|{digest}\n"), shell
    # Pyxis mode: rc.local is `exec "$@"`, the srun command runs in WORKDIR with the image ENV
    (rootfs / "etc/rc.local").write_text('exec "$@"\n')
    probe = run_in_rootfs(
        rootfs,
        "python3", "-c",
        "import gptflow, os; print(gptflow.__version__, os.getcwd(), os.environ['GPTFLOW_IMAGE'])",
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["0.1.0", "/workspace", digest]


def test_an_unchanged_recipe_never_rebuilds_and_an_edited_one_does(built, docker_host):
    wd, config, dockerfile, sqsh = built
    before = {p.name: p.stat().st_mtime_ns for p in (wd / "results/containers").iterdir()}
    again = run_snakemake(wd, config, docker_host, "container")
    assert again.returncode == 0, again.stdout[-3000:]
    assert "Nothing to be done" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (wd / "results/containers").iterdir()} == before

    dockerfile.write_text(dockerfile.read_text() + "ENV GPTFLOW_TEST_EDIT=1\n")
    plan = run_snakemake(wd, config, docker_host, "-n", "container")
    assert job_counts(plan.stdout) == {"build_image": 1, "squash_image": 1, "container": 1}
    rebuilt = run_snakemake(wd, config, docker_host, "container")
    assert rebuilt.returncode == 0, rebuilt.stdout[-3000:]
    new = sorted(set(p.name for p in (wd / "results/containers").glob("*.sqsh")) - set(before))
    assert len(new) == 1 and new[0] != sqsh.name
    listing = subprocess.run(
        ["unsquashfs", "-cat", str(wd / "results/containers" / new[0]), "etc/environment"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "GPTFLOW_TEST_EDIT=1" in listing.splitlines()
    assert sqsh.is_file()  # the old image stays until deleted


def test_a_failed_build_is_one_clear_error_and_publishes_nothing(
    base_image, docker_host, tmp_path, write_config
):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM {BASE}\nRUN echo building && exit 3\n")
    config = write_config(tmp_path / "config.yaml", container_config(dockerfile))
    run = run_snakemake(tmp_path, config, docker_host, "container")
    assert run.returncode == 1, run.stdout[-3000:]
    assert "Error in rule build_image:" in run.stdout
    (log_path,) = (tmp_path / "logs/build_image").glob("*.log")
    digest = log_path.stem
    log = log_path.read_text()
    assert f"building localhost/gptflow:{digest} with docker: docker build -f " in log
    # the builder's output names the failing step and its status; the classic builder exits
    # with that status, BuildKit with 1
    classic = "The command '/bin/sh -c echo building && exit 3' returned a non-zero code: 3"
    buildkit = '"/bin/sh -c echo building && exit 3" did not complete successfully: exit code: 3'
    assert (classic in log) != (buildkit in log), log[-3000:]
    code = 3 if classic in log else 1
    errors = [line for line in log.splitlines() if "error:" in line]
    assert errors == [
        f"gptflow build-image: error: docker build of {dockerfile} failed (exit {code}); the "
        "builder's output above names the failing step. Fix the Dockerfile or "
        "container.base_image and rerun"
    ], log[-3000:]
    assert list((tmp_path / "results/containers").glob("*")) == []
    tagged = subprocess.run(
        ["docker", "image", "inspect", f"localhost/gptflow:{digest}"],
        env=docker_host, capture_output=True, text=True,
    )  # fmt: skip
    assert tagged.returncode == 1 and "No such image" in tagged.stderr, tagged


def test_podman_builds_when_docker_is_unreachable(podman_env, tmp_path, write_config):
    """builder auto: the docker client finds no daemon, so podman builds; the squashfs is the
    same enroot format, its provenance podman://."""
    shutil.copy(REPO / "envs" / "Dockerfile", tmp_path / "Dockerfile")
    config = write_config(
        tmp_path / "config.yaml", container_config(tmp_path / "Dockerfile", builder="auto")
    )
    run = run_snakemake(tmp_path, config, podman_env, "container")
    assert run.returncode == 0, run.stdout[-5000:]
    (sqsh,) = (tmp_path / "results/containers").glob("gptflow-*.sqsh")
    digest = sqsh.name.removeprefix("gptflow-").removesuffix(".sqsh")
    record = json.loads(sqsh.with_suffix(".json").read_text())
    assert (record["builder"], record["tag"]) == ("podman", f"localhost/gptflow:{digest}")
    build_log = (tmp_path / f"logs/build_image/{digest}.log").read_text()
    assert f"building localhost/gptflow:{digest} with podman: podman build -f " in build_log
    rootfs = tmp_path / "rootfs"
    subprocess.run(["unsquashfs", "-q", "-no-progress", "-d", str(rootfs), str(sqsh)], check=True)
    rc = (rootfs / "etc/rc").read_text()
    assert rc.startswith(f"# enroot-provenance: podman://localhost/gptflow:{digest}\n")
    (rootfs / "etc/rc.local").write_text('exec "$@"\n')
    probe = run_in_rootfs(rootfs, "python3", "-c", "import gptflow, os; print(os.getcwd())")
    assert probe.returncode == 0 and probe.stdout.split() == ["/workspace"], probe.stderr
