"""What the rules of several stages share: input functions and path helpers
(get_<thing>(wildcards) looks up a job's values), and a config value they pass on alike. A
stage's own are in rules/<stage>_functions.smk, which its rules file includes first (snakemake
--lint wants rules and functions in separate files); what they compute lives in the package
(imported in setup.smk)."""

# tokenize.on_bad_document, which every job that reads documents passes on (tokenize.smk,
# quality.smk): a bad document stops the job, or is skipped and counted
ON_BAD_DOCUMENT = PLAN.config["tokenize"]["on_bad_document"]


def verbatim(value):
    """`value` as a params (or input) item that Snakemake does not format: it reads "{...}" in
    a string (or a list's strings) as a wildcard, and config text (a special token, a prompt,
    a path) may hold braces; such a value is given as a function. A value without braces is
    given as it is: the same value, without a function call per job at every plan."""
    words = value if isinstance(value, list) else [value]
    if any(isinstance(w, str) and ("{" in w or "}" in w) for w in words):
        return lambda wildcards: value
    return value


def dataset_shards(dataset, variant=None):
    """(token prefixes of a dataset in order, count files still to be made): one per input
    (or imported shard); with tokenize.documents_per_shard one per part of each input, known
    once checkpoint count_documents has counted it. An input not counted yet is returned as its
    count file, not raised: all counts are planned at once, not one per DAG update. A
    `variant` other than the base config's (a data ablation's run) has its own shards."""
    shards = PLAN.datasets[dataset].shards
    if variant is not None and variant != PLAN.base_variants[dataset]:
        return [paths.variant_prefix(PLAN.tokenizer, dataset, variant, s.name) for s in shards], []
    if not PLAN.config["tokenize"]["documents_per_shard"] or dataset in PLAN.imported:
        return [paths.shard_prefix(PLAN.tokenizer, dataset, s.name) for s in shards], []
    prefixes, pending = [], []
    for s in shards:
        try:
            counted = checkpoints.count_documents.get(dataset=dataset, shard=s.name).output[0]
        except IncompleteCheckpointException as e:
            pending.append(e.targetfile)
            continue
        parts = sources.counted_parts(counted, PLAN.config["tokenize"]["documents_per_shard"])
        prefixes += [paths.part_prefix(PLAN.tokenizer, dataset, s.name, p) for p in range(parts)]
    return prefixes, pending


def dataset_files(dataset, variant=None):
    """What a job reading a dataset's shards takes as input (pending count files included)."""
    prefixes, pending = dataset_shards(dataset, variant)
    return [f for p in prefixes for f in paths.shard_files(p)] + pending


def job_run(wildcards):
    """The run a job serves: its {run}, or a run reading its data index {index}."""
    return wildcards.run if "run" in wildcards.keys() else PLAN.index_run[wildcards.index]


def dataset_manifests(dataset, variant=None):
    """Each shard's manifest of a dataset (gptflow.paths.shard_manifest; pending count files
    included): what a job reading the shards takes as input, N files instead of 3N; the .bin
    and .idx come with it (the manifest is written last and holds their sha256)."""
    prefixes, pending = dataset_shards(dataset, variant)
    return [paths.shard_manifest(p) for p in prefixes] + pending


def get_blend_manifests(wildcards):
    """The manifests of the shards a run trains on (its recipe's) and, in a data ablation, of
    the base's it is evaluated on: the inputs of render_run_config and build_data_index."""
    run = job_run(wildcards)
    files = [
        f for name in PLAN.blended for f in dataset_manifests(name, PLAN.run_variants[run][name])
    ]
    if PLAN.run_variants[run] != PLAN.base_variants:
        files += [f for name in PLAN.blended for f in dataset_manifests(name)]
    return files


def get_local_gpus(wildcards):
    """A GPU job's `gpu` resource on this machine: all its GPUs (PLAN.local_gpus, setup.smk);
    none declared on a cluster or without a GPU."""
    return PLAN.local_gpus or None


def container_image_file(wildcards=None):
    return paths.IMAGE.format(hash=container_hash(), format=PLAN.container_config["format"])


def get_final_outputs():
    outputs = [paths.DONE, paths.EVAL, paths.HF_EXPORT, paths.REPORT_CARD]
    # eval.harness: a study's runs too
    outputs += [paths.HARNESS, paths.HARNESS_PAGE] if PLAN.harness["tasks"] else []
    return expand(outputs, run=PLAN.runs) + get_study_outputs() + get_quality_page()


def get_autotune_outputs():
    """`snakemake autotune`: the run's ranking, page and best.yaml (a config without autotune:
    nothing, said at -n by the rule's empty input)."""
    if not PLAN.candidates:
        return []
    return expand([paths.AUTOTUNE_JSON, paths.AUTOTUNE_PAGE, paths.AUTOTUNE_BEST],
                  run=PLAN.config["run"])  # fmt: skip


def get_quality_page():
    """The report's "Data quality" page (rule report_data_quality), which every target that
    runs a data.quality recipe makes (all, data, train, study); nothing without a recipe."""
    return [paths.QUALITY_PAGE] if PLAN.quality_step else []


def get_study_outputs():
    """The study's comparison (rule study_report), or nothing without a study."""
    return [STUDY_PAGE.format(study=PLAN.study)] if PLAN.study else []
