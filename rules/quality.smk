"""Data-quality stage (config data.quality; README, Data quality): between collection and
tokenization, each step of a dataset's recipe reads the previous step's documents (the first,
the collected shard) and writes its own, results/quality/{step}/{dataset}/{shard}.jsonl with a
manifest. Deduplication is per shard, then per group, then per shard again: exact (hashes,
repeats, removal) and minhash (signatures, pairs per band, clusters, removal); filters and
language score each document once into a side file, then select per recipe. Nothing here
runs without data.quality."""


include: "quality_functions.smk"


if PLAN.quality_step and workflow.is_main_process:
    for line in quality_plan_lines():
        logger.info(line)


rule hash_documents:
    input:
        get_step_input,
    output:
        paths.EXACT_HASHES,
    log:
        paths.log("hash_documents", "{step}/{dataset}/{shard}"),
    wildcard_constraints:
        step=quality_recipe.step_pattern("exact"),
    conda:
        "../envs/gptflow.yaml"
    params:
        reader=get_step_reader,
        on_bad=ON_BAD_DOCUMENT,
    shell:
        "gptflow quality-exact-hashes --input {input:q} {params.reader:q}"
        " --on-bad-document {params.on_bad:q} --out {output:q} > {log:q} 2>&1"


rule find_exact_repeats:
    input:
        hashes=get_group_hashes,
    output:
        removed=paths.QUALITY_REMOVED,
        stats=paths.QUALITY_GROUP_STATS,
    log:
        paths.log("find_exact_repeats", "{step}/{group}"),
    wildcard_constraints:
        step=quality_recipe.step_pattern("exact"),
    conda:
        "../envs/gptflow.yaml"
    resources:
        mem_mb=get_repeats_mem_mb,
        runtime=get_repeats_runtime,
    shell:
        "gptflow quality-exact-repeats --input {input.hashes:q} --out {output.removed:q}"
        " --stats {output.stats:q} > {log:q} 2>&1"


rule minhash_signatures:
    input:
        get_step_input,
    output:
        paths.MINHASH_SIGNATURES,
    log:
        paths.log("minhash_signatures", "{step}/{dataset}/{shard}"),
    wildcard_constraints:
        step=quality_recipe.step_pattern("minhash"),
    conda:
        "../envs/gptflow.yaml"
    params:
        reader=get_step_reader,
        on_bad=ON_BAD_DOCUMENT,
        settings=get_minhash_settings,
    shell:
        "gptflow quality-minhash-signatures --input {input:q} {params.reader:q}"
        " --on-bad-document {params.on_bad:q} {params.settings:q} --out {output:q} > {log:q} 2>&1"


rule minhash_buckets:
    input:
        signatures=get_group_signatures,
    output:
        paths.MINHASH_PAIRS,
    log:
        paths.log("minhash_buckets", "{step}/{group}/{band}"),
    wildcard_constraints:
        step=quality_recipe.step_pattern("minhash"),
    conda:
        "../envs/gptflow.yaml"
    resources:
        mem_mb=get_buckets_mem_mb,
        runtime=get_buckets_runtime,
    params:
        band=get_band,
        rows=get_minhash_rows,
    shell:
        "gptflow quality-minhash-buckets --input {input.signatures:q} --band {params.band:q}"
        " --rows {params.rows:q} --out {output:q} > {log:q} 2>&1"


rule cluster_minhash_pairs:
    input:
        pairs=get_group_pairs,
        signatures=get_group_signatures,
    output:
        removed=paths.QUALITY_REMOVED,
        stats=paths.QUALITY_GROUP_STATS,
    log:
        paths.log("cluster_minhash_pairs", "{step}/{group}"),
    wildcard_constraints:
        step=quality_recipe.step_pattern("minhash"),
    conda:
        "../envs/gptflow.yaml"
    resources:
        mem_mb=get_clusters_mem_mb,
        runtime=get_clusters_runtime,
    shell:
        "gptflow quality-minhash-clusters --input {input.pairs:q}"
        " --signatures {input.signatures:q} --out {output.removed:q}"
        " --stats {output.stats:q} > {log:q} 2>&1"


