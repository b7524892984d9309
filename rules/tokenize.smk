"""Data stage: documents -> tokenizer -> Megatron .bin/.idx shards: one per input
(tokenize_shard), or with tokenize.documents_per_shard one per document range of each input
(count_documents, then tokenize_part); shards tokenized elsewhere (datasets of type megatron)
are checked and linked in (import_megatron_shard)."""


rule data:
    input:
        tokenizer_json(),
        get_blend_shard_files,
        get_merged_files,


# The files are params, not inputs: each with its size and mtime, so that a changed, added or
# removed file reruns the job (Snakemake's params trigger) while a plan does not print the
# paths of every file of the shard (750 for the default corpus).
rule collect_local_documents:
    output:
        jsonl="results/documents/{dataset}/{shard}.jsonl",
        manifest="results/documents/{dataset}/{shard}.manifest.json",
    log:
        "logs/collect_local_documents/{dataset}/{shard}.log",
    wildcard_constraints:
        dataset="|".join(re.escape(d) for d in datasets_of_kind("collect")) or "-",
    conda:
        "../envs/gptflow.yaml"
    params:
        root=get_local_root,
        json_key="text",
        files=get_local_shard_stamps,
    script:
        "../workflow/scripts/collect_local_documents.py"


if TOKENIZER_SOURCE == "train":

    rule sample_documents:
        input:
            get_sample_inputs,
        output:
            "results/tokenizers/{tokenizer}/samples/{dataset}.jsonl",
        log:
            "logs/sample_documents/{tokenizer}/{dataset}.log",
        conda:
            "../envs/gptflow.yaml"
        params:
            reader=get_sample_reader_args,
            max_mb=get_sample_mb,
            on_bad=CFG["tokenize"]["on_bad_document"],
        shell:
            "gptflow sample-documents --input {input:q} {params.reader:q}"
            " --max-mb {params.max_mb:q} --on-bad-document {params.on_bad:q}"
            " --out {output:q} > {log:q} 2>&1"

    rule train_tokenizer:
        input:
            get_tokenizer_samples,
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
            special_tokens=get_special_tokens,
            eod_token=get_eod_token,
        shell:
            "RAYON_NUM_THREADS={threads:q} gptflow train-tokenizer --input {input:q}"
            " --vocab-size {params.vocab_size:q} --min-frequency {params.min_frequency:q}"
            " --sample-mb {params.sample_mb:q} --special-tokens {params.special_tokens:q}"
            " --eod-token={params.eod_token:q} --out {output:q} > {log:q} 2>&1"

elif TOKENIZER_SOURCE == "gpt2":

    rule convert_gpt2_tokenizer:
        input:
            vocab=tokenizer_asset("vocab"),
            merges=tokenizer_asset("merges"),
        output:
            "results/tokenizers/{tokenizer}/tokenizer.json",
        log:
            "logs/convert_gpt2_tokenizer/{tokenizer}.log",
        conda:
            "../envs/gptflow.yaml"
        shell:
            "gptflow convert-tokenizer --vocab {input.vocab:q} --merges {input.merges:q}"
            " --out {output:q} > {log:q} 2>&1"

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
            "(cp {input:q} {output:q}.tmp && mv {output:q}.tmp {output:q}) > {log:q} 2>&1"


rule tokenize_shard:
    input:
        documents=get_shard_input,
        tokenizer="results/tokenizers/{tokenizer}/tokenizer.json",
    output:
        multiext("results/tokens/{tokenizer}/{dataset}/{shard}", ".bin", ".idx", ".json"),
    log:
        "logs/tokenize_shard/{tokenizer}/{dataset}/{shard}.log",
    wildcard_constraints:
        dataset=dataset_choice(TOKENIZED),
    conda:
        "../envs/gptflow.yaml"
    threads: CFG["tokenize"]["workers"]
    resources:
        mem_mb=CFG["tokenize"]["max_rss_mb"],
    params:
        prefix="results/tokens/{tokenizer}/{dataset}/{shard}",
        reader=get_reader_args,
        append_eod=get_append_eod_flag,
        eod_token=get_eod_token,
        engine=CFG["tokenize"]["engine"],
        on_bad=CFG["tokenize"]["on_bad_document"],
    shell:
        "gptflow tokenize --input {input.documents:q} --tokenizer {input.tokenizer:q}"
        " --output-prefix {params.prefix:q} {params.reader:q} {params.append_eod:q}"
        " --eod-token={params.eod_token:q} --workers {threads:q} --engine {params.engine:q}"
        " --on-bad-document {params.on_bad:q} --max-rss-mb {resources.mem_mb:q} > {log:q} 2>&1"


