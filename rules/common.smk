"""Input functions and path helpers of the rules: get_<thing>(wildcards) looks up a job's
values; what they compute lives in the package (imported in setup.smk)."""


def verbatim(value):
    """`value` as a params (or input) function: Snakemake reads "{...}" in a params string as
    a wildcard, and config text (a special token, a prompt, a path) may hold braces."""
    return lambda wildcards: value


def shard_of(wildcards):
    """The job's shard; of a whole dataset (sample_documents) the first: they read alike."""
    dataset = DATASETS[wildcards.dataset]
    return dataset.shard(wildcards.shard) if "shard" in wildcards.keys() else dataset.shards[0]


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
    return [s.input for s in DATASETS[wildcards.dataset].shards]


def get_local_root(wildcards):
    return DATASETS[wildcards.dataset].root


def get_local_shard_stamps(wildcards):
    return sources.file_stamps(shard_of(wildcards).files)


def get_hf_source(wildcards):
    """What collect_hf_documents reads: load_dataset's arguments and the text column."""
    return DATASETS[wildcards.dataset].hf.settings()


def get_hf_shard_count(wildcards):
    return len(DATASETS[wildcards.dataset].shards)


def get_hf_local_stamps(wildcards):
    """A local directory's files (sources.file_stamps): a changed file reruns the job."""
    directory = hf_datasets.local_directory(DATASETS[wildcards.dataset].hf)
    if directory is None:
        return []  # a Hub dataset: its revision (in get_hf_source) pins it
    return sources.file_stamps(sorted(str(p) for p in directory.rglob("*") if p.is_file()))


def get_megatron_shard_files(wildcards):
    """The .bin and .idx a megatron shard is imported from (the user's files)."""
    return {ext: f"{shard_of(wildcards).input}.{ext}" for ext in ("bin", "idx")}


def get_remote_file(wildcards):
    """What a download job fetches: tokenizer file {key}, or file {file} of {dataset}."""
    if "key" in wildcards.keys():
        return tokenizer_remote(wildcards.key)
    remote = DATASETS[wildcards.dataset].remote_files.get(wildcards.file)
    if remote is None:
        raise WorkflowError(f"{wildcards.file} is not a file of dataset {wildcards.dataset}")
    return remote


def get_download_url(wildcards):
    return get_remote_file(wildcards).urls[0]


def get_download_mirrors(wildcards):
    return get_remote_file(wildcards).mirror_args()


def get_download_sha256(wildcards):
    return get_remote_file(wildcards).sha256_args()


def get_token_env(wildcards):
    return DATASETS[wildcards.dataset].token_env_args()


def get_token_origins(wildcards):
    return DATASETS[wildcards.dataset].token_origin_args()


def get_token_allow_http(wildcards):
    return DATASETS[wildcards.dataset].token_allow_http_args()


def dataset_shards(dataset):
    """(token prefixes of a dataset in order, count files still to be made): one per input
    (or imported shard); with tokenize.documents_per_shard one per part of each input, known
    once checkpoint count_documents has counted it. An input not counted yet is returned as its
    count file, not raised: all counts are planned at once, not one per DAG update."""
    shards = DATASETS[dataset].shards
    if not DOCUMENTS_PER_SHARD or dataset in IMPORTED:
        return [paths.shard_prefix(TOKENIZER, dataset, s.name) for s in shards], []
    prefixes, pending = [], []
    for s in shards:
        try:
            counted = checkpoints.count_documents.get(dataset=dataset, shard=s.name).output[0]
        except IncompleteCheckpointException as e:
            pending.append(e.targetfile)
            continue
        parts = sources.counted_parts(counted, DOCUMENTS_PER_SHARD)
        prefixes += [paths.part_prefix(TOKENIZER, dataset, s.name, p) for p in range(parts)]
    return prefixes, pending


