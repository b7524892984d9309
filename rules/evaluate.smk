"""After training: held-out evaluation and the Hugging Face export of the final checkpoint."""


rule evaluate:
    input:
        config="results/runs/{run}/run.yaml",
        done="results/runs/{run}/DONE.json",
        extra=get_eval_extra_files,
    output:
        "results/runs/{run}/eval.json",
    log:
        "logs/evaluate/{run}.log",
    conda:
        "../envs/gptflow.yaml"
    resources:
        mem_mb=get_eval_mem_mb,
    params:
        args=get_eval_args,
    shell:
        "gptflow evaluate --config {input.config:q} --out {output:q} {params.args:q} > {log:q} 2>&1"


rule export_hf:
    input:
        config="results/runs/{run}/run.yaml",
        done="results/runs/{run}/DONE.json",
    output:
        directory("results/runs/{run}/hf"),
    log:
        "logs/export_hf/{run}.log",
    conda:
        "../envs/gptflow.yaml"
    shell:
        "gptflow export-hf --config {input.config:q} --out {output:q} > {log:q} 2>&1"


rule report_assets:
    input:
        config="results/runs/{run}/run.yaml",
        done="results/runs/{run}/DONE.json",
        evaluation="results/runs/{run}/eval.json",
        hf="results/runs/{run}/hf",
        container=get_train_container_record,
    output:
        loss=report(
            "results/runs/{run}/report/loss.svg",
            caption="../workflow/report/loss.rst",
            category="Training",
            labels={"run": "{run}", "figure": "loss"},
        ),
        lr=report(
            "results/runs/{run}/report/lr.svg",
            caption="../workflow/report/lr.rst",
            category="Training",
            labels={"run": "{run}", "figure": "learning rate"},
        ),
        throughput=report(
            "results/runs/{run}/report/throughput.svg",
            caption="../workflow/report/throughput.rst",
            category="Training",
            labels={"run": "{run}", "figure": "tokens per second"},
        ),
        mfu=report(
            "results/runs/{run}/report/mfu.svg",
            caption="../workflow/report/mfu.rst",
            category="Training",
            labels={"run": "{run}", "figure": "MFU"},
        ),
        grad_norm=report(
            "results/runs/{run}/report/grad_norm.svg",
            caption="../workflow/report/grad_norm.rst",
            category="Training",
            labels={"run": "{run}", "figure": "gradient norm"},
        ),
        card=report(
            "results/runs/{run}/report/card.html",
            caption="../workflow/report/card.rst",
            category="Run card",
            labels={
                "run": "{run}",
                "content": "model, versions, export, data, evaluation, container, config",
            },
        ),
    log:
        "logs/report_assets/{run}.log",
    conda:
        "../envs/gptflow.yaml"
    params:
        metrics="results/runs/{run}/metrics.jsonl",
        out_dir="results/runs/{run}/report",
        datasets=get_report_datasets,
    script:
        "../workflow/scripts/report_assets.py"
