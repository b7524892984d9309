"""Input functions of the download stage's rules (rules/download.smk, which includes this file):
what a download job fetches, its mirrors, checksum and token scope."""


def get_remote_file(wildcards):
    """What a download job fetches: tokenizer file {key}, or file {file} of {dataset}."""
    if "key" in wildcards.keys():
        return tokenizer_remote(wildcards.key)
    remote = PLAN.datasets[wildcards.dataset].remote_files.get(wildcards.file)
    if remote is None:
        raise WorkflowError(f"{wildcards.file} is not a file of dataset {wildcards.dataset}")
    return remote


def get_download_url(wildcards):
    return get_remote_file(wildcards).urls[0]


def get_download_mirrors(wildcards):
    return get_remote_file(wildcards).mirror_args()


def get_download_sha256(wildcards):
    return get_remote_file(wildcards).sha256_args()


def get_token_env(wildcards):
    return PLAN.datasets[wildcards.dataset].token_env_args()


def get_token_origins(wildcards):
    return PLAN.datasets[wildcards.dataset].token_origin_args()


def get_token_allow_http(wildcards):
    return PLAN.datasets[wildcards.dataset].token_allow_http_args()
