"""Data stage: documents -> tokenizer -> Megatron .bin/.idx shards: one per input
(tokenize_shard), or with tokenize.documents_per_shard one per document range of each input
(count_documents, then tokenize_part); shards tokenized elsewhere (datasets of type megatron)
are checked and linked in (import_megatron_shard)."""


include: "tokenize_functions.smk"


rule data:
    input:
        paths.tokenizer_json(PLAN.tokenizer),
        get_data_shard_files,
        get_merged_files,


# The files are params, not inputs: each with its size and mtime, so that a changed, added or
# removed file reruns the job (Snakemake's params trigger) while a plan does not print the
# paths of every file of the shard (750 for the default corpus).
rule collect_local_documents:
    output:
        jsonl=paths.DOCUMENTS,
        manifest=paths.DOCUMENTS_MANIFEST,
    log:
        paths.log("collect_local_documents", "{dataset}/{shard}"),
    wildcard_constraints:
        dataset=dataset_choice(PLAN.collected),
    conda:
        "../envs/gptflow.yaml"
    params:
        root=get_local_root,
        json_key="text",
        files=get_local_shard_stamps,
    script:
        "../workflow/scripts/collect_local_documents.py"


# A Hugging Face dataset's split, read with the datasets library (gptflow.data.hf): shard i of
# N is the i-th of N contiguous row ranges. A local directory's files are params, as above.
rule collect_hf_documents:
    output:
        jsonl=paths.DOCUMENTS,
        manifest=paths.DOCUMENTS_MANIFEST,
    log:
        paths.log("collect_hf_documents", "{dataset}/{shard}"),
    wildcard_constraints:
        dataset=dataset_choice(PLAN.hf_collected),
    conda:
        "../envs/gptflow.yaml"
    params:
        source=get_hf_source,
        shards=get_hf_shard_count,
        files=get_hf_local_stamps,
    script:
        "../workflow/scripts/collect_hf_documents.py"


if PLAN.config["tokenizer"]["source"] == "train":

    rule sample_documents:
        input:
            get_sample_inputs,
        output:
            paths.TOKENIZER_SAMPLE,
        log:
            paths.log("sample_documents", "{tokenizer}/{dataset}"),
        conda:
            "../envs/gptflow.yaml"
        params:
            format=get_format,
            json_key=get_json_key,
            member=get_member,
            member_format=get_member_format,
            max_mb=get_sample_mb,
            on_bad=ON_BAD_DOCUMENT,
        shell:
            "gptflow sample-documents --input {input:q} --format {params.format:q}"
            " --json-key {params.json_key:q} {params.member:q} {params.member_format:q}"
            " --max-mb {params.max_mb:q} --on-bad-document {params.on_bad:q}"
            " --out {output:q} > {log:q} 2>&1"

    rule train_tokenizer:
        input:
            expand(
                paths.TOKENIZER_SAMPLE,
                dataset=PLAN.config["tokenizer"]["train"]["datasets"],
                allow_missing=True,
            ),
        output:
            paths.TOKENIZER_JSON,
        log:
            paths.log("train_tokenizer", "{tokenizer}"),
        conda:
            "../envs/gptflow.yaml"
        threads: 2
        params:
            vocab_size=PLAN.config["tokenizer"]["train"]["vocab_size"],
            min_frequency=PLAN.config["tokenizer"]["train"]["min_frequency"],
            sample_mb=PLAN.config["tokenizer"]["train"]["sample_mb"],
            special_tokens=verbatim(PLAN.config["tokenizer"]["special_tokens"]),
            eod_token=verbatim(PLAN.config["tokenizer"]["eod_token"]),
        shell:
            "RAYON_NUM_THREADS={threads:q} gptflow train-tokenizer --input {input:q}"
            " --vocab-size {params.vocab_size:q} --min-frequency {params.min_frequency:q}"
            " --sample-mb {params.sample_mb:q} --special-tokens {params.special_tokens:q}"
            " --eod-token={params.eod_token:q} --out {output:q} > {log:q} 2>&1"

elif PLAN.config["tokenizer"]["source"] == "gpt2":

    rule convert_gpt2_tokenizer:
        input:
            vocab=tokenizer_asset("vocab"),
            merges=tokenizer_asset("merges"),
        output:
            paths.TOKENIZER_JSON,
        log:
            paths.log("convert_gpt2_tokenizer", "{tokenizer}"),
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
            paths.TOKENIZER_JSON,
        log:
            paths.log("import_tokenizer", "{tokenizer}"),
        conda:
            "../envs/gptflow.yaml"
        shell:
            "(cp {input:q} {output:q}.tmp && mv {output:q}.tmp {output:q}) > {log:q} 2>&1"


