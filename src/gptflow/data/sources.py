"""Where a dataset's documents come from: the config's dataset entries resolved into shards.

Five kinds of entries (``datasets.<name>.type``):

``local``
    Files on disk matched by globs under a root. With ``format: document_per_file`` (the
    default; the embedded corpus is the Python standard library this way) every file is one
    document and the files are split into a fixed number of shards, each collected into JSONL.
    With a data format (``jsonl.zst``, ``parquet``, ...) every file is a shard of documents.
``url``
    Files to download (URL + mirrors + sha256, or a URL template over ``parts``); one shard
    per file, stored under ``resources/raw/{dataset}/{file}``.
``hf``
    One split of a Hugging Face dataset (a Hub name or a local directory), read with the
    ``datasets`` library (:mod:`gptflow.data.hf`) and cut into ``shards`` contiguous row ranges,
    each collected into JSONL like a local dataset's files.
``catalog``
    An entry of ``config/datasets.yaml`` (a ``url`` or ``hf`` dataset with provenance),
    optionally narrowed with ``parts``/``vars`` (url) or ``shards`` (hf).
``megatron``
    Megatron ``.bin``/``.idx`` shards already tokenized (``prefixes``): one shard per prefix,
    named by its file name, imported (checked, linked) by :mod:`gptflow.data.shard_import`.

The shard list is static -- decided by the config, not by the data -- so the whole DAG,
downloads included, is known to ``snakemake -n``.

Over 500 lines: a section per dataset type (local, hf, megatron, url and the catalog), all
resolved by :func:`resolve_datasets` into the same :class:`Dataset` and :class:`Shard` records.
A url dataset's files (URLs, templates, stored names) and the catalog file are
:mod:`gptflow.data.remote_files`.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from gptflow import paths
from gptflow.data.readers import FORMATS, infer_format
from gptflow.data.remote_files import (
    MAX_NAME_BYTES,
    RemoteFile,
    check_catalog_parts,
    load_catalog,
    template_fields,
    url_files,
)
from gptflow.data.token_scope import refuse_credentials_in_urls, token_origins
from gptflow.errors import GptflowError

# A megatron prefix's file name is its shard's name: a path component and a {shard} wildcard
# value (the schema's pattern for datasets.*.prefixes, checked again where the name is taken).
# 'merged' is tokenize.merge's output beside the shards.
SHARD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
RESERVED_SHARD_NAMES = ("merged",)


def expand_root(root: str) -> Path:
    """Expand ``{python_stdlib}``, ``~`` and ``$VARS`` in a dataset root."""
    root = root.replace("{python_stdlib}", sysconfig.get_paths()["stdlib"])
    return Path(os.path.expandvars(os.path.expanduser(root)))


@dataclass(frozen=True)
class Shard:
    """One tokenization job: the file it reads and how to read it."""

    name: str  # "00000", ...
    input: str  # the file tokenization reads (megatron: the prefix the shard is imported from)
    fmt: str
    member: str = "*"
    member_format: str | None = None
    json_key: str = "text"
    remote: RemoteFile | None = None  # url datasets: downloaded into `input`
    files: tuple[str, ...] = ()  # document_per_file: the files collected into `input`

    def member_args(self) -> list[str]:
        """`--member GLOB` when the shard reads some of an archive's members, else nothing."""
        return ["--member", self.member] if self.member != "*" else []

    def member_format_args(self) -> list[str]:
        return ["--member-format", self.member_format] if self.member_format else []

    def reader_args(self) -> list[str]:
        """The `gptflow tokenize` / `sample-documents` options that read this shard."""
        args = ["--format", self.fmt, "--json-key", self.json_key]
        return args + self.member_args() + self.member_format_args()


