"""Data stage: documents -> tokenizer -> one Megatron .bin/.idx shard per dataset shard."""


rule data:
    input:
        tokenizer_json(),
        get_blend_shard_files,


rule collect_local_documents:
    input:
        get_local_shard_files,
    output:
        jsonl="results/documents/{dataset}/{shard}.jsonl",
        manifest="results/documents/{dataset}/{shard}.manifest.json",
    log:
        "logs/collect_local_documents/{dataset}/{shard}.log",
    conda:
        "../envs/gptflow.yaml"
    params:
        root=get_local_root,
        json_key=CFG["tokenize"]["json_key"],
    script:
        "../workflow/scripts/collect_local_documents.py"


if CFG["tokenizer"]["source"] == "train":

    rule train_tokenizer:
        input:
            get_tokenizer_documents,
        output:
            "results/tokenizers/{tokenizer}/tokenizer.json",
        log:
            "logs/train_tokenizer/{tokenizer}.log",
        conda:
            "../envs/gptflow.yaml"
        threads: 2
        params:
            vocab_size=CFG["tokenizer"]["train"]["vocab_size"],
            min_frequency=CFG["tokenizer"]["train"]["min_frequency"],
            sample_mb=CFG["tokenizer"]["train"]["sample_mb"],
            special_tokens=CFG["tokenizer"]["special_tokens"],
            eod_token=get_eod_token,
            json_key=CFG["tokenize"]["json_key"],
        shell:
            "RAYON_NUM_THREADS={threads} gptflow train-tokenizer --input {input}"
            " --vocab-size {params.vocab_size} --min-frequency {params.min_frequency}"
            " --sample-mb {params.sample_mb} --special-tokens {params.special_tokens:q}"
            " --eod-token {params.eod_token:q} --json-key {params.json_key:q}"
            " --out {output} > {log} 2>&1"

else:

    rule import_tokenizer:
        input:
            get_tokenizer_file,
        output:
            "results/tokenizers/{tokenizer}/tokenizer.json",
        log:
            "logs/import_tokenizer/{tokenizer}.log",
        conda:
            "../envs/gptflow.yaml"
        shell:
            "(cp {input} {output}.tmp && mv {output}.tmp {output}) > {log} 2>&1"


rule tokenize_shard:
    input:
        documents=get_shard_documents,
        tokenizer="results/tokenizers/{tokenizer}/tokenizer.json",
    output:
        multiext("results/tokens/{tokenizer}/{dataset}/{shard}", ".bin", ".idx", ".json"),
    log:
        "logs/tokenize_shard/{tokenizer}/{dataset}/{shard}.log",
    conda:
        "../envs/gptflow.yaml"
    threads: CFG["tokenize"]["workers"]
    params:
        prefix="results/tokens/{tokenizer}/{dataset}/{shard}",
        json_key=CFG["tokenize"]["json_key"],
        append_eod=get_append_eod_flag,
        eod_token=get_eod_token,
    shell:
        "gptflow tokenize --input {input.documents} --tokenizer {input.tokenizer}"
        " --output-prefix {params.prefix} --json-key {params.json_key:q} {params.append_eod}"
        " --eod-token {params.eod_token:q} --workers {threads} --engine hf > {log} 2>&1"