def dataset_files(dataset):
    """What a job reading a dataset's shards takes as input (pending count files included)."""
    prefixes, pending = dataset_shards(dataset)
    return [f for p in prefixes for f in paths.shard_files(p)] + pending


def get_document_range(wildcards, input):
    """tokenize_part's `--documents START:STOP --counts FILE` (whole shards: nothing)."""
    documents = sources.part_documents(int(wildcards.part), DOCUMENTS_PER_SHARD)
    return ["--documents", documents, "--counts", input.counts]


def get_blend_prefixes(wildcards):
    return {name: dataset_shards(name)[0] for name in BLENDED}


def get_blend_shard_files(wildcards):
    return [f for name in BLENDED for f in dataset_files(name)]


def get_dataset_shard_prefixes(wildcards):
    return dataset_shards(wildcards.dataset)[0]


def get_dataset_shard_files(wildcards):
    return dataset_files(wildcards.dataset)


def get_merged_files(wildcards):
    """tokenize.merge's merged shards; not of imported datasets (a merge would copy them)."""
    names = [d for d in BLENDED if d not in IMPORTED] if CFG["tokenize"]["merge"] else []
    return [f for d in names for f in paths.shard_files(paths.merged_prefix(TOKENIZER, d))]


def get_sample_mb(wildcards):
    """tokenizer.train.sample_mb, shared by the datasets it samples."""
    return CFG["tokenizer"]["train"]["sample_mb"] / len(CFG["tokenizer"]["train"]["datasets"])


def get_tokenizer_file(wildcards):
    return tokenizer_asset("url") if TOKENIZER_SOURCE == "url" else CFG["tokenizer"]["path"]


def get_data_index(wildcards):
    """The data index a run reads (gptflow.paths.DATA_INDEX, shared by runs like it)."""
    return paths.DATA_INDEX.format(index=INDEX_OF[wildcards.run])


def get_index_settings(wildcards):
    """What data index {index} is built from (gptflow.train.run_config.data_index_settings)."""
    return INDEXES[wildcards.index]


def get_init_from_files(wildcards):
    """model.init_from's files: run.yaml records them, so a changed file re-renders it."""
    path = RUNS[wildcards.run]["model"].get("init_from")
    return init_from.input_files(path) if path else []