# A step's last job per shard: the documents its decision keeps, their origins and a
# manifest. A deduplication step decides by its group's removal list (remove_duplicates); a
# filters step by the signals against the recipe's thresholds (select_documents, below); a
# language step by the scores against its languages (select_language, below). The three share
# this command: `gptflow {params.command}` with the decision's file and settings.
rule remove_duplicates:
    input:
        documents=get_step_input,
        origins=get_step_origins,
        decision=get_removed,
    output:
        jsonl=paths.QUALITY_DOCUMENTS,
        origins=paths.QUALITY_ORIGINS,
        manifest=paths.QUALITY_MANIFEST,
    log:
        paths.log("remove_duplicates", "{step}/{dataset}/{shard}"),
    wildcard_constraints:
        step=quality_recipe.step_pattern("(?:exact|minhash)"),
    conda:
        "../envs/gptflow.yaml"
    params:
        command="quality-remove",
        reader=get_step_reader,
        on_bad=ON_BAD_DOCUMENT,
        decision_flag="--removed",
        settings=get_removal_settings,
    shell:
        "gptflow {params.command:q} --input {input.documents:q} {params.reader:q}"
        " --on-bad-document {params.on_bad:q} {params.decision_flag:q} {input.decision:q}"
        " {params.settings:q} --step {wildcards.step:q} --dataset {wildcards.dataset:q}"
        " --shard {wildcards.shard:q} --out {output.jsonl:q} --manifest {output.manifest:q}"
        " --input-origins {input.origins:q} --origins {output.origins:q} > {log:q} 2>&1"


# The filters step (gptflow.data.quality.signals, filters): every document's signals once per input
# and word tokenizer, then the recipe's thresholds applied to them per shard
rule compute_filter_signals:
    input:
        get_signals_input,
    output:
        paths.FILTER_SIGNALS,
    log:
        paths.log("compute_filter_signals", "{signals}/{dataset}/{shard}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        reader=get_signals_reader,
        on_bad=ON_BAD_DOCUMENT,
        tokenizer=get_signals_tokenizer,
    shell:
        "gptflow quality-filter-signals --input {input:q} {params.reader:q}"
        " --on-bad-document {params.on_bad:q} --tokenizer {params.tokenizer:q}"
        " --out {output:q} > {log:q} 2>&1"


use rule remove_duplicates as select_documents with:
    input:
        documents=get_step_input,
        origins=get_step_origins,
        decision=get_filter_signals,
    log:
        paths.log("select_documents", "{step}/{dataset}/{shard}"),
    wildcard_constraints:
        step=quality_recipe.step_pattern("filters"),
    params:
        command="quality-filter-select",
        decision_flag="--signals",
        settings=get_filter_settings,


# The language step: fastText's scores once per input and model sha256, then the recipe's
# languages and threshold applied to them per shard
rule compute_language_scores:
    input:
        documents=get_scores_input,
        model=get_language_model,
    output:
        paths.LANGUAGE_SCORES,
    log:
        paths.log("compute_language_scores", "{scores}/{dataset}/{shard}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        reader=get_scores_reader,
        on_bad=ON_BAD_DOCUMENT,
        sha256=get_language_sha256,
        where=get_scores_where,
    shell:
        "gptflow quality-language-scores --input {input.documents:q} {params.reader:q}"
        " --on-bad-document {params.on_bad:q} --model {input.model:q} --sha256 {params.sha256:q}"
        " --where {params.where:q} --out {output:q} > {log:q} 2>&1"


use rule remove_duplicates as select_language with:
    input:
        documents=get_step_input,
        origins=get_step_origins,
        decision=get_language_scores,
    log:
        paths.log("select_language", "{step}/{dataset}/{shard}"),
    wildcard_constraints:
        step=quality_recipe.step_pattern("language"),
    params:
        command="quality-language-select",
        decision_flag="--scores",
        settings=get_language_settings,


# The report's "Data quality" page: per recipe and step, documents and bytes in and out per
# dataset, the removed by reason with examples, minhash's cluster sizes (from the manifests)
rule report_data_quality:
    input:
        manifests=get_quality_manifests,
        groups=get_quality_group_stats,
    output:
        report(
            paths.QUALITY_PAGE,
            caption="../workflow/report/data_quality.rst",
            category="Data quality",
            labels={"content": "documents and bytes per step, removed documents, clusters"},
        ),
    log:
        paths.log("report_data_quality", "all"),
    conda:
        "../envs/gptflow.yaml"
    params:
        recipes=get_quality_report_recipes(),
    script:
        "../workflow/scripts/quality_report.py"
