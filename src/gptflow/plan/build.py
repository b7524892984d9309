"""The plan, built once (:func:`build_plan`): the merged config validated, every run's model and
train settings as the trainer's dataclasses, the datasets resolved, each recipe's cleaning
steps, the data indices, where training runs (the profile) and the preflight's figures -- in a
frozen :class:`Plan` that rules/setup.smk makes once per ``snakemake`` and every input
function reads. Every cross-field rule raises once, here, as one line (:class:`PlanError`,
prefixed with the stage it belongs to, as ``snakemake -n`` prints it); nothing here knows
Snakemake, so a plan is built and tested in-process.

Over 300 lines: the one place planning's stages meet, in the order ``-n`` reports them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gptflow import paths
from gptflow.config.schema import load_yaml
from gptflow.errors import GptflowError
from gptflow.kubernetes import manifests as kube_manifests
from gptflow.kubernetes import sizing as kube_sizing
from gptflow.plan import preflight, records
from gptflow.plan.placement import Placement
from gptflow.plan.profile import Profile, placement
from gptflow.plan.runs import RunPlan, run_plan
from gptflow.plan.workflow_config import load_workflow_config, run_configs


class PlanError(GptflowError):
    """A plan refused: the whole line ``snakemake -n`` prints (its stage's prefix included);
    `preflight`: the preflight's report when the refusal came after it (its lines are printed
    before the refusal, as a plan prints them)."""

    preflight = None


@contextlib.contextmanager
def stage(prefix: str) -> Iterator[None]:
    """Any GptflowError inside as a PlanError whose line starts with `prefix`."""
    try:
        yield
    except PlanError:
        raise
    except GptflowError as e:
        raise PlanError(f"{prefix}{e}") from None


@dataclass(frozen=True, eq=False)
class Plan:
    """What a workflow run will do, as built from its config, its profile and the repository.
    The mappings are the plan's own: read them, do not change them. `preflight`, `largest`
    and `warnings` are set by :func:`checked` as the plan is built (in the main process)."""

    repo: Path
    source: str  # the config files (or --config), as every message names them
    config: dict  # validated, defaults filled, the model preset resolved
    runs: dict[str, RunPlan]  # one without a study, the study's runs otherwise
    trials: dict[str, RunPlan]  # autotune's admitted candidates, each trained as a run ({})
    candidates: list  # autotune's search space (gptflow.plan.autotune.Candidate; [] without)
    harness_steps: dict[str, list[int]]  # each run's checkpoints eval.harness.every evaluates
    datasets: dict  # name -> gptflow.data.sources.Dataset
    quality: dict  # the base config's recipe: dataset -> its steps ({} when off)
    run_quality: dict  # each run's recipe (the base's own object where the run has none)
    base_variants: dict  # dataset -> its last step's name, or raw
    run_variants: dict
    quality_step: dict  # (dataset, step name) -> Step, of every recipe
    quality_key: dict  # (dataset, step key) -> Step
    signals_step: dict  # (dataset, signals name) -> its filters Step
    scores_step: dict  # (dataset, scores name) -> its language Step
    index_of: dict  # run -> the data index it reads (gptflow.paths.DATA_INDEX)
    indexes: dict  # index -> its settings
    index_run: dict  # index -> a run reading it
    profile: Profile
    placement: Placement
    preflight: preflight.Report | None = None  # made in the main process only
    largest: str = ""  # a study's largest run, whose preflight is printed in full
    warnings: list[str] = field(default_factory=list)  # printed at -n, not refusals

    # derived names the rules read -------------------------------------------------------
    @functools.cached_property
    def every_run(self) -> dict[str, RunPlan]:
        """What a {run} wildcard names: the runs and autotune's trials."""
        return {**self.runs, **self.trials}

    @property
    def autotune(self) -> dict | None:
        """The config's autotune section (None: no search)."""
        return self.config.get("autotune")

    @property
    def study(self) -> str | None:
        return self.config["run"] if self.config.get("study") is not None else None

    @property
    def tokenizer(self) -> str:
        return self.config["tokenizer"]["name"]

    @property
    def blended(self) -> list[str]:
        return [item["dataset"] for item in self.config["data"]["blend"]]

    @property
    def harness(self) -> dict:
        return self.config["eval"]["harness"]

    @property
    def container_config(self) -> dict:
        """The config's container section (not `container`: a Snakemake keyword in a rule)."""
        return self.config["container"]

    @functools.cached_property
    def imported(self) -> list[str]:
        """Datasets whose shards are imported (type megatron: import_megatron_shard)."""
        return [name for name, d in self.datasets.items() if d.kind == "megatron"]

    @functools.cached_property
    def tokenized(self) -> list[str]:
        """Datasets whose shards are tokenized here."""
        return [name for name in self.datasets if name not in self.imported]

    @functools.cached_property
    def collected(self) -> list[str]:
        """Local files, one document per file, collected into JSONL first."""
        return [name for name, d in self.datasets.items() if d.kind == "collect"]

    @functools.cached_property
    def hf_collected(self) -> list[str]:
        """Hugging Face datasets, whose row ranges are collected into JSONL first."""
        return [name for name, d in self.datasets.items() if d.kind == "hf"]

    @property
    def report_datasets(self) -> dict:
        """Where each blended dataset comes from, for the data card."""
        return {name: self.config["datasets"][name] for name in self.blended}

    @property
    def local_gpus(self) -> int:
        """The GPUs the jobs on this machine share (each GPU job takes all): those counted
        where training runs here without srun (gptflow.plan.profile.placement counts none
        elsewhere)."""
        return self.placement.gpus or 0

    # lazy: read only when a job needs them --------------------------------------------
    @functools.cached_property
    def harness_work(self) -> list:
        """eval.harness's tasks' work, counted from the task files once."""
        from gptflow.results import harness

        with stage(f"gptflow config: {self.source}: "):
            return harness.task_work(self.harness)

    @property
    def dockerfile(self) -> Path:
        path = Path(self.container_config["dockerfile"])
        return path if path.is_absolute() else self.repo / path

    @functools.cached_property
    def container_hash(self) -> str:
        """The recipe hash that names the image (read from the files, a few ms)."""
        from gptflow.container.image import recipe_hash

        c = self.container_config
        with stage("gptflow config: container: "):
            return recipe_hash(self.repo, self.dockerfile, c["base_image"], c["build_args"])

    @functools.cache  # noqa: B019 (a plan lives as long as its process)
    def tokenizer_remote(self, key: str):
        """tokenizer.url / .vocab / .merges to download (gptflow.data.remote_files.RemoteFile)."""
        from gptflow.data import remote_files

        with stage("gptflow config: "):
            return remote_files.tokenizer_remote_file(
                key, self.config["tokenizer"][key], self.source
            )


