"""After training: held-out evaluation, the Hugging Face export of the final checkpoint, and
lm-evaluation-harness on that export and on the checkpoints eval.harness.every names
(exported on the fly), tabled and plotted for the report (eval.harness)."""


include: "evaluate_functions.smk"


rule evaluate:
    input:
        config=paths.RUN_YAML,
        done=paths.DONE,
        extra=verbatim(extra_files(PLAN.config["eval"]["extra"])),
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
        gpu=get_job_gpu,
    params:
        launcher=get_eval_launcher,
        prompts=verbatim(prompt_args(PLAN.config["eval"]["prompts"])),
        extra=verbatim(extra_args(PLAN.config["eval"]["extra"])),
        new_tokens=PLAN.config["eval"]["new_tokens"],
        max_windows=PLAN.config["eval"]["max_windows"],
    shell:
        "{params.launcher:q} gptflow evaluate --config {input.config:q} --out {output:q}"
        " {params.prompts:q} {params.extra:q} --new-tokens {params.new_tokens:q}"
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
        gpu=get_job_gpu,
        slurm_partition=get_harness_partition,
        pbs_queue=get_harness_pbs_queue,
        pbs_select=get_harness_pbs_select,
    params:
        launcher=get_harness_launcher,
        tasks=verbatim(harness.task_args(PLAN.harness)),
        include=verbatim(harness.include_args(PLAN.harness)),
        num_fewshot=PLAN.harness["num_fewshot"],
        batch_size=PLAN.harness["batch_size"],
        limit=verbatim(harness.limit_args(PLAN.harness)),
    shell:
        "{params.launcher:q} gptflow harness --config {input.config:q} --hf {input.hf:q}"
        " --out {output:q} {params.tasks:q} {params.include:q}"
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
        gpu=get_job_gpu,
        slurm_partition=get_harness_partition,
        pbs_queue=get_harness_pbs_queue,
        pbs_select=get_harness_pbs_select,
    params:
        launcher=get_harness_step_launcher,
        tasks=verbatim(harness.task_args(PLAN.harness)),
        include=verbatim(harness.include_args(PLAN.harness)),
        num_fewshot=PLAN.harness["num_fewshot"],
        batch_size=PLAN.harness["batch_size"],
        limit=verbatim(harness.limit_args(PLAN.harness)),
    shell:
        "{params.launcher:q} gptflow harness --config {input.config:q}"
        " --step {wildcards.step:q} --out {output:q} {params.tasks:q} {params.include:q}"
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
        # data.quality: the data-quality page, which the card links
        quality=get_quality_page(),
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
        datasets=PLAN.report_datasets,
    script:
        "../workflow/scripts/report_assets.py"