checkpoint count_documents:
    input:
        get_shard_input,
    output:
        "results/documents/{dataset}/{shard}.count.json",
    log:
        "logs/count_documents/{dataset}/{shard}.log",
    conda:
        "../envs/gptflow.yaml"
    params:
        reader=get_reader_args,
        on_bad=CFG["tokenize"]["on_bad_document"],
    shell:
        "gptflow count-documents --input {input:q} {params.reader:q}"
        " --on-bad-document {params.on_bad:q} --out {output:q} > {log:q} 2>&1"


rule tokenize_part:
    input:
        documents=get_shard_input,
        counts="results/documents/{dataset}/{shard}.count.json",
        tokenizer="results/tokenizers/{tokenizer}/tokenizer.json",
    output:
        multiext("results/tokens/{tokenizer}/{dataset}/{shard}-{part}", ".bin", ".idx", ".json"),
    log:
        "logs/tokenize_part/{tokenizer}/{dataset}/{shard}-{part}.log",
    wildcard_constraints:
        dataset=dataset_choice(TOKENIZED),
    conda:
        "../envs/gptflow.yaml"
    threads: CFG["tokenize"]["workers"]
    resources:
        mem_mb=CFG["tokenize"]["max_rss_mb"],
    params:
        prefix="results/tokens/{tokenizer}/{dataset}/{shard}-{part}",
        documents=get_part_documents,
        reader=get_reader_args,
        append_eod=get_append_eod_flag,
        eod_token=get_eod_token,
        engine=CFG["tokenize"]["engine"],
        on_bad=CFG["tokenize"]["on_bad_document"],
    shell:
        "gptflow tokenize --input {input.documents:q} --tokenizer {input.tokenizer:q}"
        " --output-prefix {params.prefix:q} {params.reader:q} {params.append_eod:q}"
        " --documents {params.documents:q} --counts {input.counts:q}"
        " --eod-token={params.eod_token:q} --workers {threads:q} --engine {params.engine:q}"
        " --on-bad-document {params.on_bad:q} --max-rss-mb {resources.mem_mb:q} > {log:q} 2>&1"


# Existing Megatron shards: checked against the run's tokenizer (structure, every id in its
# vocabulary, sampled documents encoding back to their ids; gptflow.data.shard_import), then
# published as symlinks to the user's .bin/.idx beside a manifest -- never copied.
rule import_megatron_shard:
    input:
        unpack(get_megatron_shard_files),
        tokenizer="results/tokenizers/{tokenizer}/tokenizer.json",
    output:
        multiext("results/tokens/{tokenizer}/{dataset}/{shard}", ".bin", ".idx", ".json"),
    log:
        "logs/import_megatron_shard/{tokenizer}/{dataset}/{shard}.log",
    wildcard_constraints:
        dataset=dataset_choice(IMPORTED),
        shard=imported_shard_choice(),
    conda:
        "../envs/gptflow.yaml"
    threads: 2  # numpy scans the .bin while hashlib hashes it
    params:
        source=get_megatron_prefix,
        prefix="results/tokens/{tokenizer}/{dataset}/{shard}",
        eod_token=get_eod_token,
    shell:
        "gptflow import-megatron --input {params.source:q} --tokenizer {input.tokenizer:q}"
        " --eod-token={params.eod_token:q} --output-prefix {params.prefix:q} > {log:q} 2>&1"


rule merge_shards:
    input:
        get_dataset_shard_files,
    output:
        multiext("results/tokens/{tokenizer}/{dataset}/merged", ".bin", ".idx", ".json"),
    log:
        "logs/merge_shards/{tokenizer}/{dataset}.log",
    conda:
        "../envs/gptflow.yaml"
    params:
        prefixes=get_dataset_shard_prefixes,
        prefix="results/tokens/{tokenizer}/{dataset}/merged",
    shell:
        "gptflow merge --input {params.prefixes:q} --output-prefix {params.prefix:q} > {log:q} 2>&1"
