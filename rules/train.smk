"""Training stage: the resolved run config, then DeepSpeed training that resumes itself.

Checkpoints live in results/runs/{run}/checkpoints/ and are deliberately not outputs:
Snakemake deletes the outputs of failed jobs. DONE.json is written last, by the trainer.
A study's runs are {run}s of these same rules; they share the data index where they read
the same samples (gptflow.train.run_config.data_index_settings).
"""


include: "train_functions.smk"


rule train:
    input:
        expand(paths.DONE, run=PLAN.runs),
        get_quality_page(),


# The shards' input of this rule and of build_data_index is each shard's manifest
# (PREFIX.json: its job writes it last and atomically, with the .bin's and .idx's sha256, so
# a shard made again is a new manifest, and the .bin and .idx are there with it): N inputs
# a job, not 3N. run.yaml records the prefixes and sha256s; the rules after these two read
# the shards through run.yaml and the index, which a changed shard renews.
rule render_run_config:
    input:
        tokenizer=paths.tokenizer_json(PLAN.tokenizer),
        shards=get_blend_manifests,
        init_from=get_init_from_files,
        origins=get_origin_files,
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
        heldout=get_heldout_prefixes,
        origins=get_document_origins,
    script:
        "../workflow/scripts/render_run_config.py"


# Every index the trainer reads (each dataset's document, sample and shuffle indices, and the
# blend's), built once here into results/data-index/{index}/ for every run that reads the same
# samples (a study's runs of other sizes or learning rates share it); the trainer's ranks then
# only memory-map them. The same code as `gptflow build-index --config RUN.yaml`.
rule build_data_index:
    input:
        tokenizer=paths.tokenizer_json(PLAN.tokenizer),
        shards=get_blend_manifests,
        origins=get_origin_files,
    output:
        paths.DATA_INDEX,
    log:
        paths.log("build_data_index", "{index}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        settings=get_index_settings,
        shards=get_blend_prefixes,
        heldout=get_heldout_prefixes,
        origins=get_document_origins,
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
