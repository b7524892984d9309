"""Acquisition: dataset files and tokenizer files, resumable and verified (gptflow download).

A download is written to NAME.part and renamed only after its sha256 checks out; the .part
survives failed jobs and retries, so every attempt resumes where the last one stopped.
"""

if CFG["download"]["localrule"]:

    localrules:
        download_dataset,
        download_tokenizer_file,


rule download_dataset:
    output:
        file="resources/raw/{dataset}/{file}",
        sha256="resources/raw/{dataset}/{file}.sha256",
    log:
        "logs/download_dataset/{dataset}/{file}.log",
    retries: 2
    conda:
        "../envs/gptflow.yaml"
    params:
        url=get_download_url,
        options=get_download_args,
        sums="resources/raw/{dataset}/SHA256SUMS",
        attempts=CFG["download"]["attempts"],
    shell:
        "gptflow download {params.url:q} --out {output.file:q} {params.options:q}"
        " --dataset {wildcards.dataset:q} --sha256sums {params.sums:q}"
        " --attempts {params.attempts:q} > {log:q} 2>&1"


rule download_tokenizer_file:
    output:
        file="resources/tokenizers/{tokenizer}/{key}/{file}",
        sha256="resources/tokenizers/{tokenizer}/{key}/{file}.sha256",
    log:
        "logs/download_tokenizer_file/{tokenizer}/{key}/{file}.log",
    wildcard_constraints:
        key="url|vocab|merges",
    retries: 2
    conda:
        "../envs/gptflow.yaml"
    params:
        source=get_tokenizer_download,
        sums="resources/tokenizers/{tokenizer}/SHA256SUMS",
        attempts=CFG["download"]["attempts"],
    shell:
        "gptflow download {params.source:q} --out {output.file:q} --sha256sums {params.sums:q}"
        " --attempts {params.attempts:q} > {log:q} 2>&1"
