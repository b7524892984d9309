"""The container stage: Dockerfile -> image -> enroot squashfs (Pyxis) or Apptainer SIF.

The image is named by a hash of its recipe: the Dockerfile, the install script, the package
metadata and constraints, the package source and the base image and build arguments. An
unchanged recipe never rebuilds; a changed one gets a new name, and only the jobs that run
inside the image (training) see a changed input.

The squashfs is what `enroot import` writes (enroot's image format: the rootfs plus
/etc/rc, /etc/environment, /etc/fstab and /etc/rc.local, squashed with -all-root), made by
enroot itself where it is installed and otherwise by `write_enroot_files` + mksquashfs here,
so Pyxis (`srun --container-image=x.sqsh`) takes either.

Over 500 lines: the container stage in one module -- the recipe's hash, the build, the squash
(enroot or builtin) and the SIF, the rules' options and the launch inside the image -- held
whole by tests/unit/container/test_container.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.fsutil import publish, temp_dir, temp_path, write_json

IMAGE_NAME = "localhost/gptflow"
# enroot's defaults (ENROOT_SQUASH_OPTIONS): lzo, data blocks uncompressed (fast to start)
ENROOT_SQUASH_OPTIONS = ["-comp", "lzo", "-noD", "-exit-on-error"]
INSTALL_HINTS = {
    "docker": "install Docker (Debian/Ubuntu: apt-get install docker.io) and start dockerd",
    "podman": "install Podman (Debian/Ubuntu: apt-get install podman; RHEL: dnf install podman)",
    "mksquashfs": "install squashfs-tools (apt-get install squashfs-tools / dnf install squashfs-tools)",
    "enroot": "install enroot (https://github.com/NVIDIA/enroot/releases)",
    "apptainer": "install Apptainer (https://apptainer.org/docs/admin/main/installation.html)",
}
# README.md is package metadata only; the context gets this stub so that a README edit does
# not rebuild a many-GB image
README_STUB = "gptflow, installed into the training image by envs/Dockerfile.\n"


# --------------------------------------------------------------------------- the recipe


def recipe_files(repo: str | os.PathLike, dockerfile: str | os.PathLike) -> dict[str, Path]:
    """What goes into the build context, by its path inside the context."""
    repo = Path(repo)
    dockerfile = Path(dockerfile)
    files = {
        "Dockerfile": dockerfile,
        "install-gptflow.sh": repo / "envs" / "install-gptflow.sh",
        "pyproject.toml": repo / "pyproject.toml",
        "constraints.txt": repo / "constraints.txt",
    }
    for path in sorted((repo / "src" / "gptflow").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files[path.relative_to(repo).as_posix()] = path
    for name, path in files.items():
        if not path.is_file():
            raise GptflowError(f"container recipe: {path} ({name}) does not exist")
    return files


def recipe_hash(
    repo: str | os.PathLike,
    dockerfile: str | os.PathLike,
    base_image: str,
    build_args: dict[str, str] | None = None,
) -> str:
    """12 hex digits naming the image: every context file (name and bytes), the base image and
    the build arguments."""
    h = hashlib.sha256()
    for name, path in recipe_files(repo, dockerfile).items():
        data = path.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    h.update(json.dumps({"base_image": base_image, "build_args": build_args or {}}).encode())
    return h.hexdigest()[:12]


def make_context(repo: str | os.PathLike, dockerfile: str | os.PathLike, dest: Path) -> None:
    """Copy the recipe into a fresh build context `dest` (only what the hash covers)."""
    for name, path in recipe_files(repo, dockerfile).items():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    (dest / "README.md").write_text(README_STUB)


# --------------------------------------------------------------------------- tools


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, **kw)
    except FileNotFoundError:
        raise GptflowError(
            f"{what}: {cmd[0]} is not installed (not on PATH); {INSTALL_HINTS.get(cmd[0], '')}"
        ) from None


def require_tool(tool: str, what: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise GptflowError(f"{what}: {tool} is not on PATH; {INSTALL_HINTS[tool]}")
    return path


def _docker_reachable() -> tuple[bool, list[str]]:
    out = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.returncode == 0, (out.stderr or out.stdout).strip().splitlines()[-1:]


def resolve_builder(choice: str) -> str:
    """`docker` or `podman`: the configured one, or (auto) docker with a reachable daemon,
    else podman."""
    if choice not in ("auto", "docker", "podman"):
        raise GptflowError(f"container.builder {choice!r}: use auto, docker or podman")
    if choice == "podman":
        require_tool("podman", "container.builder podman")
        return "podman"
    if shutil.which("docker"):
        ok, why = _docker_reachable()
        if ok:
            return "docker"
        if choice == "docker":
            raise GptflowError(
                f"container.builder docker: the docker daemon is not reachable ({' '.join(why)}); "
                "start dockerd (or set DOCKER_HOST), or set container.builder: podman"
            )
    elif choice == "docker":
        require_tool("docker", "container.builder docker")
    if shutil.which("podman"):
        return "podman"
    raise GptflowError(
        "container.builder auto: neither a reachable docker nor podman was found; "
        f"{INSTALL_HINTS['docker']}, or {INSTALL_HINTS['podman']}"
    )


# --------------------------------------------------------------------------- build


def registry_login_command(builder: str, server: str, username: str) -> list[str]:
    """The login for a private base image registry (e.g. nvcr.io, user `$oauthtoken`); the
    password goes on stdin, never on a command line or in a log."""
    return [builder, "login", server, "--username", username, "--password-stdin"]


def registry_login(builder: str, login: dict) -> None:
    env_name = login["password_env"]
    password = os.environ.get(env_name)
    if not password:
        raise GptflowError(
            f"container.registry_login: environment variable {env_name} is not set; export the "
            f"password or token for {login['server']} in it before running the workflow"
        )
    cmd = registry_login_command(builder, login["server"], login["username"])
    out = _run(cmd, "registry login", input=password, capture_output=True, text=True)
    if out.returncode != 0:
        # the builder's message, never the password
        raise GptflowError(
            f"{builder} login {login['server']} as {login['username']} failed: "
            f"{out.stderr.strip()[-500:]}; check the credentials in ${env_name}"
        )


def build_command(
    builder: str,
    context: Path,
    tag: str,
    base_image: str,
    build_args: dict[str, str],
    options: list[str],
) -> list[str]:
    cmd = [builder, "build", "-f", str(context / "Dockerfile"), "-t", tag]
    for key, value in {"BASE_IMAGE": base_image, **build_args}.items():
        cmd += ["--build-arg", f"{key}={value}"]
    return [*cmd, *options, str(context)]


def inspect_image(builder: str, tag: str) -> dict:
    out = _run([builder, "image", "inspect", tag], "inspect image", capture_output=True, text=True)
    if out.returncode != 0:
        raise GptflowError(f"{builder} image inspect {tag}: {out.stderr.strip()[-500:]}")
    data = json.loads(out.stdout)
    return data[0] if isinstance(data, list) else data


def build_image(
    *,
    repo: str | os.PathLike,
    dockerfile: str | os.PathLike,
    out: str | os.PathLike,
    builder: str = "auto",
    base_image: str,
    build_args: dict[str, str] | None = None,
    options: list[str] | None = None,
    registry_logins: list[dict] | None = None,
    log=print,
) -> dict:
    """Build the image of this recipe and write its record (`out`, JSON) last."""
    build_args = dict(build_args or {})
    digest = recipe_hash(repo, dockerfile, base_image, build_args)
    tool = resolve_builder(builder)
    tag = f"{IMAGE_NAME}:{digest}"
    for login in registry_logins or []:
        registry_login(tool, login)
    with tempfile.TemporaryDirectory(prefix="gptflow-context-") as tmp:
        context = Path(tmp)
        make_context(repo, dockerfile, context)
        cmd = build_command(
            tool, context, tag, base_image, {**build_args, "GPTFLOW_IMAGE": digest}, options or []
        )
        log(f"building {tag} with {tool}: {shlex.join(cmd)}")
        t0 = time.monotonic()
        proc = _run(cmd, "build image")
        seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise GptflowError(
            f"{tool} build of {dockerfile} failed (exit {proc.returncode}); the builder's output "
            "above names the failing step. Fix the Dockerfile or container.base_image and rerun"
        )
    info = inspect_image(tool, tag)
    cfg = info.get("Config") or {}
    record = {
        "recipe_hash": digest,
        "tag": tag,
        "builder": tool,
        "image_id": info.get("Id"),
        "base_image": base_image,
        "build_args": sorted(build_args),  # names only: values may be private
        "size_bytes": info.get("Size"),
        "created": info.get("Created"),
        "env": cfg.get("Env") or [],
        "entrypoint": cfg.get("Entrypoint"),
        "cmd": cfg.get("Cmd"),
        "workdir": cfg.get("WorkingDir") or "",
        "build_seconds": round(seconds, 1),
    }
    write_json(out, record)
    log(f"{tag}: image {record['image_id']}, {(record['size_bytes'] or 0) / 1e6:.1f} MB")
    return record


# --------------------------------------------------------------------------- enroot format


def _bash_quote(word: str) -> str:
    """Quote as bash's ${var@Q} does for printable strings (what enroot writes)."""
    return "'" + word.replace("'", "'\\''") + "'"


