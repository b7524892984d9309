"""After training: held-out evaluation, the Hugging Face export of the final checkpoint, and
lm-evaluation-harness on that export and on the checkpoints eval.harness.every names
(exported on the fly), tabled and plotted for the report (eval.harness)."""


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
    return [paths.IMAGE_RECORD.format(hash=container_hash())] if CONTAINER["enabled"] else []


rule evaluate:
    input:
        config=paths.RUN_YAML,
        done=paths.DONE,
        extra=verbatim(extra_files(CFG["eval"]["extra"])),
    output:
        paths.EVAL,
    log:
        paths.log("evaluate", "{run}"),
    conda:
        "../envs/gptflow.yaml"
    resources:
        mem_mb=get_eval_mem_mb,
        gres=get_eval_gres,
        runtime=get_eval_runtime,
        gpu=get_local_gpus,
    params:
        prompts=verbatim(prompt_args(CFG["eval"]["prompts"])),
        extra=verbatim(extra_args(CFG["eval"]["extra"])),
        new_tokens=CFG["eval"]["new_tokens"],
        max_windows=CFG["eval"]["max_windows"],
    shell:
        "gptflow evaluate --config {input.config:q} --out {output:q} {params.prompts:q}"
        " {params.extra:q} --new-tokens {params.new_tokens:q}"
        " --max-windows {params.max_windows:q} > {log:q} 2>&1"


rule export_hf:
    input:
        config=paths.RUN_YAML,
        done=paths.DONE,
    output:
        directory(paths.HF_EXPORT),
    log:
        paths.log("export_hf", "{run}"),
    conda:
        "../envs/gptflow.yaml"
    resources:
        mem_mb=get_export_mem_mb,
        runtime=get_export_runtime,
    shell:
        "gptflow export-hf --config {input.config:q} --out {output:q} > {log:q} 2>&1"


rule harness:
    input:
        config=paths.RUN_YAML,
        hf=paths.HF_EXPORT,
        tasks=get_harness_files,
    output:
        paths.HARNESS,
    log:
        paths.log("harness", "{run}"),
    conda:
        "../envs/gptflow.yaml"
    # sized from the tasks' requests and tokens, placed like evaluate: on evaluate's
    # partition, or its PBS queue and resource line (the profile's set-resources harness
    # ..., where given, replaces them)
    resources:
        mem_mb=get_harness_mem_mb,
        gres=get_harness_gres,
        runtime=get_harness_runtime,
        gpu=get_local_gpus,
        slurm_partition=get_harness_partition,
        pbs_queue=get_harness_pbs_queue,
        pbs_select=get_harness_pbs_select,
    params:
        tasks=verbatim(harness.task_args(HARNESS)),
        include=verbatim(harness.include_args(HARNESS)),
        num_fewshot=HARNESS["num_fewshot"],
        batch_size=HARNESS["batch_size"],
        limit=verbatim(harness.limit_args(HARNESS)),
    shell:
        "gptflow harness --config {input.config:q} --hf {input.hf:q} --out {output:q}"
        " {params.tasks:q} {params.include:q}"
        " --num-fewshot {params.num_fewshot:q} --batch-size {params.batch_size:q}"
        " {params.limit:q} > {log:q} 2>&1"


# A kept checkpoint of an earlier step (train.keep_every), exported into a hidden directory
# beside the output and removed after the harness: one job per step, cached like harness
# (the run's DONE.json: its checkpoints; the task list), reading the run's files only.
rule harness_step:
    input:
        config=paths.RUN_YAML,
        done=paths.DONE,
        tasks=get_harness_files,
    output:
        paths.HARNESS_STEP,
    log:
        paths.log("harness_step", "{run}-{step}"),
    wildcard_constraints:
        step=r"[1-9][0-9]*",
    conda:
        "../envs/gptflow.yaml"
    resources:
        mem_mb=get_harness_step_mem_mb,
        gres=get_harness_gres,
        runtime=get_harness_step_runtime,
        gpu=get_local_gpus,
        slurm_partition=get_harness_partition,
        pbs_queue=get_harness_pbs_queue,
        pbs_select=get_harness_pbs_select,
    params:
        tasks=verbatim(harness.task_args(HARNESS)),
        include=verbatim(harness.include_args(HARNESS)),
        num_fewshot=HARNESS["num_fewshot"],
        batch_size=HARNESS["batch_size"],
        limit=verbatim(harness.limit_args(HARNESS)),
    shell:
        "gptflow harness --config {input.config:q} --step {wildcards.step:q} --out {output:q}"
        " {params.tasks:q} {params.include:q}"
        " --num-fewshot {params.num_fewshot:q} --batch-size {params.batch_size:q}"
        " {params.limit:q} > {log:q} 2>&1"


# The harness's tables (each task's metrics, the final export's and every evaluated step's)
# and the learning curve over checkpoints, for `snakemake --report`.
rule harness_report:
    input:
        final=paths.HARNESS,
        steps=get_harness_step_files,
    output:
        page=report(
            paths.HARNESS_PAGE,
            caption="../workflow/report/harness.rst",
            category="Downstream evaluation",
            labels={"run": "{run}", "figure": "lm-evaluation-harness tables"},
        ),
        curve=report(
            paths.HARNESS_CURVE,
            caption="../workflow/report/harness_curve.rst",
            category="Downstream evaluation",
            labels={"run": "{run}", "figure": "metrics over checkpoints"},
        ),
    log:
        paths.log("harness_report", "{run}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        run="{run}",
    script:
        "../workflow/scripts/harness_report.py"


rule report_assets:
    input:
        config=paths.RUN_YAML,
        done=paths.DONE,
        evaluation=paths.EVAL,
        hf=paths.HF_EXPORT,
        container=get_train_container_record,
    output:
        loss=report(
            f"{paths.REPORT_DIR}/loss.svg",
            caption="../workflow/report/loss.rst",
            category="Training",
            labels={"run": "{run}", "figure": "loss"},
        ),
        lr=report(
            f"{paths.REPORT_DIR}/lr.svg",
            caption="../workflow/report/lr.rst",
            category="Training",
            labels={"run": "{run}", "figure": "learning rate"},
        ),
        throughput=report(
            f"{paths.REPORT_DIR}/throughput.svg",
            caption="../workflow/report/throughput.rst",
            category="Training",
            labels={"run": "{run}", "figure": "tokens per second"},
        ),
        mfu=report(
            f"{paths.REPORT_DIR}/mfu.svg",
            caption="../workflow/report/mfu.rst",
            category="Training",
            labels={"run": "{run}", "figure": "MFU"},
        ),
        grad_norm=report(
            f"{paths.REPORT_DIR}/grad_norm.svg",
            caption="../workflow/report/grad_norm.rst",
            category="Training",
            labels={"run": "{run}", "figure": "gradient norm"},
        ),
        card=report(
            paths.REPORT_CARD,
            caption="../workflow/report/card.rst",
            category="Run card",
            labels={
                "run": "{run}",
                "content": "model, versions, export, data, evaluation, container, config",
            },
        ),
    log:
        paths.log("report_assets", "{run}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        metrics=paths.METRICS,
        out_dir=paths.REPORT_DIR,
        datasets=REPORT_DATASETS,
    script:
        "../workflow/scripts/report_assets.py"
