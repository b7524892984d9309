"""Where a dataset's bearer token may go: exact origins (scheme, host and port), over https
unless allowed otherwise, decided per request -- redirects included, as curl and requests decide
for credentials since CVE-2018-1000007 (:class:`TokenScope`). The token is read from an
environment variable, never from a command line, and never shown (a repr, a message); URLs
with a user name or password in them are refused (:func:`refuse_credentials_in_urls`), and
messages show URLs without their query strings (:func:`safe_url`: they may carry signatures).

The config's ``auth`` block (``token_env``, ``origins``, ``hosts``, ``allow_http``) is checked
at planning (:func:`token_origins`); ``gptflow download --token-env`` builds the scope a
download uses (:func:`scope_for`, :func:`gptflow.data.download.download`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gptflow.errors import GptflowError

log = logging.getLogger("gptflow.download")  # the download's logger

DEFAULT_PORTS = {"http": 80, "https": 443}


Origin = tuple[str, str, int]  # (scheme, host, port), the port explicit even when default


def origin_of(url: str) -> Origin:
    """(scheme, host, port) of an http(s) URL; ValueError if it has none."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {safe_url(url)}")
    return scheme, parts.hostname.lower(), parts.port or DEFAULT_PORTS[scheme]


def origin_text(origin: Origin) -> str:
    """``https://host`` or ``https://host:port`` (the port only when not the default)."""
    scheme, host, port = origin
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" if port == DEFAULT_PORTS[scheme] else f"{scheme}://{host}:{port}"


def parse_origin(text: str, where: str) -> Origin:
    """An origin as written in a config or on a command line: ``https://host[:port]``, or a
    bare host name, which means ``https://host`` (port 443)."""
    value = text.strip()
    if "://" not in value:
        value = f"https://{value}"
    try:
        parts = urlsplit(value)
        origin = origin_of(value)
    except ValueError:
        raise GptflowError(
            f"{where}: '{text}' is not an origin; write https://HOST or https://HOST:PORT"
        ) from None
    if parts.username is not None or parts.password is not None:
        raise GptflowError(f"{where}: an origin holds no user name or password; remove it")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise GptflowError(
            f"{where}: '{safe_url(value)}' is not an origin (it has a path or query); the token is "
            f"scoped to scheme, host and port only: write {origin_text(origin)}"
        )
    return origin


def refuse_credentials_in_urls(urls: list[str], where: str) -> None:
    """URLs like https://user:pass@host/ put a secret where it gets logged and shown in `ps`."""
    for url in urls:
        parts = urlsplit(url)
        if parts.username is not None or parts.password is not None:
            raise GptflowError(
                f"{where}: {safe_url(url)} has a user name or password in the URL; URLs are "
                f"logged and passed on command lines. Remove it and put a token in an environment "
                f"variable named by auth.token_env"
            )


def token_origins(auth: dict, primary_urls: list[str], where: str) -> tuple[str, ...]:
    """The origins a dataset's token goes to (``auth.origins`` + ``auth.hosts``, default the
    origins of the primary URLs), checked: an http origin needs ``auth.allow_http``."""
    listed = [(o, f"{where}.auth.origins: ", "") for o in auth.get("origins") or []]
    listed += [(h, f"{where}.auth.hosts: ", "") for h in auth.get("hosts") or []]
    origins = {parse_origin(text, key[:-2]): (key, why) for text, key, why in listed}
    if not origins:
        for url in primary_urls:
            try:
                origins.setdefault(origin_of(url), (f"{where}.auth: ", f" (of {safe_url(url)})"))
            except ValueError:
                continue  # not a URL: the download reports it
    if not auth.get("allow_http"):
        for origin, (key, why) in origins.items():
            if origin[0] == "http":
                raise GptflowError(
                    f"{key}{origin_text(origin)}{why} is plain http; the token in "
                    f"${auth['token_env']} goes only over https, so it would never be sent there. "
                    f"Use https, or set allow_http: true in this auth if that network is trusted"
                )
    return tuple(sorted(origin_text(o) for o in origins))


@dataclass(frozen=True)
class TokenScope:
    """A bearer token and where it may go: an exact origin (scheme, host, port) of
    `origins`, and over https unless `allow_http`. Decided per request, redirects included
    -- the rule curl and requests apply to credentials across redirects. The token never
    shows in a repr."""

    env: str | None = None
    origins: frozenset[Origin] = frozenset()
    allow_http: bool = False
    token: str | None = field(default=None, repr=False)

    def allows(self, url: str) -> bool:
        try:
            origin = origin_of(url)
        except ValueError:
            return False
        return origin in self.origins and (origin[0] == "https" or self.allow_http)

    def headers_for(self, url: str) -> dict[str, str]:
        if self.token and self.allows(url):
            return {"Authorization": f"Bearer {self.token}"}
        return {}

    def hint(self, url: str) -> str:
        """Why a 401/403 may have happened, naming the variable, never its value."""
        if not self.env:
            return " (gated? set auth.token_env)"
        if not self.token:
            return f" (gated: ${self.env} is not set)"
        if not self.allows(url):
            where = ", ".join(sorted(origin_text(o) for o in self.origins))
            return (
                f" (the token in ${self.env} goes only to {where}; list this origin in "
                f"auth.origins if it needs the token)"
            )
        return f" (is the token in ${self.env} valid?)"


def scope_for(
    urls: list[str], token_env: str | None, origins: list[str] | None, allow_http: bool
) -> TokenScope:
    if not token_env:
        return TokenScope()
    if origins:
        scoped = {parse_origin(o, "--token-origin") for o in origins}
    else:
        try:
            scoped = {origin_of(urls[0])} if urls else set()
        except ValueError:
            scoped = set()  # not an http(s) URL: the download reports it
    if not allow_http:
        for origin in sorted(scoped):
            if origin[0] == "http":
                raise GptflowError(
                    f"--token-origin {origin_text(origin)} is plain http: the token in "
                    f"${token_env} would cross the network unencrypted. Use https, or pass "
                    f"--token-allow-http (auth.allow_http: true) if that network is trusted"
                )
    token = os.environ.get(token_env) or None
    if token is None:
        log.warning("$%s is not set (or empty): downloading without a token", token_env)
    return TokenScope(token_env, frozenset(scoped), allow_http, token)


def safe_url(url: str) -> str:
    """The URL without credentials or query string, for messages."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]  # host[:port] as written, credentials dropped
    return f"{parts.scheme}://{netloc}{parts.path}"
