"""gptflow: raw text -> Megatron shards -> a trained GPT-NeoX checkpoint, cached and resumable.

snakemake --profile profiles/local            # this machine
snakemake --profile profiles/slurm train      # a Slurm cluster
snakemake -n                                  # the plan, with a reason for every job
"""

from snakemake.utils import min_version

min_version("9.19")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "rules/snakemake_patches.smk"
include: "rules/setup.smk"
include: "rules/common.smk"
include: "rules/download.smk"
include: "rules/quality.smk"
include: "rules/tokenize.smk"
include: "rules/train.smk"
include: "rules/container.smk"
include: "rules/evaluate.smk"
include: "rules/study.smk"
include: "rules/autotune.smk"


onstart:
    refuse_placeholders()


onsuccess:
    record_config()


onerror:
    record_refused_submissions(log)


rule all:
    default_target: True
    input:
        get_final_outputs(),
