"""``model.init_from``: training starts from a Hugging Face GPT-NeoX checkpoint directory
(continued pretraining), e.g. EleutherAI/pythia-160m downloaded to disk, or a gptflow export.

What is read: a directory as transformers' ``save_pretrained`` or ``gptflow export-hf`` writes
it -- ``config.json``, the weights as safetensors (``model.safetensors``, or the shards
``model.safetensors.index.json`` names) and the tokenizer (``tokenizer.json``, or GPT-2's
``vocab.json`` + ``merges.txt`` read as ``tokenizer.source: gpt2`` reads them). Pickled weights
(``pytorch_model.bin``, ``*.pt``, ...) are refused: unpickling runs whatever code the file holds.

Checked when planned (``snakemake -n``; no weight is read and torch is not imported):

- the directory exists and holds safetensors weights (every shard its index names);
- config.json is a ``GPTNeoXForCausalLM`` whose architecture equals the run's model, key by key
  (:func:`architecture_differences`);
- its embedding has the run's rows: the checkpoint's tokenizer padded to a multiple of
  ``model.make_vocab_size_divisible_by`` gives config.json's ``vocab_size``. Otherwise it is
  refused with the value that does: rows past the tokenizer's ids are never a target, but the
  output head's take part in every softmax, so dropping or adding any would change the model;
- its tokenizer is the run's (:func:`gptflow.data.tokenizer.tokenizer_difference`), when the
  run's tokenizer exists already (``tokenizer.path``, or made by an earlier run).

When run.yaml is rendered all of that again (the run's tokenizer then exists), every parameter
of the model is found in the safetensors headers with its shape and a floating-point dtype, and
the weights' identity is recorded (:func:`identity`): the series fingerprint holds it, so other
weights at the same path are a new series, not a silent resume.

Loaded by :class:`HFWeights`, the :data:`gptflow.train.model.Initializer` that
``gptflow.train.engine.build_model`` calls for each parameter a rank holds, at step 0 only: a run
with a checkpoint resumes from it and does not read the directory.

Over 500 lines (just): the planning checks of a checkpoint directory and its loader share
the directory's reading (config.json, the safetensors headers).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptflow.config.settings import ModelConfig, padded_vocab_size
from gptflow.errors import GptflowError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a file's JSON header
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the float dtypes
DIGEST_CACHE = "init-from-digests.json"  # in the run directory: sha256 by (size, mtime)


@dataclass(frozen=True)
class InitFromInfo:
    """``model.init_from`` as run.yaml records it: the Hugging Face checkpoint directory the
    run starts from (gptflow.train.init_from), the identity of its weights (sha256 over its
    safetensors files' sha256s; the series fingerprint holds it) and each file as hashed
    ({name: {bytes, mtime_ns, sha256}}: the trainer checks the files are still those)."""

    path: str
    sha256: str
    files: dict


# keys of the workflow config's `model:` that choose the model rather than describe it


def where(path: str | os.PathLike) -> str:
    return f"model.init_from '{path}'"


# --------------------------------------------------------------------------- the directory


def hf_directory(path: str | os.PathLike) -> Path:
    d = Path(path)
    if not d.is_dir():
        what = "is not a directory" if d.exists() else "does not exist"
        raise GptflowError(
            f"{where(path)} {what} (relative to {Path.cwd()}); give the directory of a Hugging "
            f"Face GPT-NeoX checkpoint (config.json, *.safetensors, tokenizer.json)"
        )
    return d


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GptflowError(f"{what}: no {path.name} in {path.parent}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise GptflowError(f"{what}: {path.name} is not JSON ({e})") from None


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of the checkpoint: the shards its index names, or
    model.safetensors. Pickled weights are refused, saying why."""
    d = Path(path)
    if (d / INDEX).is_file():
        weight_map = read_json(d / INDEX, where(path)).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise GptflowError(f"{where(path)}: {INDEX} has no weight_map; not a checkpoint index")
        names = sorted(set(weight_map.values()))
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                raise GptflowError(
                    f"{where(path)}: {INDEX} names {name!r}, not a file name in the directory"
                )
            if not name.endswith(".safetensors"):
                raise GptflowError(
                    f"{where(path)}: {INDEX} names {name!r}; gptflow reads safetensors only"
                )
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise GptflowError(
                f"{where(path)}: {INDEX} names {missing[0]}, which is not in the directory "
                f"({len(missing)} of its {len(names)} files missing); finish the download"
            )
        return [d / n for n in names]
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    pickles = sorted(f.name for f in d.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise GptflowError(
            f"{where(path)} holds pickled weights only ({', '.join(pickles[:3])}), and gptflow "
            f"reads safetensors only: unpickling a file runs whatever code it holds. Download the "
            f"checkpoint's model.safetensors, or convert it once where running its code is safe "
            f"(transformers: from_pretrained(dir).save_pretrained(dir) writes safetensors)"
        )
    raise GptflowError(
        f"{where(path)} has no {SINGLE} nor {INDEX}; give a directory saved by transformers' "
        f"save_pretrained or gptflow export-hf"
    )


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensors by name (dtype, shape, data_offsets), from its header
    alone: an 8-byte little-endian length, then that much JSON."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise GptflowError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise GptflowError(f"{path}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise GptflowError(f"{path}: not a safetensors file (its header is not a mapping)")
    header.pop("__metadata__", None)
    return header


def tensor_index(path: str | os.PathLike, files: list[Path]) -> dict[str, tuple[Path, dict]]:
    """Every tensor of the checkpoint: name -> (its file, its header entry)."""
    index: dict[str, tuple[Path, dict]] = {}
    for f in files:
        for name, entry in read_header(f).items():
            if name in index:
                raise GptflowError(
                    f"{where(path)}: tensor {name} is in both {index[name][0].name} and {f.name}"
                )
            index[name] = (f, entry)
    return index


# --------------------------------------------------------------------------- architecture


def _rope(hf: dict, key: str, legacy: str, default: float) -> tuple[str, Any]:
    """A rotary setting: transformers 5's rope_parameters, else 4.x's key, else its default."""
    rope = hf.get("rope_parameters") or {}
    if key in rope:
        return f"rope_parameters.{key}", rope[key]
    if legacy in hf:
        return legacy, hf[legacy]
    if key == "rope_theta" and "rope_theta" in hf:
        return "rope_theta", hf["rope_theta"]
    return legacy, default


def architecture_differences(hf: dict, model: ModelConfig) -> list[str]:
    """Each model key whose value config.json does not have (Hugging Face's defaults for
    absent keys, as transformers reads them), as 'HF_KEY VALUE in config.json, model.KEY VALUE'."""
    out = []
    for hf_key, key in (
        ("hidden_size", "hidden_size"),
        ("num_hidden_layers", "num_layers"),
        ("num_attention_heads", "num_attention_heads"),
        ("intermediate_size", "intermediate_size"),
    ):
        want = model.ffn_size if key == "intermediate_size" else getattr(model, key)
        if hf.get(hf_key) != want:
            shown = getattr(model, key)
            if shown is None:  # intermediate_size null
                shown = f"null (4 x hidden_size = {want})"
            out.append(f"{hf_key} {hf.get(hf_key)} in config.json, model.{key} {shown}")
    pct_key, pct = _rope(hf, "partial_rotary_factor", "rotary_pct", 0.25)
    base_key, base = _rope(hf, "rope_theta", "rotary_emb_base", 10000.0)
    for hf_key, value, key in (
        (pct_key, pct, "rotary_pct"),
        (base_key, base, "rotary_emb_base"),
        ("use_parallel_residual", hf.get("use_parallel_residual", True), "parallel_residual"),
        ("layer_norm_eps", hf.get("layer_norm_eps", 1e-5), "layer_norm_eps"),
        ("max_position_embeddings", hf.get("max_position_embeddings", 2048),
         "max_position_embeddings"),
    ):  # fmt: skip
        if value != getattr(model, key):
            out.append(f"{hf_key} {value} in config.json, model.{key} {getattr(model, key)}")
    return out


def unsupported(hf: dict) -> list[str]:
    """What config.json asks for that gptflow's GPT-NeoX does not compute (it has no key for
    it), as 'HF_KEY VALUE (gptflow: VALUE)'."""
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    out = []
    for key, value, ours in (
        ("architectures", hf.get("architectures") or ["GPTNeoXForCausalLM"], "GPTNeoXForCausalLM"),
        ("model_type", hf.get("model_type", "gpt_neox"), "gpt_neox"),
        ("hidden_act", hf.get("hidden_act", "gelu"), "gelu"),  # exact (erf) GELU
        ("attention_bias", hf.get("attention_bias", True), True),
        ("tie_word_embeddings", hf.get("tie_word_embeddings", False), False),
        ("rope_parameters.rope_type", rope_type, "default"),
        ("rope_scaling", hf.get("rope_scaling"), None),
    ):
        if (ours not in value) if key == "architectures" else (value != ours):
            out.append(f"{key} {value!r} (gptflow: {ours!r})")
    return out


def check_architecture(path: str | os.PathLike, hf: dict, model: ModelConfig) -> None:
    other = unsupported(hf)
    if other:
        raise GptflowError(
            f"{where(path)}: its config.json asks for what gptflow's GPT-NeoX does not compute: "
            f"{'; '.join(other)}; it cannot be continued here"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(hf.get(key), int):
            raise GptflowError(
                f"{where(path)}: config.json has no {key} (an integer); not a GPT-NeoX config"
            )
    differences = architecture_differences(hf, model)
    if differences:
        raise GptflowError(
            f"{where(path)}: its config.json is not the run's model: {'; '.join(differences)}. "
            f"Set those model keys to the checkpoint's values (or pick the preset that has them)"
        )


# --------------------------------------------------------------------------- tokenizer, rows


def checkpoint_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer (``tokenizers.Tokenizer``): tokenizer.json, else GPT-2's
    vocab.json + merges.txt as gptflow reads them (``tokenizer.source: gpt2``)."""
    from gptflow.data.tokenizer import gpt2_bpe, load_tokenizer

    d = Path(path)
    if (d / "tokenizer.json").is_file():
        return load_tokenizer(d / "tokenizer.json")
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return gpt2_bpe(d / "vocab.json", d / "merges.txt")
    raise GptflowError(
        f"{where(path)} has no tokenizer.json (nor vocab.json + merges.txt): its embedding rows "
        f"are the ids of a tokenizer that cannot be checked against the run's. Save the "
        f"checkpoint's tokenizer there (transformers: AutoTokenizer.from_pretrained(...)"
        f".save_pretrained(dir))"
    )


def check_tokenizer(path: str | os.PathLike, run_tokenizer: str | os.PathLike) -> None:
    """The checkpoint's tokenizer is the run's (same ids for every text, same special tokens)."""
    from gptflow.data.tokenizer import load_tokenizer, tokenizer_difference

    theirs = checkpoint_tokenizer(path)
    difference = tokenizer_difference(
        theirs, load_tokenizer(run_tokenizer), ("the checkpoint's", "the run's")
    )
    if difference:
        own = Path(path) / "tokenizer.json"
        fix = (
            f"train with the checkpoint's: tokenizer.source file, tokenizer.path '{own}'"
            if own.is_file()
            else "train with the checkpoint's tokenizer"
        )
        raise GptflowError(
            f"{where(path)}: its tokenizer is not the run's ({run_tokenizer}): {difference}. "
            f"Its embedding rows are that tokenizer's ids; {fix}"
        )


def suggested_multiple(ids: int, rows: int) -> int:
    """A make_vocab_size_divisible_by that pads `ids` to `rows`: the largest power of two that
    does (Megatron's choices are powers of two), else `rows` itself."""
    p = 1 << (max(rows, 1).bit_length() - 1)
    while p > 1 and padded_vocab_size(ids, p) != rows:
        p >>= 1
    return p if padded_vocab_size(ids, p) == rows else rows


def check_rows(path: str | os.PathLike, hf: dict, ids: int, model: ModelConfig) -> None:
    """config.json's vocab_size (the embedding's rows) is what this run pads `ids` to."""
    rows, multiple = hf["vocab_size"], model.make_vocab_size_divisible_by
    ours = padded_vocab_size(ids, multiple)
    if rows < ids:
        raise GptflowError(
            f"{where(path)}: its embedding has {rows} rows (config.json vocab_size), fewer than "
            f"its tokenizer's {ids} ids; the checkpoint and its tokenizer do not belong together"
        )
    if rows != ours:
        raise GptflowError(
            f"{where(path)}: its embedding has {rows} rows (config.json vocab_size) and the run's "
            f"would have {ours} (the tokenizer's {ids} ids padded to a multiple of "
            f"model.make_vocab_size_divisible_by {multiple}); set "
            f"model.make_vocab_size_divisible_by {suggested_multiple(ids, rows)}, which pads them "
            f"to {rows} (the rows past the ids are kept as trained: the output head's take part "
            f"in every softmax)"
        )


# --------------------------------------------------------------------------- the checks


def check_planned(path: str | os.PathLike, model: ModelConfig) -> None:
    """What ``snakemake -n`` checks: directory, weights' format, architecture, rows. Reads
    config.json, the index and the tokenizer; no weight, no torch."""
    d = hf_directory(path)
    hf = read_json(d / CONFIG, where(path))
    if not isinstance(hf, dict):
        raise GptflowError(f"{where(path)}: config.json is not a mapping; not a model config")
    check_architecture(path, hf, model)
    weight_files(d)
    tok = checkpoint_tokenizer(d)
    check_rows(path, hf, tok.get_vocab_size(with_added_tokens=True), model)


def check_planned_tokenizer(cfg: dict, built: str | os.PathLike) -> None:
    """At -n, the checkpoint's tokenizer against the run's when that exists already:
    ``tokenizer.path`` (source file), else `built` (the workflow's tokenizer.json) made by an
    earlier run. Otherwise render_run_config checks it, before any training job."""
    tok = cfg["tokenizer"]
    run = Path(tok["path"] if tok["source"] == "file" else built)
    if cfg["model"].get("init_from") and run.is_file():
        check_tokenizer(cfg["model"]["init_from"], run)


def check_tensors(path: str | os.PathLike, model: ModelConfig) -> None:
    """Every parameter of `model` is in the safetensors headers with its shape, in a float
    dtype, once; nothing else is there but old checkpoints' buffers."""
    import torch

    from gptflow.train.model import HF_BUFFER_SUFFIXES, GPTNeoX, checkpoint_names

    index = tensor_index(path, weight_files(path))
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in GPTNeoX(model).named_parameters()}
    seen = set()
    for name, shape in shapes.items():
        found = [n for n in checkpoint_names(name) if n in index]
        if not found:
            raise GptflowError(
                f"{where(path)} has no tensor {' or '.join(checkpoint_names(name))}; not a "
                f"GPTNeoXForCausalLM checkpoint (its files hold {len(index)} tensors)"
            )
        if len(found) > 1:
            raise GptflowError(f"{where(path)} holds both {' and '.join(found)}; keep one")
        file, entry = index[found[0]]
        if tuple(entry["shape"]) != shape:
            raise GptflowError(
                f"{where(path)}: {found[0]} in {file.name} has shape {tuple(entry['shape'])}, "
                f"the run's model {shape}; not a checkpoint of this architecture"
            )
        if entry["dtype"] not in FLOAT_DTYPES:
            raise GptflowError(
                f"{where(path)}: {found[0]} in {file.name} is {entry['dtype']}; weights must be "
                f"one of {list(FLOAT_DTYPES)} (a quantized checkpoint is not a starting point)"
            )
        seen.add(found[0])
    extra = sorted(n for n in index if n not in seen and not n.endswith(HF_BUFFER_SUFFIXES))
    if extra:
        raise GptflowError(
            f"{where(path)} holds tensors the run's model does not have: {', '.join(extra[:3])}"
            f"{f' (and {len(extra) - 3} more)' if len(extra) > 3 else ''}; not a checkpoint of "
            f"this architecture"
        )


# --------------------------------------------------------------------------- identity


def identity(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> InitFromInfo:
    """The weights' identity: sha256 over each safetensors file's name and content sha256.

    Nothing cheaper is sufficient: the checkpoints of one model at different steps (Pythia's
    154 revisions) have the same config.json, file sizes and headers. Each file is hashed once
    (~1.7 GB/s here, so a 12B model's 24 GB in ~15 s, when run.yaml is rendered, never while
    planning); the digests are kept in `cache_dir`/init-from-digests.json by (size, mtime), so
    a re-render for another hyperparameter hashes nothing. The sizes and mtimes are recorded,
    for the trainer's check that the files are those hashed (:func:`check_unchanged`)."""
    from gptflow.fsutil import sha256_file, write_json

    cache_path = Path(cache_dir) / DIGEST_CACHE if cache_dir is not None else None
    cache = {}
    if cache_path is not None and cache_path.is_file():
        with contextlib.suppress(ValueError, OSError):
            cache = json.loads(cache_path.read_text())
    files = {}
    for f in weight_files(path):
        st = f.stat()
        key = str(f.resolve())
        hit = cache.get(key, {})
        if hit.get("bytes") != st.st_size or hit.get("mtime_ns") != st.st_mtime_ns:
            hit = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(f)}
            cache[key] = hit
        files[f.name] = dict(hit)
    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(cache_path, cache)
    blob = json.dumps({name: r["sha256"] for name, r in files.items()}, sort_keys=True)
    return InitFromInfo(
        path=str(path), sha256=hashlib.sha256(blob.encode()).hexdigest(), files=files
    )


def resolve(path: str, model: ModelConfig, tokenizer_path: str, run_dir: str) -> InitFromInfo:
    """Every check (the run's tokenizer and vocabulary are known now), then the identity that
    run.yaml records. Called when run.yaml is rendered."""
    check_planned(path, model)  # its rows: its tokenizer's ids padded as the run pads them
    check_tokenizer(path, tokenizer_path)  # the run's, so the run has those rows too
    check_tensors(path, model)
    return identity(path, run_dir)


def input_files(path: str | os.PathLike) -> list[str]:
    """The files render_run_config reads (Snakemake re-renders when one changes)."""
    d = Path(path)
    names = [CONFIG, INDEX, "tokenizer.json", "vocab.json", "merges.txt"]
    files = [str(d / n) for n in names if (d / n).is_file()]
    with contextlib.suppress(GptflowError, OSError):
        files += [str(f) for f in weight_files(d)]
    return files


def check_unchanged(info: InitFromInfo) -> None:
    """The weight files are those hashed when run.yaml was rendered (size and mtime)."""
    for name, record in info.files.items():
        f = Path(info.path) / name
        try:
            st = f.stat()
        except FileNotFoundError:
            raise GptflowError(
                f"{where(info.path)}: {name} is gone since run.yaml was rendered; restore it, "
                f"or render the run again"
            ) from None
        if (st.st_size, st.st_mtime_ns) != (record["bytes"], record["mtime_ns"]):
            raise GptflowError(
                f"{where(info.path)}: {name} changed since run.yaml was rendered (its size or "
                f"mtime differ), so the series named for its content may not hold it; render the "
                f"run again (the workflow does: the file is an input of render_run_config)"
            )


# --------------------------------------------------------------------------- loading


class HFWeights:
    """The :data:`gptflow.train.model.Initializer` of ``model.init_from``: each parameter read whole
    from the safetensors file holding it when asked (``safe_open``: memory-mapped, one tensor
    at a time), converted to fp32 (half-precision checkpoints included: training keeps fp32
    master weights), checked against the shape asked for. A rank asks only for the parameters
    it holds (its pipeline stage) and keeps its tensor-parallel slice; under ZeRO-3, rank 0
    reads each module's, gathered, and DeepSpeed partitions them. Use it as a context manager
    (the files are closed on exit)."""

    def __init__(self, info: InitFromInfo) -> None:
        check_unchanged(info)
        self.path = info.path
        self.index = {name: file for name, (file, _) in tensor_index(
            info.path, [Path(info.path) / n for n in info.files]
        ).items()}  # fmt: skip
        self.dtypes: set[str] = set()
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> HFWeights:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._open.clear()

    def __call__(self, name: str, shape: tuple[int, ...]):
        from safetensors import safe_open

        from gptflow.train.model import checkpoint_names

        stored = next((n for n in checkpoint_names(name) if n in self.index), None)
        if stored is None:
            raise GptflowError(f"{where(self.path)} has no tensor {name}; render the run again")
        file = self.index[stored]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        t = self._open[file].get_tensor(stored)
        if tuple(t.shape) != tuple(shape):
            raise GptflowError(
                f"{where(self.path)}: {stored} has shape {tuple(t.shape)}, the model's "
                f"{tuple(shape)}; render the run again"
            )
        self.dtypes.add(str(t.dtype).removeprefix("torch."))
        return t.float()
