"""The files a url dataset is downloaded from, and the catalog: a dataset's (or a tokenizer
file's) URLs and mirrors, listed or expanded from a URL template over ``parts`` and ``vars``,
each with the name it is stored under (``resources/raw/{dataset}/{name}``: a URL is someone
else's text, so the name is checked, :func:`check_stored_name`) and its sha256 when known
(:class:`RemoteFile`); ``config/datasets.yaml``, every entry validated (:func:`load_catalog`).
:mod:`gptflow.data.sources` resolves url and catalog datasets into shards of these files.
"""

from __future__ import annotations

import collections
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from gptflow.config.schema import fill_defaults, load_yaml, validate
from gptflow.data.token_scope import refuse_credentials_in_urls
from gptflow.errors import GptflowError

# The name a downloaded file is stored under (resources/raw/{dataset}/{name}) comes from a URL,
# which is someone else's text: one path component of plain characters, not a name the
# download stage keeps beside it (SHA256SUMS, NAME.sha256, NAME.part, NAME.lock).
STORED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
RESERVED_SUFFIXES = (".sha256", ".part", ".lock")
MAX_NAME_BYTES = 200


def check_stored_name(name: str, where: str) -> str:
    """`name` if a download may be stored under it, else an error naming it and the fix."""
    problem = None
    if not STORED_NAME.fullmatch(name):
        problem = "is not a plain file name (letters, digits and . _ + - only, no leading dot)"
    elif name == "SHA256SUMS" or name.endswith(RESERVED_SUFFIXES):
        problem = "is a name the download stage keeps for its own files"
    elif len(name.encode()) > MAX_NAME_BYTES:
        problem = f"is longer than {MAX_NAME_BYTES} bytes"
    if problem:
        raise GptflowError(
            f"{where}: the stored name {name!r} {problem}; set name: for this file (url "
            f"datasets) or use a URL whose last path component is a plain file name"
        )
    return name


@dataclass(frozen=True)
class RemoteFile:
    """One file of a url dataset: where to get it (primary URL first) and what it must hash to."""

    name: str
    urls: tuple[str, ...]
    sha256: str | None

    # `gptflow download` options (argv words; nothing when unset), one per rule param
    def mirror_args(self) -> list[str]:
        return [word for url in self.urls[1:] for word in ("--mirror", url)]

    def sha256_args(self) -> list[str]:
        return ["--sha256", self.sha256] if self.sha256 else []


def load_catalog(path: str | os.PathLike, schema: dict) -> dict:
    """config/datasets.yaml, every entry validated (errors name the catalog file)."""
    catalog = load_yaml(path) or {}
    if not isinstance(catalog, dict):
        raise GptflowError(f"{path}: expected a mapping of dataset names to entries")
    for entry_name, entry in catalog.items():
        validate(
            entry,
            schema["$defs"]["catalog_entry"],
            source=f"{path} (entry {entry_name})",
            root=schema,
        )
        fill_defaults(entry, schema["$defs"]["catalog_entry"], schema)
    return catalog


def _template(template: str, values: dict, where: str) -> str:
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError) as e:
        names = sorted({f for _, f, _, _ in string.Formatter().parse(template) if f})
        raise GptflowError(
            f"{where}: cannot fill the URL template {template!r} ({type(e).__name__}: {e}); it "
            f"needs {names} - set them with vars (and parts)"
        ) from None


