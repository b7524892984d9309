"""Input functions of the rules after training (rules/evaluate.smk, which includes this file): the
evaluate, export_hf and harness jobs' resources, sized by the package from the run's model, and
their inputs; on profiles/kubernetes the GPU jobs' launcher (each its own JobSet of one pod)."""


def on_kubernetes():
    """profiles/kubernetes: evaluate, harness and harness_step run as JobSets of one pod."""
    return kube_sizing.on_kubernetes(PLAN.placement)


def eval_on_gpu():
    """Whether the GPU jobs run on a GPU: a batch system's GPU nodes, this machine's GPUs, or on
    Kubernetes a pod with one (gptflow.kubernetes.sizing.job_gpus)."""
    if on_kubernetes():
        return bool(kube_sizing.job_gpus(PLAN.config["kubernetes"]))
    return PLAN.placement.on_cluster or bool(PLAN.local_gpus)


def eval_resources(config_file):
    """gptflow.results.evaluate.run_resources: on GPUs of the training partition's size under the
    Slurm profile; <TBD> in a plan made before run.yaml exists."""
    open(config_file).close()
    return run_eval_resources(
        config_file,
        PLAN.placement.gpu_mem_mb or gpu_memory.DEFAULT_GPU_MEMORY_MB,
        eval_on_gpu(),
        PLAN.config["eval"],
    )


def driver_mem_mb(mem_mb):
    """A GPU job's memory in this Snakemake: its own, or on Kubernetes the submitter's (the
    job's memory is its pod's, not the driver's)."""
    return kube_sizing.SUBMITTER_MEM_MB if on_kubernetes() else mem_mb


def get_job_gpu(wildcards):
    """A GPU job's `gpu` resource here: get_local_gpus, none on Kubernetes (its pod's GPU)."""
    return None if on_kubernetes() else get_local_gpus(wildcards)


def job_launcher(run, job, done, mem_mb):
    """Argv words before `gptflow evaluate` / `gptflow harness` on Kubernetes: the submitter of
    the job's JobSet (gptflow.kubernetes.sizing.job_pod_set); off it the rules give none."""
    section = PLAN.config["kubernetes"]
    return kube_sizing.submit_launcher(kube_sizing.job_pod_set(section, run, job, done, mem_mb))


def get_eval_launcher(wildcards, input, output):
    if not on_kubernetes():
        return []
    mem_mb = eval_resources(input.config)["mem_mb"]
    return job_launcher(wildcards.run, "evaluate", output[0], mem_mb)


def get_eval_mem_mb(wildcards, input):
    return driver_mem_mb(eval_resources(input.config)["mem_mb"])


def get_eval_gres(wildcards, input):
    return eval_resources(input.config)["gres"]


def get_eval_runtime(wildcards, input):
    return eval_resources(input.config)["runtime"]


def get_harness_files(wildcards):
    """eval.harness's task files and the local data files they name (gptflow.results.harness)."""
    try:
        return harness.input_files(PLAN.harness)
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: {PLAN.source}: {e}") from None


def get_harness_step_files(wildcards):
    """The run's harness_step outputs: one per checkpoint eval.harness.every names."""
    return [
        paths.HARNESS_STEP.format(run=wildcards.run, step=s)
        for s in PLAN.harness_steps[wildcards.run]
    ]


def harness_resources(config_file):
    """gptflow.results.evaluate.harness_resources: sized from the tasks' work (harness_work) at the
    trained context, placed as evaluate is; <TBD> in a plan made before run.yaml exists."""
    open(config_file).close()
    return run_harness_resources(
        config_file,
        PLAN.placement.gpu_mem_mb or gpu_memory.DEFAULT_GPU_MEMORY_MB,
        eval_on_gpu(),
        PLAN.harness,
        harness_work(),
    )


def get_harness_mem_mb(wildcards, input):
    return driver_mem_mb(harness_resources(input.config)["mem_mb"])


def get_harness_launcher(wildcards, input, output):
    if not on_kubernetes():
        return []
    mem_mb = harness_resources(input.config)["mem_mb"]
    return job_launcher(wildcards.run, "harness", output[0], mem_mb)


def get_harness_gres(wildcards, input):
    return harness_resources(input.config)["gres"]


def get_harness_runtime(wildcards, input):
    return harness_resources(input.config)["runtime"]


def harness_step_mem_mb(config_file):
    """The export of the checkpoint, then the harness: the larger of the two jobs' memory."""
    harness_mb = harness_resources(config_file)["mem_mb"]
    return max(harness_mb, run_export_resources(config_file)["mem_mb"])


def get_harness_step_mem_mb(wildcards, input):
    return driver_mem_mb(harness_step_mem_mb(input.config))


def get_harness_step_launcher(wildcards, input, output):
    if not on_kubernetes():
        return []
    job = f"harness-step-{wildcards.step}"
    return job_launcher(wildcards.run, job, output[0], harness_step_mem_mb(input.config))


def get_harness_step_runtime(wildcards, input):
    """Minutes: the export's and the harness's."""
    return get_harness_runtime(wildcards, input) + run_export_resources(input.config)["runtime"]


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


def get_train_container_record(wildcards):
    """The image record (tag, image id) of the image training ran in, or nothing."""
    return (
        [paths.IMAGE_RECORD.format(hash=container_hash())]
        if PLAN.container_config["enabled"]
        else []
    )