def get_train_threads(wildcards):
    """All local cores on one machine; on a cluster (no --cores) the profile's set-threads."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def get_local_ranks(wildcards):
    """train_gpt's ranks on one machine unless the profile sets nproc_per_node: one per visible
    GPU (none: one); under the Slurm profile one (srun starts the ranks)."""
    return PLACEMENT.ranks if PLACEMENT.executor == "local" and not PLACEMENT.mpi else 1


def get_rank_options(wildcards, resources, threads):
    """Argv words after `gptflow train --config ...`: distributed.rank_options."""
    return rank_options(dict(resources.items()), threads)


def get_train_launcher(wildcards, resources, threads):
    """Argv words before `gptflow train` (srun, the container's): distributed.train_launcher."""
    section = CONTAINER if CONTAINER["enabled"] else None
    image = os.path.abspath(container_image_file()) if section else None
    try:
        return train_launcher(dict(resources.items()), threads, section, image, os.getcwd())
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: {e}") from None


def eval_resources(config_file):
    """gptflow.results.evaluate.run_resources: on GPUs of the training partition's size under the
    Slurm profile; <TBD> in a plan made before run.yaml exists."""
    open(config_file).close()
    return run_eval_resources(
        config_file,
        PLACEMENT.gpu_mem_mb or gpu_memory.DEFAULT_GPU_MEMORY_MB,
        PLACEMENT.on_cluster or bool(LOCAL_GPUS),
        CFG["eval"],
    )


def get_eval_mem_mb(wildcards, input):
    return eval_resources(input.config)["mem_mb"]


def get_eval_gres(wildcards, input):
    return eval_resources(input.config)["gres"]


def get_eval_runtime(wildcards, input):
    return eval_resources(input.config)["runtime"]


def get_harness_files(wildcards):
    """eval.harness's task files and the local data files they name (gptflow.results.harness)."""
    try:
        return harness.input_files(HARNESS)
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: {CONFIG_SOURCE}: {e}") from None


def get_harness_step_files(wildcards):
    """The run's harness_step outputs: one per checkpoint eval.harness.every names."""
    return [
        paths.HARNESS_STEP.format(run=wildcards.run, step=s) for s in HARNESS_STEPS[wildcards.run]
    ]


def harness_resources(config_file):
    """gptflow.results.evaluate.harness_resources: sized from the tasks' work (harness_work) at the
    trained context, placed as evaluate is; <TBD> in a plan made before run.yaml exists."""
    open(config_file).close()
    return run_harness_resources(
        config_file,
        PLACEMENT.gpu_mem_mb or gpu_memory.DEFAULT_GPU_MEMORY_MB,
        PLACEMENT.on_cluster or bool(LOCAL_GPUS),
        HARNESS,
        harness_work(),
    )


def get_harness_mem_mb(wildcards, input):
    return harness_resources(input.config)["mem_mb"]


def get_harness_gres(wildcards, input):
    return harness_resources(input.config)["gres"]


def get_harness_runtime(wildcards, input):
    return harness_resources(input.config)["runtime"]


def get_harness_step_mem_mb(wildcards, input):
    """The export of the checkpoint, then the harness: the larger of the two jobs' memory."""
    return max(get_harness_mem_mb(wildcards, input), run_export_resources(input.config)["mem_mb"])


def get_harness_step_runtime(wildcards, input):
    """Minutes: the export's and the harness's."""
    return get_harness_runtime(wildcards, input) + run_export_resources(input.config)["runtime"]


def get_local_gpus(wildcards):
    """A GPU job's `gpu` resource on this machine: all its GPUs (LOCAL_GPUS, setup.smk);
    none declared on a cluster or without a GPU."""
    return LOCAL_GPUS or None


def get_harness_partition(wildcards):
    """The harness job's partition: evaluate's (the profile's), or none on one machine."""
    return profile_value("evaluate", "slurm_partition") or ""


def get_harness_pbs_queue(wildcards):
    """profiles/pbs: the harness jobs' queue, evaluate's (a GPU queue)."""
    return profile_value("evaluate", "pbs_queue") or ""


def get_harness_pbs_select(wildcards):
    """profiles/pbs: the harness jobs' resource line, evaluate's (one GPU node)."""
    return profile_value("evaluate", "pbs_select") or ""


def get_export_mem_mb(wildcards, input):
    """gptflow.results.evaluate.export_resources; <TBD> in a plan made before run.yaml exists."""
    open(input.config).close()
    return run_export_resources(input.config)["mem_mb"]


def get_export_runtime(wildcards, input):
    open(input.config).close()
    return run_export_resources(input.config)["runtime"]


def container_image_file(wildcards=None):
    return paths.IMAGE.format(hash=container_hash(), format=CONTAINER["format"])


def get_train_container(wildcards):
    """The image training runs in (an input of train_gpt), or nothing."""
    return [container_image_file()] if CONTAINER["enabled"] else []


def get_train_container_record(wildcards):
    """The image record (tag, image id) of the image training ran in, or nothing."""
    return [paths.IMAGE_RECORD.format(hash=container_hash())] if CONTAINER["enabled"] else []


def get_final_outputs():
    outputs = [paths.DONE, paths.EVAL, paths.HF_EXPORT, paths.REPORT_CARD]
    # eval.harness: a study's runs too
    outputs += [paths.HARNESS, paths.HARNESS_PAGE] if HARNESS["tasks"] else []
    return expand(outputs, run=RUNS) + get_study_outputs()


def get_study_outputs():
    """The study's comparison (rule study_report), or nothing without a study."""
    return [STUDY_PAGE.format(study=STUDY)] if STUDY else []