def enroot_rc(config: dict, uri: str) -> str:
    """/etc/rc as `enroot import` writes it: workdir, rc.local hook, ENTRYPOINT and CMD."""
    workdir = config.get("WorkingDir") or "/"
    entrypoint = config.get("Entrypoint") or []
    cmd = config.get("Cmd") or []
    if not entrypoint and not cmd:
        cmd = ["/bin/sh"]
    ep = " ".join(_bash_quote(w) for w in entrypoint)
    args = " ".join(_bash_quote(w) for w in cmd)
    lines = [f"# enroot-provenance: {uri}\n"]
    for key, value in (config.get("Labels") or {}).items():
        lines.append(f"# {key} {str(value).replace(chr(10), ' ')}\n")
    lines.append("\n")
    lines.append(
        f'mkdir -p "{workdir}" 2> /dev/null\n'
        f'cd "{workdir}" && unset OLDPWD || exit 1\n'
        "\n"
        "if [ -s /etc/rc.local ]; then\n"
        "    . /etc/rc.local\n"
        "fi\n"
        "\n"
        "if [ $# -gt 0 ]; then\n"
        f'    exec {ep} "$@"\n'
        "else\n"
        f"    exec {ep} {args}\n"
        "fi\n"
    )
    return "".join(lines)


def write_enroot_files(rootfs: str | os.PathLike, inspect: dict, uri: str) -> None:
    """enroot's image format (its docker::configure): /etc/fstab (image volumes),
    /etc/environment (image ENV), /etc/rc, /etc/rc.local, and the WORKDIR."""
    rootfs = Path(rootfs)
    data = {k.lower(): v for k, v in inspect.items()}
    config = data.get("config") or {}
    etc = rootfs / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "fstab").write_text(
        "".join(
            f"${{ENROOT_ROOTFS}}{vol} {vol} none x-create=dir,bind,rw,nosuid,nodev\n"
            for vol in sorted(config.get("Volumes") or {})
        )
    )
    (etc / "environment").write_text("".join(f"{e}\n" for e in config.get("Env") or []))
    (etc / "rc").write_text(enroot_rc(config, uri))
    (etc / "rc.local").write_text(
        "# This file is sourced by /etc/rc when the container starts.\n"
        "# It can be used to manipulate the entrypoint or the command of the container.\n"
    )
    (rootfs / (config.get("WorkingDir") or "/").lstrip("/")).mkdir(parents=True, exist_ok=True)


