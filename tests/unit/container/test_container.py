"""The container module without a container engine: enroot's image files, the recipe hash,
tool errors, and the command lines of the parts that cannot run here (enroot, Pyxis and
Apptainer have no Debian or PyPI package; no registry is reachable for a login)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from gptflow.container import image as c
from gptflow.errors import GptflowError

REPO = Path(__file__).resolve().parents[3]

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
    assert "src/gptflow/container/image.py" in files and "constraints.txt" in files
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
    the daemon's absence is what is tested). builder auto then takes podman when one is on
    PATH (an executable stub: resolve_builder only looks podman up) and else says neither
    builder is usable."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # this docker and nothing else
    with pytest.raises(
        GptflowError,
        match=r"daemon is not reachable \(Cannot connect to the Docker daemon\); start dockerd",
    ):
        c.resolve_builder("docker")
    with pytest.raises(GptflowError, match=r"^container.builder auto: neither a reachable docker"):
        c.resolve_builder("auto")
    podman = bin_dir / "podman"
    podman.write_text("#!/bin/sh\nexit 0\n")
    podman.chmod(0o755)
    assert c.resolve_builder("auto") == "podman"
    with pytest.raises(GptflowError, match=r"daemon is not reachable.*start dockerd"):
        c.resolve_builder("docker")  # asked for by name: no fallback


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


# A docker/podman client in front of a registry; it records each call and answers like the
# real client: `login` reads the password from stdin with --password-stdin (stripping one
# trailing newline, as docker does) or takes --password/-p from argv, and the registry accepts
# only $FAKE_REGISTRY_PASSWORD.
FAKE_TOOL = """#!{python}
import json, os, sys
argv = [os.path.basename(sys.argv[0]), *sys.argv[1:]]
call = {{"argv": argv, "stdin": None}}
if argv[1] == "login" and "--password-stdin" in argv:
    call["stdin"] = sys.stdin.read()
with open(os.environ["FAKE_TOOL_CALLS"], "a") as f:
    f.write(json.dumps(call) + "\\n")
if argv[1] == "info":
    print("27.5.1")
elif argv[1] == "login":
    password = None
    if call["stdin"] is not None:
        password = call["stdin"].removesuffix("\\n").removesuffix("\\r")
    for flag in ("--password", "-p"):
        if flag in argv:
            password = argv[argv.index(flag) + 1]
    if password is None:
        sys.exit("Error: Cannot perform an interactive login from a non TTY device")
    if password != os.environ["FAKE_REGISTRY_PASSWORD"]:
        sys.exit('Error response from daemon: Get "https://' + argv[2] + '/v2/": unauthorized')
    print("Login Succeeded")
elif argv[1] == "build":
    print("fake build of", argv[argv.index("-t") + 1])
elif argv[1:3] == ["image", "inspect"]:
    print(json.dumps([{{"Id": "sha256:" + "0" * 64, "Size": 1000, "Config": {{}}}}]))
else:
    sys.exit(f"fake {{argv[0]}}: {{argv[1]}} is not part of this test")