def build_plan(
    config: dict,
    *,
    repo: Path,
    profile: Profile,
    config_files: list[str],
    main_process: bool = True,
    visible_gpus: Callable[[], tuple[int | None, str]] | None = None,
    gpu_memory_mib: Callable[[], tuple[int | None, str]] | None = None,
    sinfo: Callable | None = None,
    accounts: Callable | None = None,
) -> Plan:
    """The plan of `config` (Snakemake's merged config) under `profile`, in `repo`; raises
    PlanError with the line ``-n`` prints. `main_process`: the preflight and the checks that
    only a plan needs (a job's own Snakemake parses the Snakefile again and skips them).
    `visible_gpus`, `gpu_memory_mib`, `sinfo`, `accounts`: how this machine's GPUs and the
    cluster are read (gptflow.hardware's, gptflow.plan.cluster's by default)."""
    from gptflow import hardware
    from gptflow.data import sources
    from gptflow.results import harness
    from gptflow.train import init_from
    from gptflow.train.run_config import data_index_name, data_index_settings

    source = " + ".join(config_files) or "--config"
    schema = repo / "config" / "schema" / "config.schema.yaml"
    with stage("gptflow config: "):
        cfg = load_workflow_config(config, schema_path=schema, models_dir=repo / "config" / "models",
                                   source=source, config_files=config_files)  # fmt: skip
    records.dump_config(cfg)  # `gptflow why`: its dry run asks for the config this plan uses

    tokenizer_json = Path(paths.tokenizer_json(cfg["tokenizer"]["name"]))
    with stage("gptflow config: "):
        runs = {name: run_plan(name, c, tokenizer_json) for name, c in run_configs(cfg).items()}
    where = placement(profile, visible_gpus or hardware.visible_gpus,
                      gpu_memory_mib or hardware.gpu_memory_mib)  # fmt: skip
    if kube_sizing.on_kubernetes(where):  # profiles/kubernetes: the config's nodes and GPUs
        where = kube_sizing.placement(where, cfg["kubernetes"])
    candidates, trials = search_space(cfg, runs, where, source)
    every = {**runs, **trials}  # the jobs' runs: a trial is trained as a run is
    harness_cfg, blended = cfg["eval"]["harness"], [b["dataset"] for b in cfg["data"]["blend"]]
    with stage("gptflow config: "):
        steps = {name: harness.check_steps(r.train, harness_cfg["every"], name, source)
                 if harness_cfg["tasks"] else [] for name, r in runs.items()}  # fmt: skip
    # resolved once, here (catalog, globs, URL templates): a glob matching nothing or an
    # unknown catalog entry stops the workflow before any job
    with stage("gptflow config: "):
        datasets = sources.resolve_datasets(cfg, sources.needed_datasets(cfg),
                                            catalog_path=repo / "config" / "datasets.yaml",
                                            schema=load_yaml(schema), source=source)  # fmt: skip
    imported = [name for name, d in datasets.items() if d.kind == "megatron"]

    quality = recipes(cfg, every, blended, imported, source)
    # the data index each run reads: runs reading the same samples of the same shards share one
    settings = {name: data_index_settings(r.config, quality["run_variants"][name],
                                          quality["base_variants"], r.train)
                for name, r in every.items()}  # fmt: skip
    index_of = {name: data_index_name(s) for name, s in settings.items()}
    # model.init_from's tokenizer against the run's, when the run's is on disk already
    with stage(f"gptflow config ({source}): "):
        for r in runs.values():
            init_from.check_planned_tokenizer(
                r.config, paths.tokenizer_json(cfg["tokenizer"]["name"])
            )

    plan = Plan(
        repo=repo, source=source, config=cfg, runs=runs, trials=trials,
        candidates=candidates, harness_steps=steps,
        datasets=datasets, **quality,
        index_of=index_of, indexes={index_of[name]: s for name, s in settings.items()},
        index_run={index: name for name, index in reversed(index_of.items())},
        profile=profile, placement=where,
    )  # fmt: skip
    if not main_process:
        return plan
    return checked(plan, sinfo=sinfo, accounts=accounts)


