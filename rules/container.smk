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
        paths.IMAGE_RECORD,
    log:
        paths.log("build_image", "{hash}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        repo=verbatim(str(REPO)),
        dockerfile=verbatim(str(container_dockerfile())),
        builder=PLAN.container_config["builder"],
        base_image=verbatim(PLAN.container_config["base_image"]),
        build_args=verbatim(build_arg_args(PLAN.container_config["build_args"])),
        build_options=verbatim(build_option_args(PLAN.container_config["build_options"])),
        registry_login=verbatim(registry_login_args(PLAN.container_config["registry_login"])),
    shell:
        "gptflow build-image --repo {params.repo:q} --dockerfile {params.dockerfile:q}"
        " --builder {params.builder:q} --base-image {params.base_image:q}"
        " {params.build_args:q} {params.build_options:q} {params.registry_login:q}"
        " --out {output:q} > {log:q} 2>&1"


rule squash_image:
    input:
        paths.IMAGE_RECORD,
    output:
        paths.IMAGE,
    log:
        paths.log("squash_image", "{hash}.{format}"),
    conda:
        "../envs/gptflow.yaml"
    params:
        method=PLAN.container_config["squash"],
        squash_options=verbatim(squash_options_arg(PLAN.container_config["squash_options"])),
    shell:
        "gptflow squash-image --image {input:q} --out {output:q} --format {wildcards.format:q}"
        " --method {params.method:q} {params.squash_options:q} > {log:q} 2>&1"
