"""Where a dataset's documents come from.

For now one type: ``local`` -- files on disk matched by globs under a root, one document per
file (the embedded default corpus is the running Python's standard library this way). A
dataset is split into a fixed number of shards, decided by config, so the DAG is static and
each shard is its own tokenization job.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from gptflow.config import expand_root
from gptflow.errors import GptflowError


def _matches(rel: str, patterns: list[str]) -> bool:
    """Glob match on a '/'-separated relative path; '**/' also matches zero directories."""
    for pat in patterns:
        if fnmatch.fnmatchcase(rel, pat):
            return True
        if pat.startswith("**/") and fnmatch.fnmatchcase(rel, pat[3:]):
            return True
    return False


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
    for pattern in include:
        for path in root.glob(pattern):
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


def shard_names(num_shards: int) -> list[str]:
    return [f"{i:05d}" for i in range(num_shards)]


def split_into_shards(files: list[Path], num_shards: int) -> list[list[Path]]:
    """Contiguous, nearly equal slices of the sorted file list (stable when files change)."""
    n = len(files)
    if num_shards > n:
        raise GptflowError(f"{num_shards} shards for {n} files: a shard would be empty")
    bounds = [round(i * n / num_shards) for i in range(num_shards + 1)]
    return [files[bounds[i] : bounds[i + 1]] for i in range(num_shards)]


def shard_files(name: str, spec: dict, shard: str, source: str = "config") -> list[Path]:
    """The files of one shard of a ``local`` dataset."""
    return local_shards(name, spec, source)[int(shard)]


def local_shards(name: str, spec: dict, source: str = "config") -> list[list[Path]]:
    """All shards of a ``local`` dataset, each a list of files."""
    files = list_local_files(name, spec, source)
    num = spec.get("shards", 1)
    if num > len(files):
        raise GptflowError(
            f"{source}: datasets.{name}.shards is {num}, but only {len(files)} files match; "
            f"lower datasets.{name}.shards to at most {len(files)}. Fix {source}."
        )
    return split_into_shards(files, num)
