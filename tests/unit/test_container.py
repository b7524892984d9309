"""The container module without a container engine: enroot's image files, the recipe hash,
tool errors, and the command lines of the parts that cannot run here (enroot, Pyxis and
Apptainer have no Debian or PyPI package; no registry is reachable for a login)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gptflow import container as c
from gptflow.errors import GptflowError

REPO = Path(__file__).resolve().parents[2]

# what enroot 4.1.2's docker::configure wrote for this image config (reference/container-build.md)
INSPECT = {
    "Id": "sha256:abc",
    "Config": {
        "Env": ["PATH=/usr/bin:/bin", "MY_VAR=it's here"],
        "Entrypoint": ["/usr/bin/tini", "--"],
        "Cmd": ["python3", "-c", "print('hi there')"],
        "WorkingDir": "/opt/my app",
        "Volumes": {"/data": {}, "/cache": {}},
        "Labels": {"maintainer": "team", "note": "two\nlines"},
    },
}
RC = """# enroot-provenance: podman://localhost/app:1
# maintainer team
# note two lines

mkdir -p "/opt/my app" 2> /dev/null
cd "/opt/my app" && unset OLDPWD || exit 1

if [ -s /etc/rc.local ]; then
    . /etc/rc.local
fi

if [ $# -gt 0 ]; then
    exec '/usr/bin/tini' '--' "$@"
else
    exec '/usr/bin/tini' '--' 'python3' '-c' 'print('\\''hi there'\\'')'
fi
"""


def test_enroot_image_files_match_what_enroot_writes(tmp_path):
    c.write_enroot_files(tmp_path, INSPECT, "podman://localhost/app:1")
    assert (tmp_path / "etc/rc").read_text() == RC
    assert (tmp_path / "etc/environment").read_text() == "PATH=/usr/bin:/bin\nMY_VAR=it's here\n"
    assert (tmp_path / "etc/fstab").read_text() == (
        "${ENROOT_ROOTFS}/cache /cache none x-create=dir,bind,rw,nosuid,nodev\n"
        "${ENROOT_ROOTFS}/data /data none x-create=dir,bind,rw,nosuid,nodev\n"
    )
    assert (tmp_path / "etc/rc.local").read_text().startswith("# This file is sourced by /etc/rc")
    assert (tmp_path / "opt/my app").is_dir()


def test_an_image_without_entrypoint_or_cmd_runs_a_shell(tmp_path):
    c.write_enroot_files(tmp_path, {"config": {}}, "dockerd://x")
    rc = (tmp_path / "etc/rc").read_text()
    assert 'cd "/" && unset OLDPWD' in rc and "    exec  '/bin/sh'\n" in rc
    assert (tmp_path / "etc/environment").read_text() == ""


def test_the_recipe_hash_covers_the_recipe_and_nothing_else(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    shutil.copy(REPO / "envs/Dockerfile", dockerfile)
    base = c.recipe_hash(REPO, dockerfile, "nvcr.io/nvidia/pytorch:25.01-py3")
    assert len(base) == 12 and base == c.recipe_hash(
        REPO, dockerfile, "nvcr.io/nvidia/pytorch:25.01-py3"
    )
    assert c.recipe_hash(REPO, dockerfile, "nvcr.io/nvidia/pytorch:25.02-py3") != base
    assert c.recipe_hash(REPO, dockerfile, "nvcr.io/nvidia/pytorch:25.01-py3", {"A": "1"}) != base
    dockerfile.write_text(dockerfile.read_text() + "# a comment is a change\n")
    assert c.recipe_hash(REPO, dockerfile, "nvcr.io/nvidia/pytorch:25.01-py3") != base
    files = c.recipe_files(REPO, dockerfile)
    assert "src/gptflow/container.py" in files and "constraints.txt" in files
    assert "README.md" not in files  # the context gets a stub: README edits do not rebuild
    assert not any("__pycache__" in name for name in files)
    context = tmp_path / "ctx"
    c.make_context(REPO, dockerfile, context)
    assert (context / "README.md").read_text() == c.README_STUB
    assert (context / "src/gptflow/__init__.py").is_file()


def test_a_missing_dockerfile_is_named(tmp_path):
    with pytest.raises(GptflowError, match=r"nope/Dockerfile \(Dockerfile\) does not exist"):
        c.recipe_hash(REPO, tmp_path / "nope" / "Dockerfile", "base")


def test_no_builder_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker, no podman
    with pytest.raises(GptflowError, match=r"neither a reachable docker nor podman.*docker\.io"):
        c.resolve_builder("auto")
    with pytest.raises(GptflowError, match=r"podman is not on PATH; install Podman"):
        c.resolve_builder("podman")
    with pytest.raises(GptflowError, match=r"docker is not on PATH; install Docker"):
        c.resolve_builder("docker")


def test_docker_without_a_daemon_says_so(monkeypatch, tmp_path):
    """A docker client whose daemon does not answer (a script standing in for the client:
    the daemon's absence is what is tested)."""
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    if shutil.which("podman"):
        assert c.resolve_builder("auto") == "podman"
    with pytest.raises(GptflowError, match=r"daemon is not reachable.*start dockerd"):
        c.resolve_builder("docker")


def test_a_missing_squash_tool_names_the_package(monkeypatch, tmp_path):
    image = tmp_path / "img.json"
    image.write_text('{"builder": "docker", "tag": "localhost/gptflow:0"}')
    monkeypatch.setenv("PATH", str(tmp_path))
    out = tmp_path / "out" / "img.sqsh"
    with pytest.raises(GptflowError, match=r"mksquashfs is not on PATH; install squashfs-tools"):
        c.squash_image(image=image, out=out, method="builtin")
    with pytest.raises(GptflowError, match=r"enroot is not on PATH; install enroot"):
        c.squash_image(image=image, out=out, method="enroot")
    with pytest.raises(GptflowError, match=r"apptainer is not on PATH; install Apptainer"):
        c.sif_image(image=image, out=tmp_path / "out" / "img.sif")
    assert list(out.parent.iterdir()) == []  # no temp file left behind


def test_registry_password_goes_on_stdin_only(monkeypatch):
    cmd = c.registry_login_command("docker", "nvcr.io", "$oauthtoken")
    assert cmd == ["docker", "login", "nvcr.io", "--username", "$oauthtoken", "--password-stdin"]
    monkeypatch.delenv("NGC_API_KEY", raising=False)
    login = {"server": "nvcr.io", "username": "$oauthtoken", "password_env": "NGC_API_KEY"}
    with pytest.raises(GptflowError, match=r"NGC_API_KEY is not set; export the password"):
        c.registry_login("docker", login)


def test_command_lines_of_the_tools_that_cannot_run_here():
    out = Path("/shared/results/containers/gptflow-abc.sqsh")
    assert c.enroot_import_command("docker", "localhost/gptflow:abc", out) == [
        "enroot", "import", "--output", str(out), "dockerd://localhost/gptflow:abc",
    ]  # fmt: skip
    assert c.enroot_import_command("podman", "localhost/gptflow:abc", out)[-1] == (
        "podman://localhost/gptflow:abc"
    )
    assert c.apptainer_build_command(Path("/t/img.tar"), Path("/t/img.sif")) == [
        "apptainer", "build", "--force", "/t/img.sif", "docker-archive:/t/img.tar",
    ]  # fmt: skip
    assert c.squash_command(Path("/r"), out, c.ENROOT_SQUASH_OPTIONS, 8) == [
        "mksquashfs", "/r", str(out), "-noappend", "-all-root", "-no-progress",
        "-processors", "8", "-comp", "lzo", "-noD", "-exit-on-error",
    ]  # fmt: skip
    build = c.build_command(
        "podman", Path("/ctx"), "localhost/gptflow:abc", "nvcr.io/nvidia/pytorch:25.01-py3",
        {"GPTFLOW_IMAGE": "abc"}, ["--network=host"],
    )  # fmt: skip
    assert build == [
        "podman", "build", "-f", "/ctx/Dockerfile", "-t", "localhost/gptflow:abc",
        "--build-arg", "BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3",
        "--build-arg", "GPTFLOW_IMAGE=abc", "--network=host", "/ctx",
    ]  # fmt: skip


def test_training_runs_in_the_image_through_pyxis_or_apptainer():
    opts, prefix = c.container_launch("sif", "/w/img.sif", "/w", ["/data:/data:ro"], srun=False)
    assert opts == [] and prefix == [
        "apptainer", "exec", "--nv", "--pwd", "/w", "--bind", "/w:/w",
        "--bind", "/data:/data:ro", "/w/img.sif",
    ]  # fmt: skip
    with pytest.raises(GptflowError, match=r"format sqsh runs through Pyxis.*format sif"):
        c.container_launch("sqsh", "/w/img.sqsh", "/w", [], srun=False)
