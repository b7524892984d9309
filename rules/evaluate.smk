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
    params:
        args=get_eval_args,
    shell:
        "gptflow evaluate --config {input.config} --out {output} {params.args} > {log} 2>&1"


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
        "gptflow export-hf --config {input.config} --out {output} > {log} 2>&1"