"""


@pytest.fixture
def fake_registry_tool(monkeypatch, tmp_path):
    """`docker` and `podman` first on PATH, each a script that stands in for the client of a
    container registry, which cannot exist here (no registry is reachable). Returns a function
    giving the calls so far: [{"argv": [tool, ...], "stdin": text or None}]."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for tool in ("docker", "podman"):
        script = bin_dir / tool
        script.write_text(FAKE_TOOL.format(python=sys.executable))
        script.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_TOOL_CALLS", str(calls))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def read() -> list[dict]:
        return (
            [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
        )

    return read


SECRET = "nvapi-Pa55w0rd-only-on-stdin"
LOGIN = {"server": "nvcr.io", "username": "$oauthtoken", "password_env": "NGC_API_KEY"}


def build_with_login(tmp_path, builder: str, logged: list[str]) -> dict:
    return c.build_image(
        repo=REPO, dockerfile=REPO / "envs/Dockerfile", out=tmp_path / "out/image.json",
        builder=builder, base_image="nvcr.io/nvidia/pytorch:25.01-py3",
        registry_logins=[LOGIN], log=logged.append,
    )  # fmt: skip


@pytest.mark.parametrize("builder", ["docker", "podman"])
def test_registry_password_goes_on_stdin_only(
    builder, fake_registry_tool, monkeypatch, tmp_path, capfd, caplog
):
    """build_image logs in (before it builds) with the password on the tool's stdin: not in
    any argv, record, log line or output. The tool is a fake (fake_registry_tool) that stands
    in for the client of a registry, which cannot exist here."""
    cmd = c.registry_login_command(builder, "nvcr.io", "$oauthtoken")
    assert cmd == [builder, "login", "nvcr.io", "--username", "$oauthtoken", "--password-stdin"]
    monkeypatch.setenv("NGC_API_KEY", SECRET)
    monkeypatch.setenv("FAKE_REGISTRY_PASSWORD", SECRET)
    caplog.set_level("DEBUG")
    logged: list[str] = []
    record = build_with_login(tmp_path, builder, logged)
    calls = fake_registry_tool()
    assert [call["argv"][1] for call in calls if call["argv"][0] == builder] == [
        *(["info"] if builder == "docker" else []), "login", "build", "image",
    ]  # fmt: skip
    (login,) = [call for call in calls if call["argv"][1] == "login"]
    assert login == {"argv": cmd, "stdin": SECRET}
    assert not [call["argv"] for call in calls if any(SECRET in arg for arg in call["argv"])]
    assert record["builder"] == builder and record["tag"].startswith(f"{c.IMAGE_NAME}:")
    out = capfd.readouterr()
    seen = "\n".join([*logged, caplog.text, out.out, out.err, json.dumps(record)])
    seen += (tmp_path / "out/image.json").read_text()
    assert "fake build of localhost/gptflow:" in out.out  # the build ran, its output was seen
    assert SECRET not in seen


def test_a_rejected_registry_login_names_the_registry_not_the_password(
    fake_registry_tool, monkeypatch, tmp_path, capfd, caplog
):
    """The registry (the fake tool of fake_registry_tool) refuses the password: one error
    naming server, user, the registry's answer and the variable to fix; no build, no record,
    and the password nowhere."""
    monkeypatch.setenv("NGC_API_KEY", SECRET)
    monkeypatch.setenv("FAKE_REGISTRY_PASSWORD", "another-password")
    caplog.set_level("DEBUG")
    logged: list[str] = []
    with pytest.raises(
        GptflowError,
        match=r"^docker login nvcr\.io as \$oauthtoken failed: Error response from daemon: "
        r'Get "https://nvcr\.io/v2/": unauthorized; check the credentials in \$NGC_API_KEY$',
    ) as e:
        build_with_login(tmp_path, "docker", logged)
    calls = fake_registry_tool()
    assert [call["argv"][1] for call in calls] == ["info", "login"]
    assert calls[1]["stdin"] == SECRET
    assert not (tmp_path / "out/image.json").exists()
    out = capfd.readouterr()
    assert SECRET not in "\n".join([str(e.value), *logged, caplog.text, out.out, out.err])


def test_an_unset_registry_password_variable_is_named(fake_registry_tool, monkeypatch):
    monkeypatch.delenv("NGC_API_KEY", raising=False)
    with pytest.raises(
        GptflowError,
        match=r"^container.registry_login: environment variable NGC_API_KEY is not set; "
        r"export the password or token for nvcr\.io in it",
    ):
        c.registry_login("docker", LOGIN)
    assert fake_registry_tool() == []  # nothing ran


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


def test_the_build_and_squash_rules_options_from_the_container_config():
    """One param of build_image / squash_image per option, in argv words: every build
    argument, build option and registry login (the password variable's name, never its value);
    the mksquashfs options as one word that squash-image splits again."""
    import shlex

    assert c.build_arg_args({"A": "1 2", "B": "x"}) == [
        "--build-arg",
        "A=1 2",
        "--build-arg",
        "B=x",
    ]
    assert c.build_arg_args({}) == []
    assert c.build_option_args(["--no-cache", "--pull"]) == [
        "--build-option=--no-cache", "--build-option=--pull",
    ]  # fmt: skip
    login = {"server": "nvcr.io", "username": "$oauthtoken", "password_env": "NGC_KEY"}
    assert c.registry_login_args([login]) == [
        "--registry-login",
        "nvcr.io",
        "$oauthtoken",
        "NGC_KEY",
    ]
    word = c.squash_options_arg(["-comp", "zstd", "-Xcompression-level", "3 4"])
    assert word == "--squash-options=-comp zstd -Xcompression-level '3 4'"
    assert shlex.split(word.split("=", 1)[1]) == ["-comp", "zstd", "-Xcompression-level", "3 4"]
