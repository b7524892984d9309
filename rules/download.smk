"""Acquisition: dataset files and tokenizer files, resumable and verified (gptflow download).

A download is written to NAME.part and renamed only after its sha256 checks out; the .part
survives failed jobs and retries, so every attempt resumes where the last one stopped.
"""


include: "download_functions.smk"


if PLAN.config["download"]["localrule"]:

    localrules:
        download_dataset,
        download_tokenizer_file,


rule download_dataset:
    output:
        file=paths.RAW_FILE,
        sha256=f"{paths.RAW_FILE}.sha256",
    log:
        paths.log("download_dataset", "{dataset}/{file}"),
    retries: 2
    conda:
        "../envs/gptflow.yaml"
    params:
        url=get_download_url,
        mirrors=get_download_mirrors,
        sha256=get_download_sha256,
        token_env=get_token_env,  # the variable's name; the job reads the token from it
        token_origins=get_token_origins,
        token_allow_http=get_token_allow_http,
        sums=paths.RAW_SHA256SUMS,
        attempts=PLAN.config["download"]["attempts"],
    shell:
        "gptflow download {params.url:q} --out {output.file:q} {params.mirrors:q}"
        " {params.sha256:q} {params.token_env:q} {params.token_origins:q}"
        " {params.token_allow_http:q} --dataset {wildcards.dataset:q}"
        " --sha256sums {params.sums:q} --attempts {params.attempts:q} > {log:q} 2>&1"


rule download_tokenizer_file:
    output:
        file=paths.TOKENIZER_FILE,
        sha256=f"{paths.TOKENIZER_FILE}.sha256",
    log:
        paths.log("download_tokenizer_file", "{tokenizer}/{key}/{file}"),
    wildcard_constraints:
        key="url|vocab|merges",
    retries: 2
    conda:
        "../envs/gptflow.yaml"
    params:
        url=get_download_url,
        mirrors=get_download_mirrors,
        sha256=get_download_sha256,
        sums=paths.TOKENIZER_SHA256SUMS,
        attempts=PLAN.config["download"]["attempts"],
    shell:
        "gptflow download {params.url:q} {params.mirrors:q} {params.sha256:q}"
        " --out {output.file:q} --sha256sums {params.sums:q} --attempts {params.attempts:q}"
        " > {log:q} 2>&1"