# A whole input, or (tokenize_part, below) one document range of it.
rule tokenize_shard:
    input:
        documents=get_shard_input,
        tokenizer=paths.TOKENIZER_JSON,
    output:
        multiext(paths.SHARD, ".bin", ".idx", ".json"),
    log:
        paths.log("tokenize_shard", "{tokenizer}/{dataset}/{shard}"),
    wildcard_constraints:
        dataset=dataset_choice(PLAN.tokenized),
    conda:
        "../envs/gptflow.yaml"
    threads: PLAN.config["tokenize"]["workers"]
    resources:
        mem_mb=PLAN.config["tokenize"]["max_rss_mb"],
    params:
        prefix=paths.SHARD,
        format=get_format,
        json_key=get_json_key,
        member=get_member,
        member_format=get_member_format,
        append_eod=APPEND_EOD,
        document_range=[],  # tokenize_part: --documents START:STOP --counts FILE
        eod_token=verbatim(PLAN.config["tokenizer"]["eod_token"]),
        engine=PLAN.config["tokenize"]["engine"],
        on_bad=ON_BAD_DOCUMENT,
    shell:
        "gptflow tokenize --input {input.documents:q} --tokenizer {input.tokenizer:q}"
        " --output-prefix {params.prefix:q} --format {params.format:q}"
        " --json-key {params.json_key:q} {params.member:q} {params.member_format:q}"
        " {params.append_eod:q} {params.document_range:q} --eod-token={params.eod_token:q}"
        " --workers {threads:q} --engine {params.engine:q}"
        " --on-bad-document {params.on_bad:q} --max-rss-mb {resources.mem_mb:q} > {log:q} 2>&1"


checkpoint count_documents:
    input:
        get_shard_input,
    output:
        paths.DOCUMENT_COUNT,
    log:
        paths.log("count_documents", "{dataset}/{shard}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        format=get_format,
        json_key=get_json_key,
        member=get_member,
        member_format=get_member_format,
        on_bad=ON_BAD_DOCUMENT,
    shell:
        "gptflow count-documents --input {input:q} --format {params.format:q}"
        " --json-key {params.json_key:q} {params.member:q} {params.member_format:q}"
        " --on-bad-document {params.on_bad:q} --out {output:q} > {log:q} 2>&1"


use rule tokenize_shard as tokenize_part with:
    input:
        documents=get_shard_input,
        counts=paths.DOCUMENT_COUNT,
        tokenizer=paths.TOKENIZER_JSON,
    output:
        multiext(paths.PART, ".bin", ".idx", ".json"),
    log:
        paths.log("tokenize_part", "{tokenizer}/{dataset}/{shard}-{part}"),
    params:
        prefix=paths.PART,
        document_range=get_document_range,


# A data ablation's run whose data.quality differs from the base config's (a study): its
# datasets' shards tokenized from its own recipe's documents, or the collected ones ('raw'),
# under results/tokens/{tokenizer}/{dataset}/{variant}/ (the base's stay where they are).
use rule tokenize_shard as tokenize_variant_shard with:
    output:
        multiext(paths.VARIANT_SHARD, ".bin", ".idx", ".json"),
    log:
        paths.log("tokenize_variant_shard", "{tokenizer}/{dataset}/{variant}/{shard}"),
    wildcard_constraints:
        dataset=dataset_choice(PLAN.tokenized),
        variant=f"{quality_recipe.STEP_NAME}|{quality_recipe.RAW}",
    params:
        prefix=paths.VARIANT_SHARD,


# Existing Megatron shards: checked against the run's tokenizer (structure, every id in its
# vocabulary, sampled documents encoding back to their ids; gptflow.data.shard_import), then
# published as symlinks to the user's .bin/.idx beside a manifest -- never copied.
rule import_megatron_shard:
    input:
        unpack(get_megatron_shard_files),
        tokenizer=paths.TOKENIZER_JSON,
    output:
        multiext(paths.SHARD, ".bin", ".idx", ".json"),
    log:
        paths.log("import_megatron_shard", "{tokenizer}/{dataset}/{shard}"),
    wildcard_constraints:
        dataset=dataset_choice(PLAN.imported),
        shard=imported_shard_choice(),
    conda:
        "../envs/gptflow.yaml"
    threads: 2  # numpy scans the .bin while hashlib hashes it
    params:
        source=get_shard_input,
        prefix=paths.SHARD,
        eod_token=verbatim(PLAN.config["tokenizer"]["eod_token"]),
    shell:
        "gptflow import-megatron --input {params.source:q} --tokenizer {input.tokenizer:q}"
        " --eod-token={params.eod_token:q} --output-prefix {params.prefix:q} > {log:q} 2>&1"


rule merge_shards:
    input:
        get_dataset_shard_files,
    output:
        multiext(paths.MERGED, ".bin", ".idx", ".json"),
    log:
        paths.log("merge_shards", "{tokenizer}/{dataset}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        prefixes=get_dataset_shard_prefixes,
        prefix=paths.MERGED,
    shell:
        "gptflow merge --input {params.prefixes:q} --output-prefix {params.prefix:q} > {log:q} 2>&1"
