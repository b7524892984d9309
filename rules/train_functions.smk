"""Input functions of the training stage's rules (rules/train.smk, which includes this file): the
blend's shards, the data index, model.init_from's files, the ranks and the launcher, the image
training runs in."""


def get_blend_prefixes(wildcards):
    """The run's training shards by dataset: its recipe's (gptflow.data.quality.recipe.variant)."""
    run = job_run(wildcards)
    return {name: dataset_shards(name, PLAN.run_variants[run][name])[0] for name in PLAN.blended}


def get_heldout_prefixes(wildcards):
    """A data ablation's run: the base's shards, its validation and test text; else {}."""
    if PLAN.run_variants[job_run(wildcards)] == PLAN.base_variants:
        return {}
    return {name: dataset_shards(name)[0] for name in PLAN.blended}


def variant_origins(dataset, variant):
    """Each shard's document origins file of a dataset's variant (gptflow.paths.QUALITY_ORIGINS:
    its last step's), or [] for raw (the collected documents themselves)."""
    if variant == quality_recipe.RAW:
        return []
    return [
        paths.QUALITY_ORIGINS.format(step=variant, dataset=dataset, shard=s.name)
        for s in PLAN.datasets[dataset].shards
    ]


def get_document_origins(wildcards):
    """A data ablation's run: per dataset whose recipe differs from the base's, its shards'
    origins files and the base's, {dataset: {"run": files, "base": files}}: its train split
    ends before the base's held-out documents (gptflow.data.dataset.heldout_train_ends)."""
    run = PLAN.run_variants[job_run(wildcards)]
    return {
        name: {
            "run": variant_origins(name, run[name]),
            "base": variant_origins(name, PLAN.base_variants[name]),
        }
        for name in PLAN.blended
        if run[name] != PLAN.base_variants[name]
    }


def get_origin_files(wildcards):
    """get_document_origins' files: a step run again renews run.yaml and the data index."""
    origins = get_document_origins(wildcards).values()
    return sorted({f for files in origins for f in files["run"] + files["base"]})


def get_data_index(wildcards):
    """The data index a run reads (gptflow.paths.DATA_INDEX, shared by runs like it)."""
    return paths.DATA_INDEX.format(index=PLAN.index_of[wildcards.run])


def get_index_settings(wildcards):
    """What data index {index} is built from (gptflow.train.run_config.data_index_settings)."""
    return PLAN.indexes[wildcards.index]


def get_init_from_files(wildcards):
    """model.init_from's files: run.yaml records them, so a changed file re-renders it."""
    path = PLAN.every_run[wildcards.run].config["model"].get("init_from")
    return init_from.input_files(path) if path else []


def get_train_threads(wildcards):
    """All local cores on one machine; on a cluster (no --cores) the profile's set-threads."""
    if kube_sizing.on_kubernetes(PLAN.placement):
        return 1  # the submitter; the pods' threads are kubernetes.cpus_per_rank
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def get_local_ranks(wildcards):
    """train_gpt's ranks on one machine unless the profile sets nproc_per_node: one per visible
    GPU (none: one); under the Slurm profile one (srun starts the ranks)."""
    return (
        PLAN.placement.ranks if PLAN.placement.executor == "local" and not PLAN.placement.mpi else 1
    )


def get_elastic(wildcards):
    """The run's train.elastic (None: a fixed number of ranks)."""
    return PLAN.every_run[wildcards.run].config["train"].get("elastic")


def get_rank_options(wildcards, resources, threads):
    """Argv words after `gptflow train --config ...`: distributed.rank_options."""
    if kube_sizing.on_kubernetes(PLAN.placement):  # each pod's: gptflow.kubernetes.sizing
        return kube_sizing.rank_options(PLAN.placement)
    return rank_options(dict(resources.items()), threads, get_elastic(wildcards))


def get_train_launcher(wildcards, resources, threads):
    """Argv words before `gptflow train` (srun, the container's): distributed.train_launcher;
    an autotune trial's behind `gptflow autotune-trial` (gptflow.train.trial.trial_command)."""
    launcher = run_launcher(wildcards, resources, threads)
    if wildcards.run in PLAN.trials:
        return trial_command(paths.RUN_DIR.format(run=wildcards.run), PLAN.autotune, launcher)
    return launcher


def run_launcher(wildcards, resources, threads):
    if kube_sizing.on_kubernetes(PLAN.placement):  # a JobSet of pods running the command
        return kube_sizing.submit_launcher(kube_sizing.plan_pod_set(PLAN, wildcards.run))
    section = PLAN.container_config if PLAN.container_config["enabled"] else None
    image = os.path.abspath(container_image_file()) if section else None
    try:
        return train_launcher(
            dict(resources.items()),
            threads,
            section,
            image,
            os.getcwd(),
            get_elastic(wildcards),
        )
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: {e}") from None


def get_train_container(wildcards):
    """The image training runs in (an input of train_gpt), or nothing."""
    return [container_image_file()] if PLAN.container_config["enabled"] else []
