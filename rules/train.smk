"""Training stage: the resolved run config, then DeepSpeed training that resumes itself.

Checkpoints live in results/runs/{run}/checkpoints/ and are deliberately not outputs:
Snakemake deletes the outputs of failed jobs. DONE.json is written last, by the trainer.
"""


rule train:
    input:
        expand(paths.DONE, run=RUN),


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
        settings=RUN_SETTINGS,
        shards=get_blend_prefixes,
        run_dir=paths.RUN_DIR,
    script:
        "../workflow/scripts/render_run_config.py"


# Every index the trainer reads (each dataset's document, sample and shuffle indices, and the
# blend's), built once here into results/runs/{run}/data-index/; the trainer's ranks then only
# memory-map them.
rule build_data_index:
    input:
        config=paths.RUN_YAML,
    output:
        paths.DATA_INDEX,
    log:
        paths.log("build_data_index", "{run}"),
    conda:
        "../envs/gptflow.yaml"
    shell:
        "gptflow build-index --config {input.config:q} --out {output:q} > {log:q} 2>&1"


rule train_gpt:
    input:
        config=paths.RUN_YAML,
        index=paths.DATA_INDEX,
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
    # among them. A cluster: the profile's mpi (srun) with nodes x tasks_per_node ranks.
    resources:
        mpi="",
        nproc_per_node=get_local_ranks,
    params:
        hyperparameters=TRAIN_SETTINGS,
        launcher=get_train_launcher,
        ranks=get_rank_options,
    # --wait-for-lock: a job rerun while its predecessor still runs (Snakemake killed and
    # started again) waits for it (up to gptflow.checkpoint.LOCK_WAIT_S, 30 min) rather than
    # training beside it; a requeued job never waits on its own earlier run's lock
    shell:
        "{params.launcher:q} gptflow train --config {input.config:q} {params.ranks:q}"
        " --wait-for-lock >> {log:q} 2>&1"