def fix_permissions(rootfs: Path) -> None:
    """enroot's fixperms: the owner can read every file and enter and write every directory
    (the squashfs is unpacked on the node by the user who runs the job)."""
    subprocess.run(["chmod", "-f", "-R", "u+rX", str(rootfs)], check=False)
    subprocess.run(
        ["find", str(rootfs), "-maxdepth", "15", "-type", "d", "!", "-perm", "-u=w",
         "-exec", "chmod", "-f", "u+w", "{}", "+"],
        check=False,
    )  # fmt: skip


def export_rootfs(builder: str, tag: str, rootfs: Path) -> None:
    """The image's filesystem, as enroot's daemon import takes it (no dev/*, no .dockerenv)."""
    created = _run([builder, "create", tag], "export image", capture_output=True, text=True)
    if created.returncode != 0:
        raise GptflowError(f"{builder} create {tag}: {created.stderr.strip()[-500:]}")
    cid = created.stdout.strip().splitlines()[-1]
    try:
        exporter = subprocess.Popen([builder, "export", cid], stdout=subprocess.PIPE)
        untar = subprocess.run(
            ["tar", "-C", str(rootfs), "--numeric-owner", "--warning=no-timestamp", "--anchored",
             "--exclude=dev/*", "--exclude=.dockerenv", "-px"],
            stdin=exporter.stdout, capture_output=True, text=True,
        )  # fmt: skip
        exporter.stdout.close()
        if exporter.wait() != 0 or untar.returncode != 0:
            raise GptflowError(
                f"{builder} export {tag} | tar failed (export exit {exporter.returncode}, tar "
                f"exit {untar.returncode}: {untar.stderr.strip()[-300:]}); check free disk in "
                f"{rootfs.parent}"
            )
    finally:
        subprocess.run([builder, "rm", "-f", cid], capture_output=True)


