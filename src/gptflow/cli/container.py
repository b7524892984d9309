"""``gptflow build-image`` and ``gptflow squash-image``: the training image and its squashfs or
SIF."""

from __future__ import annotations

import argparse


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, value


def add_build_image_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--repo", default=".", help="the gptflow checkout (package source, envs/)")
    s.add_argument("--dockerfile", default="envs/Dockerfile")
    s.add_argument("--out", required=True, help="the image record (JSON), written last")
    s.add_argument("--builder", default="auto", choices=["auto", "docker", "podman"])
    s.add_argument("--base-image", required=True, help="BASE_IMAGE of the Dockerfile")
    s.add_argument("--build-arg", type=_key_value, action="append", default=[], metavar="K=V")
    s.add_argument(
        "--build-option", action="append", default=[], help="an option for the builder's build"
    )
    s.add_argument(
        "--registry-login",
        nargs=3,
        action="append",
        default=[],
        metavar=("SERVER", "USERNAME", "PASSWORD_ENV"),
        help="log in first; the password is read from the environment variable PASSWORD_ENV",
    )


def cmd_build_image(a: argparse.Namespace) -> int:
    from gptflow.container.image import build_image

    build_image(
        repo=a.repo,
        dockerfile=a.dockerfile,
        out=a.out,
        builder=a.builder,
        base_image=a.base_image,
        build_args=dict(a.build_arg),
        options=a.build_option,
        registry_logins=[
            {"server": s, "username": u, "password_env": e} for s, u, e in a.registry_login
        ],
    )
    return 0


def add_squash_image_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--image", required=True, help="the record written by build-image")
    s.add_argument("--out", required=True)
    s.add_argument("--format", default="sqsh", choices=["sqsh", "sif"])
    s.add_argument("--method", default="auto", choices=["auto", "enroot", "builtin"])
    s.add_argument("--squash-options", default=None, help="mksquashfs options, one string")


def cmd_squash_image(a: argparse.Namespace) -> int:
    import shlex

    from gptflow.container.image import sif_image, squash_image

    if a.format == "sif":
        sif_image(image=a.image, out=a.out)
    else:
        options = shlex.split(a.squash_options) if a.squash_options is not None else None
        squash_image(image=a.image, out=a.out, method=a.method, options=options)
    return 0