def search_space(cfg: dict, runs: dict[str, RunPlan], where: Placement, source: str):
    """autotune's candidates on `where` and its trials' runs ([] and {} without autotune)."""
    from gptflow.plan import autotune

    spec = cfg.get("autotune")
    if spec is None:
        return [], {}
    with stage("gptflow config: "):
        if cfg.get("study") is not None:
            raise GptflowError(
                f"{source}: autotune searches the layout of one run, and this config is a study "
                f"of {len(runs)}: search with the run's config without its study section (or a "
                f"study run's settings as the base), then add the best.yaml it writes to the study"
            )
        autotune.check_spec(spec, source)
    (run,) = runs.values()
    candidates, trials = autotune.search(run, where, spec)
    if not any(c.admitted for c in candidates):
        with stage(f"gptflow autotune ({source} and the profile): "):
            first = candidates[0]
            raise GptflowError(
                f"the preflight refuses all {len(candidates)} candidate(s) of autotune, e.g. "
                f"{first.name}: {first.refused}. Widen autotune's lists or change the run"
            )
    return candidates, trials


def recipes(cfg: dict, runs: dict[str, RunPlan], blended: list[str], imported: list[str],
            source: str) -> dict:  # fmt: skip
    """The plan's data.quality fields: each blended dataset's cleaning steps; a data ablation's
    study run its own (the base's object where it has none); equal recipes share their steps
    and shards. Every recipe's rules and languages are checked as the filters module takes
    them, each recipe's own (recipes differing only in thresholds share one signals entry)."""
    from gptflow.data.quality import recipe as quality_recipe
    from gptflow.data.quality import selection as quality_selection

    with stage("gptflow config: "):
        quality = quality_recipe.recipes(cfg, blended, source, imported=imported)
        run_quality = {
            name: quality if r.config["data"] is cfg["data"] else quality_recipe.recipes(
                r.config, blended, f"{source} (study run '{name}')", imported=imported)
            for name, r in runs.items()
        }  # fmt: skip
        quality_recipe.check_groups({"the base config": quality, **run_quality}, blended, source)
    steps = {(name, step.name): step for recipe in (quality, *run_quality.values())
             for name, steps in recipe.items() for step in steps}  # fmt: skip
    with stage("gptflow config: "):
        for name, recipe in (("", quality), *run_quality.items()):
            where = source if recipe is quality else f"{source} (study run '{name}')"
            for step in (step for steps in recipe.values() for step in steps):
                if step.kind == "filters":
                    quality_selection.check_rules(step.settings.get("rules"), step.where, where)
                elif step.kind == "language":
                    quality_selection.check_language(step.settings, step.where, where)
    return {
        "quality": quality,
        "run_quality": run_quality,
        "base_variants": quality_recipe.variants(quality, blended),
        "run_variants": {name: quality_recipe.variants(r, blended) for name, r in run_quality.items()},
        "quality_step": steps,
        "quality_key": {(name, step.key): step for (name, _), step in steps.items()},
        "signals_step": {(name, step.signals_name): step for (name, _), step in steps.items()
                         if step.kind == "filters"},
        "scores_step": {(name, step.scores_name): step for (name, _), step in steps.items()
                        if step.kind == "language"},
    }  # fmt: skip