def squash_command(rootfs: Path, out: Path, options: list[str], processors: int) -> list[str]:
    return [
        "mksquashfs", str(rootfs), str(out), "-noappend", "-all-root", "-no-progress",
        "-processors", str(processors), *options,
    ]  # fmt: skip


def enroot_import_command(builder: str, tag: str, out: Path) -> list[str]:
    scheme = "dockerd" if builder == "docker" else "podman"
    return ["enroot", "import", "--output", str(out), f"{scheme}://{tag}"]


def apptainer_build_command(archive: Path, out: Path) -> list[str]:
    return ["apptainer", "build", "--force", str(out), f"docker-archive:{archive}"]


def _docker_shim(directory: Path) -> Path:
    """A `docker` that is podman: enroot's podman:// import cleans up with `docker rm` and
    fails without one (enroot 3.4-4.1)."""
    shim = directory / "docker"
    shim.write_text('#!/bin/sh\nexec podman "$@"\n')
    shim.chmod(0o755)
    return directory


def squash_image(
    *,
    image: str | os.PathLike,
    out: str | os.PathLike,
    method: str = "auto",
    options: list[str] | None = None,
    processors: int | None = None,
    log=print,
) -> dict:
    """The image of record `image` as an enroot squashfs at `out` (published atomically)."""
    record = json.loads(Path(image).read_text())
    builder, tag = record["builder"], record["tag"]
    out = Path(out)
    if method not in ("auto", "enroot", "builtin"):
        raise GptflowError(f"container.squash {method!r}: use auto, enroot or builtin")
    if method == "auto":
        method = "enroot" if shutil.which("enroot") else "builtin"
    options = list(ENROOT_SQUASH_OPTIONS if options is None else options)
    tmp = temp_path(out)
    tmp.unlink()
    t0 = time.monotonic()
    try:
        if method == "enroot":
            require_tool("enroot", "container.squash enroot")
            env = dict(os.environ)
            env.setdefault("ENROOT_SQUASH_OPTIONS", " ".join(options))
            with tempfile.TemporaryDirectory(prefix="gptflow-shim-") as shim:
                if builder == "podman":
                    env["PATH"] = f"{_docker_shim(Path(shim))}{os.pathsep}{env['PATH']}"
                cmd = enroot_import_command(builder, tag, tmp)
                log(shlex.join(cmd))
                proc = _run(cmd, "squash image", env=env)
            if proc.returncode != 0 or not tmp.is_file():
                raise GptflowError(f"enroot import of {tag} failed (exit {proc.returncode})")
        else:
            require_tool("mksquashfs", "container.squash builtin")
            scheme = "dockerd" if builder == "docker" else "podman"  # enroot's provenance
            # a temporary of gptflow.fsutil's naming, so a killed squash's rootfs is removed by
            # the next one; 0700 as mkdtemp made it (the mode of the image's / comes from it)
            rootfs = temp_dir(out.with_name(f"{out.name}.rootfs"))
            rootfs.chmod(0o700)
            try:
                export_rootfs(builder, tag, rootfs)
                fix_permissions(rootfs)
                write_enroot_files(rootfs, inspect_image(builder, tag), f"{scheme}://{tag}")
                cmd = squash_command(rootfs, tmp, options, processors or os.cpu_count() or 1)
                log(shlex.join(cmd))
                proc = _run(cmd, "squash image", capture_output=True, text=True)
                if proc.returncode != 0:
                    raise GptflowError(
                        f"mksquashfs of {tag} failed (exit {proc.returncode}): "
                        f"{proc.stderr.strip()[-500:]}; check container.squash_options and free "
                        f"disk in {out.parent}"
                    )
            finally:
                shutil.rmtree(rootfs, ignore_errors=True)
        publish(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    summary = {
        "image": str(out),
        "method": method,
        "bytes": out.stat().st_size,
        "seconds": round(time.monotonic() - t0, 1),
    }
    log(f"{out}: {summary['bytes'] / 1e6:.1f} MB by {method} in {summary['seconds']} s")
    return summary


def sif_image(*, image: str | os.PathLike, out: str | os.PathLike, log=print) -> dict:
    """The image of record `image` as an Apptainer SIF, through a docker-archive (no registry)."""
    record = json.loads(Path(image).read_text())
    builder, tag = record["builder"], record["tag"]
    out = Path(out)
    require_tool("apptainer", "container.format sif")
    tmp = temp_path(out)
    archive = temp_path(out.with_name(f"{out.name}.tar"))  # removed by the next run if killed
    archive.unlink()
    try:
        saved = _run([builder, "save", "-o", str(archive), tag], "save image")
        if saved.returncode != 0:
            raise GptflowError(f"{builder} save {tag} failed (exit {saved.returncode})")
        cmd = apptainer_build_command(archive, tmp)
        log(shlex.join(cmd))
        if _run(cmd, "apptainer build").returncode != 0:
            raise GptflowError(f"apptainer build of {tag} failed; its output is above")
        publish(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            archive.unlink()
    return {"image": str(out), "bytes": out.stat().st_size}


# --------------------------------------------------------------------------- the rules' options
# `gptflow build-image` / `squash-image` options from the config's container section, one per
# param of the build_image and squash_image rules (argv words; nothing when unset)


def build_arg_args(build_args: dict[str, str]) -> list[str]:
    return [word for k, v in build_args.items() for word in ("--build-arg", f"{k}={v}")]


def build_option_args(options: list[str]) -> list[str]:
    """``--build-option=O`` per option, one word: the option itself starts with '-'."""
    return [f"--build-option={o}" for o in options]


def registry_login_args(logins: list[dict]) -> list[str]:
    """``--registry-login SERVER USERNAME PASSWORD_ENV`` per login (the variable's name only)."""
    return [
        word
        for r in logins
        for word in ("--registry-login", r["server"], r["username"], r["password_env"])
    ]


def squash_options_arg(options: list[str]) -> str:
    """``--squash-options=OPTIONS``: the mksquashfs options as one word (``squash-image``
    splits it again, shell-style); glued, as the options start with '-'."""
    return f"--squash-options={shlex.join(options)}"


# --------------------------------------------------------------------------- running in it


def check_launch(fmt: str, *, srun: bool) -> None:
    """Training can start in an image of format `fmt` (`srun`: under the Slurm profile's srun)."""
    if fmt == "sqsh" and not srun:
        raise GptflowError(
            "container.format sqsh runs through Pyxis (srun --container-image), which needs "
            "the Slurm profile (resources mpi: srun); use container.format sif with "
            "Apptainer here, or container.enabled: false"
        )
    if fmt not in ("sqsh", "sif"):
        raise GptflowError(f"container.format {fmt!r}: use sqsh or sif")


def check_planned(section: dict, dockerfile: str | os.PathLike, *, srun: bool) -> None:
    """The config's container section when the workflow is planned (not first in a job's
    input function), when training runs in the image: its Dockerfile exists (`dockerfile`:
    resolved against the workflow directory) and the image can start there
    (:func:`check_launch`)."""
    if not Path(dockerfile).is_file():
        raise GptflowError(
            f"container.dockerfile is {section['dockerfile']!r}, but {dockerfile} does not "
            f"exist; point it at a Dockerfile (relative to the workflow directory, or absolute)"
        )
    check_launch(section["format"], srun=srun)


def container_launch(
    fmt: str,
    image: str,
    workdir: str,
    mounts: list[str],
    *,
    srun: bool,
) -> tuple[list[str], list[str]]:
    """(srun options, command prefix) that run a training task inside `image`.

    sqsh: Pyxis flags on the job's srun (every rank starts in the image); the run directory
    is mounted at the same path and is the container's working directory. sif: `apptainer
    exec --nv` before the command, under srun or alone.
    """
    binds = [f"{workdir}:{workdir}", *mounts]
    check_launch(fmt, srun=srun)
    if fmt == "sqsh":
        return [
            f"--container-image={image}",
            f"--container-mounts={','.join(binds)}",
            f"--container-workdir={workdir}",
            "--no-container-mount-home",
        ], []
    prefix = ["apptainer", "exec", "--nv", "--pwd", workdir]  # sif
    for bind in binds:
        prefix += ["--bind", bind]
    return [], [*prefix, image]