@dataclass(frozen=True)
class HfSource:
    """What an hf dataset reads: load_dataset's arguments (path, name, split, revision,
    streaming) and the column holding the text."""

    path: str
    name: str | None
    split: str
    revision: str | None
    text_key: str
    streaming: bool

    def settings(self) -> dict:
        """The values as a mapping (the collect job's params, its manifest)."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class Dataset:
    name: str
    # "collect" (local, one document per file), "files" (local data files), "url", "megatron",
    # "hf" (a Hugging Face dataset, its row ranges collected into JSONL)
    kind: str
    shards: tuple[Shard, ...]
    root: str = ""  # local datasets: the root as written in the config
    hf: HfSource | None = None  # hf datasets: what load_dataset reads
    token_env: str | None = None  # url datasets: the NAME of the variable holding a token
    token_origins: tuple[
        str, ...
    ] = ()  # https://host[:port] it is sent to (token_scope.TokenScope)
    token_allow_http: bool = False

    # Rules ask these once or twice per job: built once per dataset (a scan or a rebuilt dict
    # per call made planning quadratic in the number of shards -- 13 s of 25 at 1,000 parts).
    @functools.cached_property
    def _shards_by_name(self) -> dict[str, Shard]:
        return {s.name: s for s in self.shards}

    def shard(self, name: str) -> Shard:
        try:
            return self._shards_by_name[name]
        except KeyError:
            raise KeyError(f"{self.name} has no shard {name}") from None

    @functools.cached_property
    def remote_files(self) -> dict[str, RemoteFile]:
        return {Path(s.input).name: s.remote for s in self.shards if s.remote is not None}

    # `gptflow download` options of the token (argv words; nothing without auth.token_env)
    def token_env_args(self) -> list[str]:
        """The variable's name: the job reads the token from its environment."""
        return ["--token-env", self.token_env] if self.token_env else []

    def token_origin_args(self) -> list[str]:
        if not self.token_env:
            return []
        return [word for origin in self.token_origins for word in ("--token-origin", origin)]

    def token_allow_http_args(self) -> list[str]:
        return ["--token-allow-http"] if self.token_env and self.token_allow_http else []


def shard_names(num_shards: int) -> list[str]:
    return [f"{i:05d}" for i in range(num_shards)]


def file_stamps(files) -> list[list]:
    """[path, bytes, mtime ns] of each file: a changed, added or removed file changes them."""
    stamps = []
    for path in files:
        st = os.stat(path)
        stamps.append([path, st.st_size, st.st_mtime_ns])
    return stamps