def checked(plan: Plan, *, sinfo: Callable | None, accounts: Callable | None) -> Plan:
    """`plan` with its preflight (a study: every run's layout and memory, the largest run's in
    full), after the checks only a plan makes: the container section, eval.extra's files, the
    harness's tasks against each run's context, Hugging Face datasets' warnings. Sets the
    plan's `preflight`, `largest` and `warnings` (still being built: frozen once returned)."""
    from gptflow.plan.cluster import read_accounts, read_sinfo

    cfg, source, runs, p, profile = (
        plan.config,
        plan.source,
        plan.runs,
        plan.placement,
        plan.profile,
    )
    with stage(f"gptflow preflight ({source} and the profile): "):
        largest = max(runs, key=lambda name: runs[name].model.num_parameters())
        report = preflight.run(
            runs[largest], p,
            datasets=plan.datasets,
            tokenizer=plan.tokenizer,
            runtimes={
                "default-resources runtime": profile.value("all", "runtime"),
                "set-resources train_gpt runtime": profile.value("train_gpt", "runtime"),
            },
            config_threads=dict.fromkeys(("tokenize_shard", "tokenize_part"),
                                         cfg["tokenize"]["workers"]),
            profile_threads=dict(profile.threads),
            label=f" (largest run: {largest})" if plan.study else "",
            harness_work=plan.harness_work if plan.harness["tasks"] else None,
            sinfo=sinfo or read_sinfo,
            accounts=accounts or read_accounts,
        )  # fmt: skip
        if kube_sizing.on_kubernetes(p):  # the JobSet a train_gpt job submits
            report.lines.append(kube_manifests.summary(kube_sizing.plan_pod_set(plan, largest)))
        if plan.candidates:
            from gptflow.plan import autotune

            report.lines += autotune.plan_lines(
                plan.candidates, plan.autotune,
                {name for name in plan.trials if Path(paths.DONE.format(run=name)).is_file()},
            )  # fmt: skip
        if plan.study:
            report.lines += preflight.study(
                runs, p, indexes=len(plan.indexes),
                trained={name for name in runs if Path(paths.DONE.format(run=name)).is_file()},
            )  # fmt: skip
    object.__setattr__(plan, "preflight", report)
    object.__setattr__(plan, "largest", largest)
    try:
        after_preflight(plan)
    except PlanError as e:
        e.preflight = report
        raise
    return plan


def after_preflight(plan: Plan) -> None:
    """The container section, eval.extra's files and the harness's tasks, as a plan has them."""
    from gptflow.container.image import check_planned as check_container
    from gptflow.data import hf as hf_datasets
    from gptflow.data import sources
    from gptflow.results import harness

    cfg, source = plan.config, plan.source
    if plan.container_config["enabled"]:
        with stage(f"gptflow config: {source}: "):
            check_container(plan.container_config, plan.dockerfile, srun=bool(plan.placement.mpi))
        plan.container_hash  # noqa: B018 (the rest of the recipe, read once: the image's name)
    with stage("gptflow config: "):
        sources.check_eval_extra(cfg["eval"]["extra"], plan.datasets, plan.tokenizer,
                                 bool(cfg["tokenize"]["documents_per_shard"]), source)  # fmt: skip
        harness.check_planned(plan.harness, source)
        for name, r in plan.runs.items() if plan.harness["tasks"] else ():
            harness.check_context(plan.harness_work, r.train.seq_length, name, source)
        plan.warnings.extend(hf_datasets.check_planned(plan.datasets, source))
