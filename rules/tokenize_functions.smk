"""Input functions of the data stage's rules (rules/tokenize.smk, which includes this file): a
job's shard, its reader options, the files whose change reruns it, a dataset's shards, the
tokenizer's source."""


def shard_of(wildcards):
    """The job's shard; of a whole dataset (sample_documents) the first: they read alike. A
    dataset with data.quality steps is tokenized from their last step's documents: the base
    config's recipe's, or those of the job's {variant} (tokenize_variant_shard)."""
    dataset = PLAN.datasets[wildcards.dataset]
    if "shard" not in wildcards.keys():
        return dataset.shards[0]
    shard = dataset.shard(wildcards.shard)
    if "variant" in wildcards.keys():
        variant = wildcards.variant
    else:
        variant = PLAN.base_variants.get(wildcards.dataset, quality_recipe.RAW)
    if variant == quality_recipe.RAW:
        return shard
    return cleaned_shard(wildcards.dataset, shard, variant)


def get_data_shard_files(wildcards):
    """Every shard a run trains or is evaluated on: the base config's, then those of each
    other recipe of a data ablation (each once)."""
    wanted = dict.fromkeys([(name, PLAN.base_variants[name]) for name in PLAN.blended])
    wanted.update(dict.fromkeys(item for r in PLAN.run_variants.values() for item in r.items()))
    return [f for name, variant in wanted for f in dataset_files(name, variant)]


def get_shard_input(wildcards):
    return shard_of(wildcards).input


def get_format(wildcards):
    return shard_of(wildcards).fmt


def get_json_key(wildcards):
    return shard_of(wildcards).json_key


def get_member(wildcards):
    return shard_of(wildcards).member_args()


def get_member_format(wildcards):
    return shard_of(wildcards).member_format_args()


def get_sample_inputs(wildcards):
    return [s.input for s in PLAN.datasets[wildcards.dataset].shards]


def get_local_root(wildcards):
    return PLAN.datasets[wildcards.dataset].root


def get_local_shard_stamps(wildcards):
    return sources.file_stamps(shard_of(wildcards).files)


def get_hf_source(wildcards):
    """What collect_hf_documents reads: load_dataset's arguments and the text column."""
    return PLAN.datasets[wildcards.dataset].hf.settings()


def get_hf_shard_count(wildcards):
    return len(PLAN.datasets[wildcards.dataset].shards)


def get_hf_local_stamps(wildcards):
    """A local directory's files (sources.file_stamps): a changed file reruns the job."""
    directory = hf_datasets.local_directory(PLAN.datasets[wildcards.dataset].hf)
    if directory is None:
        return []  # a Hub dataset: its revision (in get_hf_source) pins it
    return sources.file_stamps(sorted(str(p) for p in directory.rglob("*") if p.is_file()))


def get_megatron_shard_files(wildcards):
    """The .bin and .idx a megatron shard is imported from (the user's files)."""
    return {ext: f"{shard_of(wildcards).input}.{ext}" for ext in ("bin", "idx")}


def get_document_range(wildcards, input):
    """tokenize_part's `--documents START:STOP --counts FILE` (whole shards: nothing)."""
    documents = sources.part_documents(
        int(wildcards.part), PLAN.config["tokenize"]["documents_per_shard"]
    )
    return ["--documents", documents, "--counts", input.counts]


def get_dataset_shard_prefixes(wildcards):
    return dataset_shards(wildcards.dataset)[0]


def get_dataset_shard_files(wildcards):
    return dataset_files(wildcards.dataset)


def get_merged_files(wildcards):
    """tokenize.merge's merged shards; not of imported datasets (a merge would copy them)."""
    names = (
        [d for d in PLAN.blended if d not in PLAN.imported]
        if PLAN.config["tokenize"]["merge"]
        else []
    )
    return [f for d in names for f in paths.shard_files(paths.merged_prefix(PLAN.tokenizer, d))]


def get_sample_mb(wildcards):
    """tokenizer.train.sample_mb, shared by the datasets it samples."""
    return PLAN.config["tokenizer"]["train"]["sample_mb"] / len(
        PLAN.config["tokenizer"]["train"]["datasets"]
    )


def get_tokenizer_file(wildcards):
    return (
        tokenizer_asset("url")
        if PLAN.config["tokenizer"]["source"] == "url"
        else PLAN.config["tokenizer"]["path"]
    )
