"""Hugging Face datasets (``type: hf``) read with the ``datasets`` library itself.

A split is opened the way its users open it -- ``load_dataset(path, name, split=...,
revision=...)``, through the library's cache (``$HF_HOME``, ``$HF_DATASETS_CACHE``) and its
offline mode (``$HF_DATASETS_OFFLINE=1`` / ``$HF_HUB_OFFLINE=1``); a directory written by
``save_to_disk`` with ``load_from_disk`` -- and written as our JSONL documents, one contiguous
row range per shard (:func:`gptflow.data.sources.shard_bounds`), so the tokenization after it
is the one every other dataset goes through. ``datasets`` is an optional extra
(:data:`INSTALL`), imported only by the functions that need it.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import gptflow
from gptflow.data.readers import blank
from gptflow.data.sources import Dataset, HfSource, expand_root, shard_bounds
from gptflow.errors import GptflowError
from gptflow.fsutil import atomic_write

INSTALL = "pip install 'gptflow[hf-datasets]'"
BATCH_ROWS = 1000  # rows read per slice of the Arrow table
HUB_TIMEOUT_S = 10.0  # planning's request to the Hub per dataset: connect, then each read


def import_problem() -> str | None:
    """Why ``import datasets`` fails here, or None."""
    try:
        import datasets  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def local_directory(src: HfSource) -> Path | None:
    """The directory `src.path` names on disk, or None: a Hub name."""
    path = expand_root(src.path)
    return path if path.is_dir() else None


def saved_to_disk(directory: Path) -> bool:
    """A directory written by ``Dataset(Dict).save_to_disk`` (read with ``load_from_disk``)."""
    return (directory / "state.json").is_file() or (directory / "dataset_dict.json").is_file()


def prefetch_command(src: HfSource) -> str:
    """The shell line that puts `src` into the datasets cache (run where the Hub is reachable)."""
    args = [repr(src.path), *([repr(src.name)] if src.name else []), f"split={src.split!r}"]
    if src.revision:
        args.append(f"revision={src.revision!r}")
    call = f"load_dataset({', '.join(args)})"
    return f'python -c "from datasets import load_dataset; {call}"'


def open_split(src: HfSource):
    """The split `src` names: a ``datasets.Dataset`` (an ``IterableDataset`` when streaming)."""
    import datasets

    directory = local_directory(src)
    if directory is not None and saved_to_disk(directory):
        saved = datasets.load_from_disk(str(directory))
        if not isinstance(saved, datasets.DatasetDict):
            return saved  # one Dataset: the whole of it
        if src.split not in saved:
            raise GptflowError(
                f"{src.path}: the saved dataset has no split {src.split!r} (its splits: "
                f"{', '.join(saved)}); set split to one of them"
            )
        return saved[src.split]
    return datasets.load_dataset(
        str(directory) if directory is not None else src.path,
        src.name,
        split=src.split,
        revision=src.revision,
        streaming=src.streaming,
    )


def check_planned(datasets: dict[str, Dataset], source: str) -> list[str]:
    """At plan time, for the hf datasets among `datasets`: the library imports; online, each
    Hub dataset exists (:func:`check_on_hub`: one request each); offline, each loads from the
    cache. A problem is one line (GptflowError); returns warnings (the Hub not reachable)."""
    hf = {name: d.hf for name, d in datasets.items() if d.hf is not None}
    if not hf:
        return []
    problem = import_problem()
    if problem:
        raise GptflowError(
            f"{source}: datasets.{next(iter(hf))} is a Hugging Face dataset, but the datasets "
            f"library cannot be imported in {sys.prefix} ({problem}); install it with {INSTALL}"
        )
    from datasets import config

    hub = {name: src for name, src in hf.items() if local_directory(src) is None}
    if not config.HF_HUB_OFFLINE:
        return check_on_hub(hub, source)  # the job downloads what is missing
    for name, src in hub.items():
        where = f"{source}: datasets.{name} ({src.path!r}, name {src.name!r}, split {src.split!r})"
        if src.streaming:
            raise GptflowError(
                f"{where}: streaming reads from the Hub, and HF_DATASETS_OFFLINE/HF_HUB_OFFLINE "
                f"is set; set streaming: false and fetch it into the cache on a machine with "
                f"internet: {prefetch_command(src)}"
            )
        try:
            open_split(src)
        except Exception as e:  # the library's own: offline and not cached, no such split, ...
            reason = _first_line(e)
            raise GptflowError(
                f"{where}: cannot be loaded offline (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE) from "
                f"the cache {config.HF_DATASETS_CACHE} ({reason}); fetch it on a login node "
                f"with the same HF_HOME: {prefetch_command(src)}"
            ) from None
    return []


def check_on_hub(hub: dict[str, HfSource], source: str) -> list[str]:
    """Each of `hub` (hf datasets that are no directory here) exists on the Hub: one GET of
    ``{HF_ENDPOINT}/api/datasets/{path}[/revision/{revision}]`` each, with the user's token,
    HUB_TIMEOUT_S at most (a plain request: ``HfApi`` first fetches a telemetry registry from
    the same endpoint). The answer is read as ``huggingface_hub`` reads it. No such dataset
    or revision, or a path that is neither a directory nor a Hub name: one line. The Hub not
    answering is a warning (it may be down for a minute, the dataset cached already), and the
    datasets after it are not asked: planning does not wait on it."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    endpoint, token = constants.ENDPOINT, get_token()
    headers = {"User-Agent": f"gptflow/{gptflow.__version__}"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    for i, (name, src) in enumerate(hub.items()):
        key = f"{source}: datasets.{name}"
        here = expand_root(src.path).absolute()
        try:
            validate_repo_id(src.path)
        except HFValidationError as e:
            raise GptflowError(
                f"{key}.path is {src.path!r}: no directory {here} here, and not a Hub dataset "
                f"name ({_first_line(e)}); set it to an existing directory or a Hub name such "
                f"as 'Salesforce/wikitext'"
            ) from None
        url = f"{endpoint}/api/datasets/{src.path}"
        if src.revision:
            url += f"/revision/{urllib.parse.quote(src.revision, safe='')}"
        try:
            urllib.request.urlopen(
                urllib.request.Request(url, headers=headers), timeout=HUB_TIMEOUT_S
            ).close()
            continue
        except urllib.error.HTTPError as e:
            code, answer = e.headers.get("X-Error-Code"), _hub_message(e)
            status = e.code
        except Exception as e:  # no answer, refused, no such host
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            code, status = None, None
            answer = f"{type(reason).__name__}: {_first_line(reason)}"
        if code == "RevisionNotFound":
            raise GptflowError(
                f"{key}.revision is {src.revision!r}: {src.path!r} on the Hub ({endpoint}) has "
                f"no such branch, tag or commit; set revision to one it has, or null for the "
                f"default branch"
            )
        if code == "GatedRepo":
            return [
                f"{key} ({src.path!r}) is gated on the Hub ({endpoint}): accept its terms on "
                f"its page and log in (hf auth login, or HF_TOKEN) before its collect job runs"
            ]
        # huggingface_hub's reading: 401 is also what a missing repository gets, unauthenticated
        if (
            code == "RepoNotFound"
            or status == 404
            or (status == 401 and answer != "Invalid credentials in Authorization header")
        ):
            raise GptflowError(
                f"{key}.path is {src.path!r}: no dataset of that name on the Hub ({endpoint}: "
                f"{status} {answer}) and no directory {here} here; set it to a Hub dataset "
                f"name (e.g. 'Salesforce/wikitext') or an existing directory (a private "
                f"dataset also needs a token: hf auth login, or HF_TOKEN)"
            )
        unasked = [f"datasets.{n}" for n in list(hub)[i + 1 :]]
        return [
            f"{key} ({src.path!r}): could not ask the Hub ({endpoint}) whether it exists "
            f"({f'{status} ' if status else ''}{answer})"
            + (f", nor for {', '.join(unasked)}" if unasked else "")
            + "; planned without that check: its collect job downloads it. Where jobs have no "
            f"internet, fetch it on a login node with the same HF_HOME ({prefetch_command(src)}) "
            f"and plan with HF_HUB_OFFLINE=1"
        ]
    return []


def _hub_message(e: urllib.error.HTTPError) -> str:
    """The Hub's own error message (a JSON ``{"error": ...}``), else the HTTP reason."""
    try:
        return str(json.loads(e.read(64_000))["error"])
    except Exception:
        return e.reason


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def collect_hf_documents(
    src: HfSource, shard: int, num_shards: int, out: str | os.PathLike
) -> dict:
    """Write rows [start, stop) of the split -- shard `shard` of `num_shards` contiguous ranges
    -- as JSONL ``{"text": ..., "row": i}``; rows whose text is :func:`~gptflow.data.readers.blank`
    are dropped and counted, as a local dataset's blank files are. Returns the manifest's fields."""
    import datasets

    split = open_split(src)
    columns = split.column_names
    if columns is not None and src.text_key not in columns:
        raise GptflowError(
            f"{src.path}: split {src.split!r} has no column {src.text_key!r} (its columns: "
            f"{', '.join(columns)}); set text_key to the column holding the text"
        )
    if src.streaming:
        start, stop, total = 0, None, None
        texts = (row[src.text_key] for row in split)
    else:
        total = len(split)
        if num_shards > max(total, 1):
            raise GptflowError(
                f"{src.path}: split {src.split!r} has {total} rows, fewer than its {num_shards} "
                f"shards; lower shards to at most {total}"
            )
        bounds = shard_bounds(total, num_shards)
        start, stop = bounds[shard], bounds[shard + 1]
        texts = _column_slices(split.select_columns([src.text_key]), src.text_key, start, stop)
    stats = _write_documents(texts, start, out, src.text_key)
    return {
        **src.settings(),
        "fingerprint": getattr(split, "_fingerprint", None),
        "datasets_version": datasets.__version__,
        "rows": [start, start + stats.pop("rows")],
        "split_rows": total,
        **stats,
    }


def _column_slices(split, key: str, start: int, stop: int):
    """The texts of rows [start, stop), read a slice of the Arrow table at a time."""
    for lo in range(start, stop, BATCH_ROWS):
        yield from split[lo : min(lo + BATCH_ROWS, stop)][key]


def _write_documents(texts, start: int, out: str | os.PathLike, key: str) -> dict:
    dropped = {"empty": 0, "missing": 0}
    documents = text_bytes = rows = 0
    with atomic_write(out, "w") as f:
        for i, text in enumerate(texts, start):
            rows += 1
            if text is None:
                dropped["missing"] += 1
                continue
            if not isinstance(text, str):
                raise GptflowError(
                    f"row {i}: column {key!r} holds {type(text).__name__}, not text; set "
                    f"text_key to the column holding the document text"
                )
            if blank(text):
                dropped["empty"] += 1
                continue
            f.write(json.dumps({"text": text, "row": i}, ensure_ascii=False))
            f.write("\n")
            documents += 1
            text_bytes += len(text.encode())
    return {
        "rows": rows,
        "documents": documents,
        "bytes": text_bytes,
        "dropped": {k: v for k, v in dropped.items() if v},
    }
