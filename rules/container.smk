"""Container stage: envs/Dockerfile -> image -> enroot squashfs (Pyxis) or Apptainer SIF.

results/containers/gptflow-{hash}.* is named by the hash of the recipe (Dockerfile, install
script, package metadata, constraints, package source, base image, build args): an unchanged
recipe is never rebuilt, and a changed one reruns only training, the job that runs inside it.
Both jobs run where Snakemake runs (localrules): the image lives in that machine's docker or
podman storage, and the squashfs is made from it there.
"""


localrules:
    build_image,
    squash_image,


rule container:
    input:
        container_image_file,


rule build_image:
    output:
        "results/containers/gptflow-{hash}.json",
    log:
        "logs/build_image/{hash}.log",
    conda:
        "../envs/gptflow.yaml"
    params:
        args=get_build_image_args,
    shell:
        "gptflow build-image {params.args:q} --out {output:q} > {log:q} 2>&1"


rule squash_image:
    input:
        "results/containers/gptflow-{hash}.json",
    output:
        "results/containers/gptflow-{hash}.{format}",
    log:
        "logs/squash_image/{hash}.{format}.log",
    conda:
        "../envs/gptflow.yaml"
    params:
        args=get_squash_args,
    shell:
        "gptflow squash-image --image {input:q} --out {output:q} --format {wildcards.format:q}"
        " {params.args:q} > {log:q} 2>&1"