def url_files(name: str, spec: dict, where: str) -> list[RemoteFile]:
    """The remote files of a url dataset spec (explicit list or expanded template)."""
    if bool(spec.get("files")) == bool(spec.get("url_template")):
        raise GptflowError(
            f"{where}: a url dataset needs either files or url_template (with parts), not both"
        )
    given = sorted(k for k in ("parts", "vars", "mirror_templates") if k in spec)
    if spec.get("files") and given:
        raise GptflowError(
            f"{where}: {' and '.join(given)} apply to a url_template; with files they are "
            f"unused - remove them"
        )
    unused = sorted(set(spec.get("vars", {})) - template_fields(spec))
    if unused:
        raise GptflowError(
            f"{where}: vars sets {unused}, which url_template does not use (its variables: "
            f"{sorted(template_fields(spec) - {'part'}) or 'none'}); remove them"
        )
    files: list[RemoteFile] = []
    if spec.get("files"):
        for i, f in enumerate(spec["files"]):
            if "url" not in f:
                raise GptflowError(f"{where}: files[{i}] has no url")
            urls = (f["url"], *f.get("mirrors", []))
            refuse_credentials_in_urls(list(urls), where)  # before any message shows a URL
            files.append(
                RemoteFile(
                    f.get("name") or url_file_name(f["url"]),
                    urls,
                    (f.get("sha256") or "").lower() or None,
                )
            )
    else:
        if "parts" not in spec:
            raise GptflowError(f"{where}: url_template needs parts: [first, last]")
        first, last = spec["parts"]
        if last < first:
            raise GptflowError(f"{where}: parts [{first}, {last}] is empty (last < first)")
        for part in range(first, last + 1):
            values = {**spec.get("vars", {}), "part": part}
            url = _template(spec["url_template"], values, where)
            mirrors = [_template(m, values, where) for m in spec.get("mirror_templates", [])]
            refuse_credentials_in_urls([url, *mirrors], where)
            files.append(RemoteFile(url_file_name(url), (url, *mirrors), None))
    names = [check_stored_name(f.name, where) for f in files]
    # counted once (names.count per name was quadratic: 0.8 s of planning at 10,000 parts)
    dupes = sorted(n for n, times in collections.Counter(names).items() if times > 1)
    if dupes:
        raise GptflowError(
            f"{where}: several files would be stored as {dupes}; give them distinct names"
        )
    return files


def tokenizer_remote_file(key: str, spec: dict, where: str) -> RemoteFile:
    """Tokenizer file `key` (``tokenizer.url``/``vocab``/``merges``) to download: its stored
    name, URL and mirrors, and sha256 as the config gives it."""
    urls = (spec["url"], *spec.get("mirrors", []))
    return RemoteFile(tokenizer_file_name(key, spec, where), urls, spec.get("sha256") or None)


def tokenizer_file_name(key: str, spec: dict, where: str) -> str:
    """The stored name of tokenizer file `key` (``tokenizer.url``/``vocab``/``merges``) fetched
    from ``spec["url"]``: checked like a dataset file's, its URLs free of credentials."""
    refuse_credentials_in_urls([spec["url"], *spec.get("mirrors", [])], f"{where}: tokenizer.{key}")
    name = spec.get("name") or url_file_name(spec["url"])
    return check_stored_name(name, f"{where}: tokenizer.{key}")


def url_file_name(url: str) -> str:
    """The last path component of a URL: the name a download is stored under."""
    name = unquote(Path(urlsplit(url).path).name)
    if not name:
        raise GptflowError(f"{url}: the URL has no file name; set name: for this file")
    return name


def template_fields(spec: dict) -> set[str]:
    """The variables of a url dataset's url_template and mirror_templates ({part}, {lang}, ...)."""
    templates = [spec.get("url_template") or "", *spec.get("mirror_templates", [])]
    return {
        field.split(".")[0].split("[")[0]
        for t in templates
        for _, field, _, _ in string.Formatter().parse(t)
        if field
    }


def check_catalog_parts(entry: dict, parts: list, key: str, entry_name: str, source: str) -> None:
    """A config's parts lie within the entry's: those are the files that exist. Not checked
    when the template takes other variables (OSCAR's {lang}): how many parts exist differs by
    their values, and the entry's parts are only a default."""
    if template_fields(entry) - {"part"}:
        return
    first, last = entry["parts"]
    if not first <= parts[0] <= parts[1] <= last:
        raise GptflowError(
            f"{source}: {key} is {parts}, but catalog entry '{entry_name}' has parts "
            f"[{first}, {last}]; give [first, last] with {first} <= first <= last <= {last}. "
            f"Fix {source}."
        )