def part_count(documents: int, documents_per_part: int) -> int:
    """Parts of an input of `documents` documents (tokenize.documents_per_shard): one per
    `documents_per_part`, the last maybe shorter; an empty input is one empty part."""
    return max(1, -(-documents // documents_per_part))


def counted_parts(count_file: str | os.PathLike, documents_per_part: int) -> int:
    """:func:`part_count` of an input from its count file (``gptflow count-documents``)."""
    with open(count_file) as f:
        return part_count(json.load(f)["documents"], documents_per_part)


def part_documents(part: int, documents_per_part: int) -> str:
    """`gptflow tokenize --documents START:STOP` of part `part` (STOP may pass the end)."""
    start = part * documents_per_part
    return f"{start}:{start + documents_per_part}"


def needed_datasets(cfg: dict) -> list[str]:
    """The datasets a validated workflow config uses: the blend's, then the tokenizer's."""
    names = [item["dataset"] for item in cfg["data"]["blend"]]
    if cfg["tokenizer"]["source"] == "train":
        names += [n for n in cfg["tokenizer"]["train"]["datasets"] if n not in names]
    return names


# ----------------------------------------------------------------------------- local


def _matches(rel: str, patterns: list[str]) -> bool:
    """Glob match on a '/'-separated relative path; '**/' also matches zero directories."""
    for pat in patterns:
        if fnmatch.fnmatchcase(rel, pat):
            return True
        if pat.startswith("**/") and fnmatch.fnmatchcase(rel, pat[3:]):
            return True
    return False


def _glob(root: Path, pattern: str, key: str, source: str) -> list[Path]:
    """``root.glob(pattern)``; a pattern pathlib refuses (empty, absolute, '**' inside a
    component) is an error naming `key`."""
    try:
        return list(root.glob(pattern))
    except (ValueError, NotImplementedError) as e:
        raise GptflowError(
            f"{source}: {key} is {pattern!r}, a glob pathlib refuses ({e}); give a pattern "
            f"relative to the root, '**' only as a whole path component (e.g. 'json/**/*.py'). "
            f"Fix {key} in {source}."
        ) from None


def list_local_files(name: str, spec: dict, source: str = "config") -> list[Path]:
    """Sorted files of a ``local`` dataset; an error names the key when nothing matches."""
    root = expand_root(spec["root"])
    if not root.is_dir():
        raise GptflowError(
            f"{source}: datasets.{name}.root '{spec['root']}' ({root}) is not a directory. "
            f"Fix datasets.{name}.root in {source}."
        )
    include, exclude = spec["include"], spec.get("exclude", [])
    found: set[Path] = set()
    for i, pattern in enumerate(include):
        for path in _glob(root, pattern, f"datasets.{name}.include[{i}]", source):
            if path.is_file():
                rel = path.relative_to(root).as_posix()
                if not _matches(rel, exclude):
                    found.add(path)
    if not found:
        raise GptflowError(
            f"{source}: datasets.{name}.include {include} matched no files under {root}"
            f"{' (after exclude ' + str(exclude) + ')' if exclude else ''}. "
            f"Fix datasets.{name} in {source}."
        )
    files = sorted(found)
    if sum(os.path.getsize(p) for p in files) == 0:
        raise GptflowError(
            f"{source}: datasets.{name} matched {len(files)} files under {root}, all empty; "
            f"there is nothing to train on. Fix datasets.{name} in {source}."
        )
    return files


def shard_bounds(n: int, num_shards: int) -> list[int]:
    """Where `num_shards` contiguous, nearly equal slices of `n` items start (and the last
    ends): the files of a local dataset, the rows of an hf dataset."""
    return [round(i * n / num_shards) for i in range(num_shards + 1)]


def split_into_shards(files: list[Path], num_shards: int) -> list[list[Path]]:
    """Contiguous, nearly equal slices of the sorted file list (stable when files change)."""
    n = len(files)
    if num_shards > n:
        raise GptflowError(f"{num_shards} shards for {n} files: a shard would be empty")
    bounds = shard_bounds(n, num_shards)
    return [files[bounds[i] : bounds[i + 1]] for i in range(num_shards)]


def local_shards(name: str, spec: dict, source: str = "config") -> list[list[Path]]:
    """The file groups of a ``local`` document_per_file dataset."""
    files = list_local_files(name, spec, source)
    num = spec.get("shards", 1)
    if num > len(files):
        raise GptflowError(
            f"{source}: datasets.{name}.shards is {num}, but only {len(files)} files match; "
            f"lower datasets.{name}.shards to at most {len(files)}. Fix {source}."
        )
    return split_into_shards(files, num)


def _local_dataset(name: str, spec: dict, source: str) -> Dataset:
    fmt = spec.get("format", "document_per_file")
    if fmt == "document_per_file":
        groups = local_shards(name, spec, source)
        shards = tuple(
            Shard(
                name=shard,
                input=paths.DOCUMENTS.format(dataset=name, shard=shard),
                fmt="jsonl",
                json_key="text",
                files=tuple(str(p) for p in group),
            )
            for shard, group in zip(shard_names(len(groups)), groups, strict=True)
        )
        return Dataset(name, "collect", shards, root=spec["root"])
    files = list_local_files(name, spec, source)
    shards = tuple(
        Shard(
            name=shard,
            input=str(path),
            fmt=fmt,
            member=spec.get("member", "*"),
            member_format=spec.get("member_format"),
            json_key=spec.get("json_key", "text"),
        )
        for shard, path in zip(shard_names(len(files)), files, strict=True)
    )
    return Dataset(name, "files", shards, root=spec["root"])


# ----------------------------------------------------------------------------- hf


def _hf_dataset(name: str, spec: dict, where: str) -> Dataset:
    """`shards` JSONL document files, each a contiguous row range of the split (its bounds
    computed by the job, which knows the row count)."""
    num = spec.get("shards", 1)
    if spec.get("streaming") and num != 1:
        raise GptflowError(
            f"{where}: streaming is true with shards {num}; a stream's length is unknown "
            f"until it is read, so it is one shard: set shards: 1 or streaming: false"
        )
    source = HfSource(
        path=spec["path"],
        name=spec.get("name"),
        split=spec.get("split", "train"),
        revision=spec.get("revision"),
        text_key=spec.get("text_key", "text"),
        streaming=bool(spec.get("streaming", False)),
    )
    shards = tuple(
        Shard(name=shard, input=paths.DOCUMENTS.format(dataset=name, shard=shard), fmt="jsonl")
        for shard in shard_names(num)
    )
    return Dataset(name, "hf", shards, hf=source)


# ----------------------------------------------------------------------------- megatron


def _megatron_dataset(name: str, spec: dict, source: str) -> Dataset:
    """Existing shards: each prefix checked for a strict, unique shard name and both files."""
    shards: list[Shard] = []
    seen: dict[str, int] = {}  # shard name -> index of its prefix
    for i, given in enumerate(spec["prefixes"]):
        key = f"datasets.{name}.prefixes[{i}]"
        prefix = expand_root(given)
        shard, problem = prefix.name, None
        if not SHARD_NAME.fullmatch(shard):
            problem = (
                "is not a plain name (letters, digits, '.', '_' and '-', no leading '.' or '-')"
            )
        elif shard in RESERVED_SHARD_NAMES:
            problem = "is the name of the dataset's merged shard (tokenize.merge)"
        elif len(shard.encode()) > MAX_NAME_BYTES:
            problem = f"is longer than {MAX_NAME_BYTES} bytes"
        elif shard in seen:
            problem = (
                f"is also the shard name of prefixes[{seen[shard]}]; shards of a dataset need "
                f"distinct file names (link one under another name) or put them in two datasets"
            )
        if problem:
            raise GptflowError(
                f"{source}: {key} is {given!r}: its file name {shard!r}, the shard's name, "
                f"{problem}. Fix {key} in {source}."
            )
        for path in (Path(f"{prefix}.idx"), Path(f"{prefix}.bin")):
            if not path.is_file():
                hint = (
                    " (a prefix is the path without .bin/.idx)"
                    if given.endswith((".bin", ".idx"))
                    else ""
                )
                raise GptflowError(
                    f"{source}: {key} is {given!r}, but {path} does not exist (relative to "
                    f"{Path.cwd()}){hint}. Fix {key} in {source}."
                )
        seen[shard] = i
        shards.append(Shard(name=shard, input=str(prefix), fmt="megatron"))
    return Dataset(name, "megatron", tuple(shards))


# ----------------------------------------------------------------------------- url + catalog
# (their files: gptflow.data.remote_files)


def _url_dataset(name: str, spec: dict, where: str) -> Dataset:
    files = url_files(name, spec, where)
    shards = []
    for shard, f in zip(shard_names(len(files)), files, strict=True):
        fmt = spec.get("format") or _format_of(f.name, where)
        if fmt not in FORMATS:
            raise GptflowError(
                f"{where}: format '{fmt}' is not supported; use one of {', '.join(sorted(FORMATS))}"
            )
        shards.append(
            Shard(
                name=shard,
                input=paths.RAW_FILE.format(dataset=name, file=f.name),
                fmt=fmt,
                member=spec.get("member", "*"),
                member_format=spec.get("member_format"),
                json_key=spec.get("json_key", "text"),
                remote=f,
            )
        )
    refuse_credentials_in_urls([u for f in files for u in f.urls], where)
    auth = spec.get("auth") or {}
    origins = token_origins(auth, [f.urls[0] for f in files], where) if auth else ()
    return Dataset(
        name, "url", tuple(shards), token_env=auth.get("token_env"), token_origins=origins,
        token_allow_http=bool(auth.get("allow_http")),
    )  # fmt: skip


def _format_of(file_name: str, where: str) -> str:
    try:
        return infer_format(file_name)
    except GptflowError:
        raise GptflowError(
            f"{where}: cannot tell the format of '{file_name}' from its name; set format "
            f"(one of {', '.join(sorted(FORMATS))})"
        ) from None


def resolve_dataset(
    name: str, spec: dict, *, catalog: dict, catalog_path: str, source: str
) -> Dataset:
    """One config dataset entry -> its shards (errors name the dataset and the file to fix)."""
    kind = spec["type"]
    if kind == "local":
        return _local_dataset(name, spec, source)
    if kind == "url":
        return _url_dataset(name, spec, f"{source}: datasets.{name}")
    if kind == "megatron":
        return _megatron_dataset(name, spec, source)
    if kind == "hf":
        return _hf_dataset(name, spec, f"{source}: datasets.{name}")
    entry_name = spec["name"]
    if entry_name not in catalog:
        raise GptflowError(
            f"{source}: datasets.{name}.name '{entry_name}' is not in the catalog {catalog_path} "
            f"(entries: {', '.join(sorted(catalog))}). Fix datasets.{name} in {source}."
        )
    entry = {
        k: v
        for k, v in catalog[entry_name].items()
        if k not in ("description", "homepage", "license", "gated", "size_gb")
    }
    key = f"datasets.{name}"
    where = f"{source}: {key} (catalog entry '{entry_name}')"
    if entry.get("type") == "hf":
        given = sorted(k for k in ("parts", "vars") if k in spec)
        if given:
            raise GptflowError(
                f"{where}: {' and '.join(given)} apply to url entries; catalog entry "
                f"'{entry_name}' is a Hugging Face dataset (narrow it with shards). Remove "
                f"{key}.{given[0]} in {source}."
            )
        return _hf_dataset(name, {**entry, "shards": spec.get("shards", entry["shards"])}, where)
    if "shards" in spec:
        raise GptflowError(
            f"{where}: {key}.shards applies to hf entries; catalog entry '{entry_name}' is a "
            f"list of files to download, one shard each. Remove {key}.shards in {source}."
        )
    if "parts" in spec:
        if "url_template" not in entry:
            raise GptflowError(
                f"{source}: {key}.parts is {spec['parts']}, but catalog entry '{entry_name}' is "
                f"a list of files, not a template over parts; remove {key}.parts. Fix {source}."
            )
        check_catalog_parts(entry, spec["parts"], f"{key}.parts", entry_name, source)
        entry["parts"] = spec["parts"]
    if "vars" in spec:
        used = template_fields(entry)
        unused = sorted(set(spec["vars"]) - used)
        if unused:
            takes = sorted(used - {"part"})
            raise GptflowError(
                f"{source}: {key}.vars sets {unused}, which catalog entry '{entry_name}' "
                f"{'has no URL template to use' if not entry.get('url_template') else 'does not use'}"
                f" (its template variables: {takes or 'none'}); remove them from {key}.vars. "
                f"Fix {source}."
            )
        entry["vars"] = {**entry.get("vars", {}), **spec["vars"]}
    return _url_dataset(name, entry, where)


def resolve_datasets(
    cfg: dict, names: list[str], *, catalog_path: str | os.PathLike, schema: dict, source: str
) -> dict[str, Dataset]:
    """The datasets `names` of a validated workflow config, resolved (catalog, globs, templates)."""
    catalog = None
    out = {}
    for name in names:
        spec = cfg["datasets"][name]
        if spec["type"] == "catalog" and catalog is None:
            catalog = load_catalog(catalog_path, schema)
        out[name] = resolve_dataset(
            name, spec, catalog=catalog or {}, catalog_path=str(catalog_path), source=source
        )
    return out


def planned_shard(prefix: str, datasets: dict[str, Dataset], tokenizer: str, parts: bool) -> bool:
    """`prefix` is a token shard the workflow makes for one of `datasets` (a shard, its
    dataset's merged shard, or with `parts` (tokenize.documents_per_shard) a part of a shard)."""
    for name, d in datasets.items():
        shards = [s.name for s in d.shards]
        if prefix in (paths.shard_prefix(tokenizer, name, s) for s in shards):
            return True
        if d.kind == "megatron":
            continue
        if prefix == paths.merged_prefix(tokenizer, name):
            return True
        stems = [paths.part_prefix(tokenizer, name, s, "") for s in shards]
        if parts and any(re.fullmatch(re.escape(stem) + r"\d{4}", prefix) for stem in stems):
            return True
    return False


def check_eval_extra(
    extra: dict[str, list[str]],
    datasets: dict[str, Dataset],
    tokenizer: str,
    parts: bool,
    source: str,
) -> None:
    """Every ``eval.extra`` prefix has its .bin and .idx on disk or is a shard this plan makes
    (:func:`planned_shard`), so the evaluation's inputs exist when the workflow is planned."""
    for name, prefixes in extra.items():
        for i, prefix in enumerate(prefixes):
            if planned_shard(prefix, datasets, tokenizer, parts):
                continue
            for path in (Path(f"{prefix}.bin"), Path(f"{prefix}.idx")):
                if not path.is_file():
                    raise GptflowError(
                        f"{source}: eval.extra.{name}[{i}] is {prefix!r}, but {path} does not "
                        f"exist (relative to {Path.cwd()}) and no dataset of this config makes "
                        f"it; give the prefix of an existing .bin/.idx pair (without the "
                        f"extension) or of a shard of datasets "
                        f"(results/tokens/{tokenizer}/DATASET/00000). Fix eval.extra in {source}."
                    )
