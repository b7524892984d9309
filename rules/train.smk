"""Training stage: the resolved run config, then DeepSpeed training that resumes itself.

Checkpoints live in results/runs/{run}/checkpoints/ and are deliberately not outputs:
Snakemake deletes the outputs of failed jobs. DONE.json is written last, by the trainer.
A study's runs are {run}s of these same rules; they share the data index where they read
the same samples (gptflow.train.run_config.data_index_settings).
"""


def get_blend_prefixes(wildcards):
    return {name: dataset_shards(name)[0] for name in BLENDED}


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


def get_train_container(wildcards):
    """The image training runs in (an input of train_gpt), or nothing."""
    return [container_image_file()] if CONTAINER["enabled"] else []


rule train:
    input:
        expand(paths.DONE, run=RUNS),


# The one rule that takes every shard file: the rules after it read the shards through
# run.yaml (their prefixes and sha256s), which a changed shard re-renders. Taking them again
# in each later rule would cost planning time per shard and change nothing.
rule render_run_config:
    input:
        tokenizer=paths.tokenizer_json(TOKENIZER),
        shards=get_blend_shard_files,
        init_from=get_init_from_files,
    output:
        paths.RUN_YAML,
    log:
        paths.log("render_run_config", "{run}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        settings=get_run_settings,
        shards=get_blend_prefixes,
        run_dir=paths.RUN_DIR,
        data_index=get_data_index,
    script:
        "../workflow/scripts/render_run_config.py"


# Every index the trainer reads (each dataset's document, sample and shuffle indices, and the
# blend's), built once here into results/data-index/{index}/ for every run that reads the same
# samples (a study's runs of other sizes or learning rates share it); the trainer's ranks then
# only memory-map them. The same code as `gptflow build-index --config RUN.yaml`.
rule build_data_index:
    input:
        tokenizer=paths.tokenizer_json(TOKENIZER),
        shards=get_blend_shard_files,
    output:
        paths.DATA_INDEX,
    log:
        paths.log("build_data_index", "{index}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        settings=get_index_settings,
        shards=get_blend_prefixes,
    script:
        "../workflow/scripts/build_data_index.py"


rule train_gpt:
    input:
        config=paths.RUN_YAML,
        index=get_data_index,
        image=get_train_container,
    output:
        paths.DONE,
    log:
        paths.log("train_gpt", "{run}"),
    conda:
        "../envs/gptflow.yaml"
    threads: get_train_threads
    # One machine: nproc_per_node ranks (one per visible GPU unless the profile or
    # --set-resources train_gpt:nproc_per_node=N says otherwise), the job's threads shared
    # among them, and all its GPUs held (`gpu`: a rank counts from cuda:0, as evaluate does).
    # A cluster: the profile's mpi (srun) with nodes x tasks_per_node ranks.
    resources:
        mpi="",
        nproc_per_node=get_local_ranks,
        gpu=get_local_gpus,
    params:
        hyperparameters=get_train_settings,
        launcher=get_train_launcher,
        ranks=get_rank_options,
    # --wait-for-lock: a job rerun while its predecessor still runs (Snakemake killed and
    # started again) waits for it (up to gptflow.train.checkpoint.LOCK_WAIT_S, 30 min) rather than
    # training beside it; a requeued job never waits on its own earlier run's lock
    shell:
        "{params.launcher:q} gptflow train --config {input.config:q} {params.ranks:q}"
        " --wait-for-lock >> {log:q} 2>&1"
