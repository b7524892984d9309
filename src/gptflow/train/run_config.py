"""The run config (``results/runs/{run}/run.yaml``): the resolved, self-contained input of
``gptflow train`` -- model with the preset applied, tokenizer facts, shard prefixes with their
checksums, hyperparameters. :func:`render_run_config` makes it from a validated workflow
config; :class:`RunConfig` reads it back, with the paths of what a run writes and the
fingerprint that names its checkpoint series.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gptflow import paths
from gptflow.config.schema import load_yaml
from gptflow.config.settings import (
    ModelConfig,
    TrainConfig,
    architecture,
    check_context,
    padded_vocab_size,
    training_flops_per_token,
)
from gptflow.data.tokenizer import TokenizerInfo
from gptflow.errors import GptflowError
from gptflow.train.init_from import InitFromInfo


@dataclass(frozen=True)
class ShardInfo:
    prefix: str
    idx_sha256: str
    bin_sha256: str
    documents: int
    tokens: int


@dataclass(frozen=True)
class DatasetBlend:
    name: str
    weight: float
    shards: tuple[ShardInfo, ...]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


@dataclass(frozen=True)
class RunConfig:
    """The resolved input of ``gptflow train`` (``results/runs/{run}/run.yaml``)."""

    run: str
    run_dir: str
    tokenizer: TokenizerInfo
    datasets: tuple[DatasetBlend, ...]
    split: str
    model: ModelConfig
    train: TrainConfig
    init_from: InitFromInfo | None = None  # model.init_from: the weights of step 0
    # the shared data index's summary (gptflow.paths.DATA_INDEX); "" in a run.yaml from
    # before shared indices: the run directory's data-index/
    data_index: str = ""
    study: str = ""  # the study (workflow config `study`) the run is one of, else ""
    extra: dict = field(default_factory=dict, compare=False)
    # a data ablation's run: the base's shards, whose validation and test splits it is
    # evaluated on (the same text for every run of the study); () = its own datasets'
    heldout: tuple[DatasetBlend, ...] = ()
    # a data ablation's run: where the train split of each dataset cleaned otherwise than the
    # base's ends, its sequences [0, end): its documents from before the base's held-out ones
    # (gptflow.data.dataset.heldout_train_ends); {} = each dataset's share of data.split
    train_ends: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_context(self.model, self.train)
        if self.model.vocab_size < self.tokenizer.vocab_size:
            raise GptflowError(
                f"model vocab {self.model.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size} ids; re-render the run config"
            )

    # paths inside the run directory (gptflow.paths) -------------------------------------
    @property
    def run_yaml_path(self) -> Path:
        return paths.in_run_dir(paths.RUN_YAML, self.run_dir)

    @property
    def checkpoint_root(self) -> Path:
        return paths.in_run_dir(paths.CHECKPOINTS, self.run_dir)

    @property
    def checkpoint_dir(self) -> Path:
        """Checkpoints of this configuration: one series per trajectory fingerprint."""
        return self.checkpoint_root / self.series

    @property
    def metrics_path(self) -> Path:
        return paths.in_run_dir(paths.METRICS, self.run_dir)

    @property
    def done_path(self) -> Path:
        return paths.in_run_dir(paths.DONE, self.run_dir)

    @property
    def lock_path(self) -> Path:
        return paths.in_run_dir(paths.TRAIN_LOCK, self.run_dir)

    @property
    def index_cache_dir(self) -> Path:
        if self.data_index:
            return Path(self.data_index).with_suffix("")
        return paths.in_run_dir(paths.RUN_DATA_INDEX_DIR, self.run_dir)

    @property
    def train_log_path(self) -> Path:
        return paths.in_run_dir(paths.TRAIN_LOG, self.run_dir)

    @property
    def tensorboard_dir(self) -> Path:
        return paths.in_run_dir(paths.TENSORBOARD_DIR, self.run_dir)

    @property
    def wandb_dir(self) -> Path:
        """W&B's own files (wandb.init's dir is the run directory) and each series' W&B run id."""
        return paths.in_run_dir(paths.WANDB_DIR, self.run_dir)

    # identity -------------------------------------------------------------------
    def fingerprint(self) -> dict:
        """Everything that determines the training trajectory, and nothing that does not.

        Two configs with the same fingerprint produce the same sequence of parameters step
        by step, so their checkpoints are interchangeable: one resumes the other. Logging,
        evaluation and checkpoint intervals, ``train_iters`` (when the decay length is fixed
        by ``lr_decay_iters``) and the micro-batch size are not part of it.
        """
        t = self.train
        model = dataclasses.asdict(self.model)
        for k in ("description", "activation_checkpointing", "max_position_embeddings"):
            model.pop(k)
        # the starting weights by content (not by path); absent for a random start, so the
        # series of runs from before model.init_from existed keep their names
        init = {"init_from": self.init_from.sha256} if self.init_from else {}
        # K-FAC changes every update; absent when off, so earlier series keep their names
        kfac = {"kfac": dataclasses.asdict(t.kfac)} if t.kfac else {}
        # the optimizer, and Muon's settings; absent for AdamW, so earlier series keep names
        muon = {"muon": dataclasses.asdict(t.muon)} if t.optimizer == "muon" else {}
        # a data ablation's train split cut by document; absent otherwise
        ends = {"train_ends": dict(sorted(self.train_ends.items()))} if self.train_ends else {}
        return {
            **init,
            **kfac,
            **muon,
            **ends,
            "model": model,
            "tokenizer_sha256": self.tokenizer.sha256,
            "eod_id": self.tokenizer.eod_id,
            "data": [
                {"name": d.name, "weight": d.weight, "shards": [s.bin_sha256 for s in d.shards]}
                for d in self.datasets
            ],
            "split": self.split,
            "seed": t.seed,
            "seq_length": t.seq_length,
            "global_batch_size": t.global_batch_size,
            "optimizer": {
                "lr": t.lr,
                "min_lr": t.min_lr,
                "warmup": t.lr_warmup_iters,
                "decay_iters": t.decay_iters,
                "decay_style": t.lr_decay_style,
                "weight_decay": t.weight_decay,
                "betas": [t.adam_beta1, t.adam_beta2],
                "eps": t.adam_eps,
                "clip_grad": t.clip_grad,
                "precision": t.precision,
            },
        }

    @property
    def series(self) -> str:
        blob = json.dumps(self.fingerprint(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    # (de)serialisation ----------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "run": self.run,
            "run_dir": self.run_dir,
            "tokenizer": dataclasses.asdict(self.tokenizer),
            "data": {
                "split": self.split,
                "datasets": [_blend_dict(d) for d in self.datasets],
                **({"heldout": [_blend_dict(d) for d in self.heldout]} if self.heldout else {}),
                **({"train_ends": dict(self.train_ends)} if self.train_ends else {}),
            },
            "model": dataclasses.asdict(self.model),
            **({"init_from": dataclasses.asdict(self.init_from)} if self.init_from else {}),
            "train": dataclasses.asdict(self.train),
            **({"data_index": self.data_index} if self.data_index else {}),
            **({"study": self.study} if self.study else {}),
            **({"derived": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "run.yaml") -> RunConfig:
        try:
            return cls(
                run=d["run"],
                run_dir=d["run_dir"],
                tokenizer=TokenizerInfo(**d["tokenizer"]),
                datasets=tuple(_read_blend(b) for b in d["data"]["datasets"]),
                heldout=tuple(_read_blend(b) for b in d["data"].get("heldout", [])),
                train_ends={k: int(v) for k, v in d["data"].get("train_ends", {}).items()},
                split=d["data"]["split"],
                model=ModelConfig(**d["model"]),
                train=TrainConfig(**d["train"]),
                init_from=InitFromInfo(**d["init_from"]) if d.get("init_from") else None,
                data_index=d.get("data_index", ""),
                study=d.get("study", ""),
                extra=d.get("derived", {}),
            )
        except (KeyError, TypeError) as e:
            raise GptflowError(
                f"{source}: not a gptflow run config ({e}); re-create it with the workflow "
                f"(rule render_run_config)"
            ) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunConfig:
        data = load_yaml(path)
        if not isinstance(data, dict):
            raise GptflowError(f"{path}: not a gptflow run config (expected a mapping)")
        return cls.from_dict(data, source=str(path))


def data_index_settings(
    cfg: dict,
    variants: dict[str, str] | None = None,
    heldout: dict[str, str] | None = None,
    train: TrainConfig | None = None,
) -> dict:
    """What a run's data index depends on, from its validated workflow config: the tokenizer,
    the blend, the split, the sequence length, the seed and the samples each split gives
    (gptflow.data.dataset.split_samples). Runs with the same settings read the same samples of
    the same shards (the shards' content is the index job's input files), so a study's runs
    that differ in model or learning rate share one index. A data ablation's run trains on
    the shards of its own recipe (`variants`, dataset -> gptflow.data.quality.recipe.variant)
    and is validated on the base's (`heldout`): where the two differ they are part of the
    settings (and so of the index's name); where they agree, the settings are as before.
    `train`: the run's settings made already (a plan's), else made from `cfg`."""
    from gptflow.data.dataset import split_samples

    train = train if train is not None else TrainConfig(**cfg["train"])
    ablation = {"variants": variants, "heldout": heldout} if variants != heldout else {}
    return {
        "tokenizer": cfg["tokenizer"]["name"],
        "blend": [{"dataset": b["dataset"], "weight": b["weight"]} for b in cfg["data"]["blend"]],
        "split": cfg["data"]["split"],
        "seq_length": train.seq_length,
        "seed": train.seed,
        "samples": split_samples(train),
        **ablation,
    }


def data_index_name(settings: dict) -> str:
    """The {index} of gptflow.paths.DATA_INDEX: a hash of :func:`data_index_settings`."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def build_data_index(
    settings: dict,
    shards: dict[str, list[str]],
    out: str,
    heldout: dict | None = None,
    origins: dict | None = None,
) -> dict:
    """Build every index of `settings` (:func:`data_index_settings`) over the shard prefixes
    `shards` (dataset -> prefixes; the validation and test splits over `heldout`'s when given:
    a data ablation's base shards, the train split of each dataset in `origins` cut before
    their held-out documents: gptflow.data.dataset.heldout_train_ends) into out's directory
    (out without ``.json``), as the trainer reads them (gptflow.data.dataset.build_split_datasets,
    keyed by content); returns the summary the build_data_index rule writes to `out`."""
    import time

    from gptflow.data.dataset import build_split_datasets, heldout_train_ends
    from gptflow.data.shards import read_manifest

    def blend_of(prefixes_of: dict[str, list[str]]) -> list[tuple]:
        blend = []
        for item in settings["blend"]:
            prefixes = prefixes_of[item["dataset"]]
            shas = [read_manifest(p)["idx_sha256"] for p in prefixes]
            blend.append((item["dataset"], float(item["weight"]), prefixes, shas))
        return blend

    cache = Path(out).with_suffix("")
    t0 = time.perf_counter()
    ends = heldout_train_ends(settings["split"], shards, heldout, origins) if origins else {}
    data = build_split_datasets(
        blend_of(shards), settings["split"], settings["samples"], settings["seq_length"],
        settings["seed"], cache, heldout=blend_of(heldout) if heldout else None,
        train_ends=ends,
    )  # fmt: skip
    return {
        "settings": settings,
        **({"train_ends": ends} if ends else {}),
        "cache_dir": str(cache),
        "samples": {name: len(ds) for name, ds in data.items() if ds is not None},
        "files": sorted(p.name for p in cache.glob("*.npy")),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _blend_dict(d: DatasetBlend) -> dict:
    return {"name": d.name, "weight": d.weight, "shards": [dataclasses.asdict(s) for s in d.shards]}


def _read_blend(b: dict) -> DatasetBlend:
    return DatasetBlend(
        name=b["name"], weight=float(b["weight"]), shards=tuple(ShardInfo(**s) for s in b["shards"])
    )


def render_run_config(
    cfg: dict,
    *,
    tokenizer_path: str,
    shards: dict[str, list[str]],
    run_dir: str,
    data_index: str = "",
    heldout: dict[str, list[str]] | None = None,
    origins: dict | None = None,
) -> RunConfig:
    """The run config of a validated workflow config: model resolved, tokenizer and shards checked.

    `shards` maps each blended dataset to its shard prefixes; `heldout` (a data ablation's
    run) to the base's, whose validation and test splits evaluate it, and `origins` those of
    its datasets cleaned otherwise than the base's to their shards' document origins, whose
    train split ends before the base's held-out documents (gptflow.data.dataset.heldout_train_ends).
    Shards tokenized with another tokenizer than the run's are refused (their manifests record
    the tokenizer's sha256).
    """
    from gptflow.data.dataset import heldout_train_ends
    from gptflow.data.indexed import dtype_for_vocab
    from gptflow.data.tokenizer import tokenizer_info

    tok = tokenizer_info(tokenizer_path, cfg["tokenizer"]["eod_token"])
    blends = _blends(cfg, shards, tok, tokenizer_path)
    model_keys = architecture(cfg["model"])
    model_keys["vocab_size"] = padded_vocab_size(
        tok.vocab_size, model_keys["make_vocab_size_divisible_by"]
    )
    model = ModelConfig(**model_keys)
    train = TrainConfig(**cfg["train"])
    init_from = None
    if cfg["model"].get("init_from"):
        from gptflow.train.init_from import resolve

        init_from = resolve(cfg["model"]["init_from"], model, tokenizer_path, run_dir)
    data_tokens = sum(b.tokens for b in blends)
    total = train.train_iters * train.tokens_per_step
    derived = {
        "preset": cfg["model"]["preset"],
        "parameters": model.num_parameters(),
        "tokens_per_step": train.tokens_per_step,
        "total_tokens": total,
        "data_tokens": data_tokens,
        "epochs": round(total / data_tokens, 4) if data_tokens else None,
        "training_flops": training_flops_per_token(model, train) * total,
        "token_dtype": dtype_for_vocab(tok.vocab_size).name,
        **_quality_labels(cfg),
    }
    return RunConfig(
        run=cfg["run"],
        run_dir=run_dir,
        tokenizer=tok,
        datasets=blends,
        split=cfg["data"]["split"],
        model=model,
        train=train,
        init_from=init_from,
        data_index=data_index,
        study=cfg.get("study") or "",
        extra=derived,
        heldout=_blends(cfg, heldout, tok, tokenizer_path) if heldout else (),
        train_ends=heldout_train_ends(cfg["data"]["split"], shards, heldout, origins)
        if origins
        else {},
    )


def _quality_labels(cfg: dict) -> dict:
    """derived.data_quality: each blended dataset's recipe in a few words (the study report's
    data-ablation table), only with data.quality."""
    from gptflow.data.quality.recipe import label, recipes

    if not cfg["data"].get("quality"):
        return {}
    blended = [b["dataset"] for b in cfg["data"]["blend"]]
    steps = recipes(cfg, blended, "run config")
    return {"data_quality": {name: label(steps.get(name, ())) for name in blended}}


def _blends(
    cfg: dict, shards: dict[str, list[str]], tok: TokenizerInfo, tokenizer_path: str
) -> tuple[DatasetBlend, ...]:
    """The blend's datasets over `shards` (dataset -> prefixes), their manifests read."""
    from gptflow.data.shards import read_manifest

    blends = []
    for item in cfg["data"]["blend"]:
        name = item["dataset"]
        infos = []
        for prefix in shards[name]:
            m = read_manifest(prefix)
            if m["tokenizer"]["sha256"] != tok.sha256:
                raise GptflowError(
                    f"{prefix}.json: shard was tokenized with tokenizer {m['tokenizer']['path']} "
                    f"(sha256 {m['tokenizer']['sha256'][:12]}), but the run uses {tokenizer_path} "
                    f"(sha256 {tok.sha256[:12]}); delete the shard so the workflow re-tokenizes it"
                )
            infos.append(
                ShardInfo(
                    prefix=prefix,
                    idx_sha256=m["idx_sha256"],
                    bin_sha256=m["bin_sha256"],
                    documents=m["documents"],
                    tokens=m["tokens"],
                )
            )
        blends.append(DatasetBlend(name=name, weight=float(item["weight"]), shards=tuple(infos)))
    return tuple(blends)


def write_run_config(run: RunConfig, path: str | os.PathLike) -> None:
    from gptflow.fsutil import atomic_write

    with atomic_write(path) as f:
        f.write(f"# Resolved run config of '{run.run}' (written by the workflow; do not edit).\n")
        yaml.safe_dump(run.to_dict(), f, sort_keys=False, default_flow_style=False)
