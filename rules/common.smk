"""Config validation and the helpers rules call; every rule-level computation lives here."""

import functools
import json
import os
import re
import shlex
from pathlib import Path

from snakemake.exceptions import IncompleteCheckpointException, WorkflowError
from snakemake.logging import logger

from gptflow import init_from, preflight, submission, why
from gptflow.workflow_config import load_workflow_config
from gptflow.schema import load_yaml
from gptflow.data import sources
from gptflow.environment import put_interpreter_bin_first
from gptflow.errors import GptflowError

REPO = Path(workflow.basedir)
SCHEMA = REPO / "config" / "schema" / "config.schema.yaml"
CATALOG = REPO / "config" / "datasets.yaml"
put_interpreter_bin_first()  # jobs run the `gptflow` installed beside this Snakemake
CONFIG_SOURCE = " + ".join(str(p) for p in workflow.configfiles) or "--config"

try:
    CFG = load_workflow_config(
        config,
        schema_path=SCHEMA,
        models_dir=REPO / "config" / "models",
        source=CONFIG_SOURCE,
        config_files=[str(p) for p in workflow.configfiles],
    )
except GptflowError as e:
    raise WorkflowError(f"gptflow config: {e}") from None


# `gptflow why`: its dry run asks for the config this plan uses (gptflow.why.DUMP_ENV)
why.dump_config(CFG)


def record_config():
    """Snakefile onsuccess: the config `gptflow why` compares the next plan against."""
    why.record_config(CFG)


def profile_value(rule, name):
    """A resource the profile gives `rule` (set-resources, else default-resources) as the
    plugin will read it; None when unset or a function of the job (known when it runs)."""
    settings = workflow.resource_settings
    resource = (settings.overwrite_resources.get(rule) or {}).get(name)
    if resource is not None:
        try:
            return resource.evaluate(
                wildcards=None, input=None, attempt=1, threads=1, rulename=rule, async_run=None
            ).value
        except Exception:  # an expression of the job's wildcards or inputs
            return None
    for arg in getattr(settings.default_resources, "args", None) or []:
        key, _, value = arg.partition("=")
        if key == name:
            value = value.strip("'\"")
            return int(value) if value.isdigit() else value
    return None


def profile_placement():
    """Where the profile puts train_gpt (gptflow.preflight.Placement)."""
    threads = (workflow.resource_settings.overwrite_threads or {}).get("train_gpt")

    def number(name):
        value = profile_value("train_gpt", name)
        return value if isinstance(value, int) else None

    settings = [
        ("default-resources slurm_account", profile_value("all", "slurm_account")),
        ("default-resources slurm_partition", profile_value("all", "slurm_partition")),
        ("set-resources train_gpt slurm_partition", profile_value("train_gpt", "slurm_partition")),
    ]
    return preflight.Placement(
        executor="slurm" if profile_value("train_gpt", "slurm_partition") else "local",
        nodes=number("nodes"),
        tasks_per_node=number("tasks_per_node"),
        tasks=number("tasks"),
        gres=profile_value("train_gpt", "gres"),
        threads=threads.value if threads is not None else None,
        cpus_per_task=number("cpus_per_task"),
        mem_mb=number("mem_mb"),
        partition=profile_value("train_gpt", "slurm_partition"),
        mpi=str(profile_value("train_gpt", "mpi") or ""),
        gpu_mem_mb=number("gpu_mem_mb"),
        settings=tuple((k, str(v)) for k, v in settings if v is not None),
    )


def record_refused_submissions(log):
    """Snakefile onerror: a job Slurm never ran gets the refusal in the log it points at."""
    for path in [log] if isinstance(log, str) else log or []:
        submission.record_refusals(path)


def refuse_placeholders():
    """Snakefile onstart (a real run, never -n): an unedited profile is not submitted."""
    found = preflight.placeholders(PLACEMENT)
    if found and workflow.executor_plugin and workflow.executor_plugin.name == "slurm":
        raise WorkflowError(
            f"gptflow: not submitted: {preflight.placeholder_message(found, 'the profile')}"
        )


RUN = CFG["run"]
TOKENIZER = CFG["tokenizer"]["name"]
BLENDED = [item["dataset"] for item in CFG["data"]["blend"]]
TOKENIZER_SOURCE = CFG["tokenizer"]["source"]


def needed_datasets():
    names = list(BLENDED)
    if TOKENIZER_SOURCE == "train":
        names += [n for n in CFG["tokenizer"]["train"]["datasets"] if n not in names]
    return names


# Datasets are resolved once, here (catalog, globs, URL templates), so that a glob matching
# nothing or an unknown catalog entry stops the workflow before any job.
try:
    DATASETS = sources.resolve_datasets(
        CFG,
        needed_datasets(),
        catalog_path=CATALOG,
        schema=load_yaml(SCHEMA),
        source=CONFIG_SOURCE,
    )
except GptflowError as e:
    raise WorkflowError(f"gptflow config: {e}") from None


wildcard_constraints:
    dataset="|".join(re.escape(d) for d in DATASETS) or "-",
    shard=r"\d{5}",
    part=r"\d{4}",
    run=re.escape(RUN),
    tokenizer=re.escape(TOKENIZER),
    file=sources.STORED_NAME.pattern + r"(?<!\.sha256)(?<!\.part)(?<!\.lock)",
    hash=r"[0-9a-f]{12}",
    format="sqsh|sif",


# --------------------------------------------------------------------------- datasets


def shard_of(wildcards):
    return DATASETS[wildcards.dataset].shard(wildcards.shard)


def datasets_of_kind(kind):
    return [name for name, d in DATASETS.items() if d.kind == kind]


def dataset_choice(names):
    """A {dataset} wildcard constraint matching exactly `names` ('-' is no dataset's name)."""
    return "|".join(re.escape(d) for d in names) or "-"


# Datasets whose shards are imported (type megatron: import_megatron_shard) and those whose
# shards are tokenized here; each rule that writes results/tokens/ takes only its own.
IMPORTED = datasets_of_kind("megatron")
TOKENIZED = [name for name in DATASETS if name not in IMPORTED]


def imported_shard_choice():
    """The {shard} constraint of import_megatron_shard: the megatron shards' names."""
    names = {s.name for name in IMPORTED for s in DATASETS[name].shards}
    return "|".join(re.escape(n) for n in sorted(names)) or "-"


def get_megatron_shard_files(wildcards):
    """The .bin and .idx a megatron shard is imported from (the user's files)."""
    prefix = shard_of(wildcards).input
    return {"bin": f"{prefix}.bin", "idx": f"{prefix}.idx"}


def get_megatron_prefix(wildcards):
    return shard_of(wildcards).input


def get_local_shard_stamps(wildcards):
    """[path, bytes, mtime ns] of each file of a local shard (collect_local_documents)."""
    stamps = []
    for path in shard_of(wildcards).files:
        st = os.stat(path)
        stamps.append([path, st.st_size, st.st_mtime_ns])
    return stamps


def get_local_root(wildcards):
    return DATASETS[wildcards.dataset].root


def get_remote_file(wildcards):
    """The catalog/url entry of resources/raw/{dataset}/{file}."""
    remote = DATASETS[wildcards.dataset].remote_files.get(wildcards.file)
    if remote is None:
        raise WorkflowError(f"{wildcards.file} is not a file of dataset {wildcards.dataset}")
    return remote


def get_download_args(wildcards):
    """Mirrors, checksum and token options of one dataset file for `gptflow download`
    (argv words: the rule quotes each)."""
    remote = get_remote_file(wildcards)
    d = DATASETS[wildcards.dataset]
    args = [word for m in remote.urls[1:] for word in ("--mirror", m)]
    if remote.sha256:
        args += ["--sha256", remote.sha256]
    if d.token_env:  # the variable's name; the job reads the token from its environment
        args += ["--token-env", d.token_env]
        args += [word for o in d.token_origins for word in ("--token-origin", o)]
        if d.token_allow_http:
            args.append("--token-allow-http")
    return args


def get_download_url(wildcards):
    return get_remote_file(wildcards).urls[0]


def get_shard_input(wildcards):
    return shard_of(wildcards).input


def get_reader_args(wildcards):
    return shard_of(wildcards).reader_args()


def shard_prefix(dataset, shard):
    return f"results/tokens/{TOKENIZER}/{dataset}/{shard}"


DOCUMENTS_PER_SHARD = CFG["tokenize"]["documents_per_shard"]


def dataset_shards(dataset):
    """(token prefixes of a dataset in order, count files still to be made).

    One prefix per input (or imported shard); with tokenize.documents_per_shard one per part
    of each input to tokenize, known once checkpoint count_documents has counted it. Inputs not counted yet are returned as
    their count files instead of raising, so all counts are planned at once (a raise would plan
    one per DAG update) and the jobs that take them as input are re-planned as each finishes.
    """
    if not DOCUMENTS_PER_SHARD or dataset in IMPORTED:
        return [shard_prefix(dataset, s.name) for s in DATASETS[dataset].shards], []
    prefixes, pending = [], []
    for s in DATASETS[dataset].shards:
        try:
            counted = checkpoints.count_documents.get(dataset=dataset, shard=s.name).output[0]
        except IncompleteCheckpointException as e:
            pending.append(e.targetfile)
            continue
        with open(counted) as f:
            parts = max(1, -(-json.load(f)["documents"] // DOCUMENTS_PER_SHARD))
        prefixes += [shard_prefix(dataset, f"{s.name}-{part:04d}") for part in range(parts)]
    return prefixes, pending


def dataset_prefixes(dataset):
    return dataset_shards(dataset)[0]


def dataset_files(dataset):
    """What a job reading a dataset's shards takes as input (pending count files included)."""
    prefixes, pending = dataset_shards(dataset)
    return [f"{p}{ext}" for p in prefixes for ext in (".bin", ".idx", ".json")] + pending


def get_part_documents(wildcards):
    """`--documents START:STOP` of one part (the last part's STOP may pass the end)."""
    start = int(wildcards.part) * DOCUMENTS_PER_SHARD
    return f"{start}:{start + DOCUMENTS_PER_SHARD}"


def get_blend_prefixes(wildcards):
    return {name: dataset_prefixes(name) for name in BLENDED}


def get_blend_shard_files(wildcards):
    return [f for name in BLENDED for f in dataset_files(name)]


def get_dataset_shard_prefixes(wildcards):
    return dataset_prefixes(wildcards.dataset)


def get_dataset_shard_files(wildcards):
    return dataset_files(wildcards.dataset)


def get_merged_files(wildcards):
    """tokenize.merge's merged shards; not of imported datasets (a merge would copy them)."""
    if not CFG["tokenize"]["merge"]:
        return []
    return [
        f"results/tokens/{TOKENIZER}/{name}/merged{ext}"
        for name in BLENDED
        if name not in IMPORTED
        for ext in (".bin", ".idx", ".json")
    ]


def get_append_eod_flag(wildcards):
    return ["--append-eod"] if CFG["tokenize"]["append_eod"] else []


# --------------------------------------------------------------------------- tokenizer


def tokenizer_json():
    return f"results/tokenizers/{TOKENIZER}/tokenizer.json"


# model.init_from's tokenizer against the run's at -n, when the run's exists already
# (tokenizer.path, or made by an earlier run); render_run_config checks it in any case
try:
    init_from.check_planned_tokenizer(CFG, tokenizer_json())
except GptflowError as e:
    raise WorkflowError(f"gptflow config ({CONFIG_SOURCE}): {e}") from None


def get_eod_token(wildcards):
    return CFG["tokenizer"]["eod_token"]


def get_special_tokens(wildcards):
    """Through a function: Snakemake would read "{...}" in a params string as a wildcard."""
    return CFG["tokenizer"]["special_tokens"]


def get_sample_inputs(wildcards):
    return [s.input for s in DATASETS[wildcards.dataset].shards]


def get_sample_reader_args(wildcards):
    """Reader options for sampling a dataset (its shards share one reader setting)."""
    return DATASETS[wildcards.dataset].shards[0].reader_args()


def get_sample_mb(wildcards):
    return CFG["tokenizer"]["train"]["sample_mb"] / len(CFG["tokenizer"]["train"]["datasets"])


def get_tokenizer_samples(wildcards):
    return [
        f"results/tokenizers/{TOKENIZER}/samples/{name}.jsonl"
        for name in CFG["tokenizer"]["train"]["datasets"]
    ]


def tokenizer_remote(key):
    """tokenizer.url / .vocab / .merges: (stored file name, spec)."""
    spec = CFG["tokenizer"][key]
    if not spec.get("url"):
        return Path(spec["path"]).name, spec
    try:
        return sources.tokenizer_file_name(key, spec, CONFIG_SOURCE), spec
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: {e}") from None


def tokenizer_asset(key):
    """Where tokenizer file `key` comes from: downloaded into resources/, or a path on disk."""
    name, spec = tokenizer_remote(key)
    if spec.get("url"):
        return f"resources/tokenizers/{TOKENIZER}/{key}/{name}"
    return spec["path"]


def get_tokenizer_download(wildcards):
    _, spec = tokenizer_remote(wildcards.key)
    args = [spec["url"]]
    args += [word for m in spec.get("mirrors", []) for word in ("--mirror", m)]
    if spec.get("sha256"):
        args += ["--sha256", spec["sha256"]]
    return args


def get_tokenizer_file(wildcards):
    if TOKENIZER_SOURCE == "url":
        return tokenizer_asset("url")
    return CFG["tokenizer"]["path"]


# --------------------------------------------------------------------------- training


def run_dir():
    return f"results/runs/{RUN}"


def get_init_from_files(wildcards):
    """model.init_from's config, index, tokenizer and weights: run.yaml records their identity,
    so a changed file renders it again."""
    path = CFG["model"].get("init_from")
    return init_from.input_files(path) if path else []


def get_run_settings(wildcards):
    """What run.yaml is rendered from: a change here re-renders it (and so reruns training)."""
    return {
        "run": CFG["run"],
        "tokenizer": {"eod_token": CFG["tokenizer"]["eod_token"]},
        "data": CFG["data"],
        "model": CFG["model"],
        "train": CFG["train"],
    }


def get_train_hyperparameters(wildcards):
    """Model and optimisation settings; Snakemake reruns training when one changes."""
    return {"model": CFG["model"], "train": CFG["train"], "data": CFG["data"]}


def get_train_threads(wildcards):
    """All local cores on one machine; on a cluster (no --cores) the profile's set-threads."""
    try:
        return workflow.cores
    except WorkflowError:
        return 1


def get_train_launcher(wildcards, resources, threads):
    """Argv words before `gptflow train`: none on one machine; under the Slurm profile
    (resources mpi="srun", nodes, tasks_per_node, ...) the srun that starts one training task
    per GPU. With the container enabled, Pyxis flags on that srun (sqsh) or `apptainer exec
    --nv IMAGE` (sif)."""
    from gptflow.distributed import srun_command

    def res(name):
        value = getattr(resources, name, None)
        return value if isinstance(value, int) and value > 0 else None

    mpi = str(getattr(resources, "mpi", "") or "")
    pyxis, prefix = [], []
    if CONTAINER["enabled"]:
        from gptflow.container import container_launch

        try:
            pyxis, prefix = container_launch(
                CONTAINER["format"],
                os.path.abspath(container_image_file()),
                os.getcwd(),
                CONTAINER["mounts"],
                srun=bool(mpi),
            )
        except GptflowError as e:
            raise WorkflowError(f"gptflow config: {e}") from None
    launcher = srun_command(
        mpi,
        nodes=res("nodes"),
        tasks_per_node=res("tasks_per_node"),
        tasks=res("tasks"),
        # the CPUs of a rank: the rule's threads (the profile's set-threads), as sbatch's
        cpus_per_task=res("cpus_per_task") or threads,
        container_options=pyxis,
    )
    return launcher + prefix


def get_final_outputs():
    return [
        f"{run_dir()}/DONE.json",
        f"{run_dir()}/eval.json",
        f"{run_dir()}/hf",
        f"{run_dir()}/report/card.html",
    ]


def get_report_datasets(wildcards):
    """Where each blended dataset comes from, for the data card."""
    return {name: CFG["datasets"][name] for name in BLENDED}


def get_train_container_record(wildcards):
    """The image record (tag, image id) of the image training ran in, or nothing."""
    if not CONTAINER["enabled"]:
        return []
    return [f"results/containers/gptflow-{container_hash()}.json"]


def get_eval_args(wildcards):
    e = CFG["eval"]
    args = [f"--prompt={p}" for p in e["prompts"]]  # a prompt may start with "-"
    args += [
        word
        for name, prefixes in e["extra"].items()
        for prefix in prefixes
        for word in ("--extra", name, prefix)
    ]
    return args + ["--new-tokens", str(e["new_tokens"]), "--max-windows", str(e["max_windows"])]


def get_eval_extra_files(wildcards):
    return [
        f"{prefix}{ext}"
        for prefixes in CFG["eval"]["extra"].values()
        for prefix in prefixes
        for ext in (".bin", ".idx")
    ]


def get_eval_mem_mb(wildcards, input):
    """Memory of the evaluate job (MB), from the run's model (gptflow.evaluate.memory_mb):
    its fp32 weights, a batch of logits and 2 GiB. A plan made before run.yaml exists shows
    <TBD> (Snakemake's answer to a FileNotFoundError naming an input)."""
    from gptflow.run_config import RunConfig
    from gptflow.evaluate import memory_mb

    open(input.config).close()
    cfg = RunConfig.load(input.config)
    return memory_mb(cfg.model, cfg.train.seq_length)


# --------------------------------------------------------------------------- container

CONTAINER = CFG["container"]


def container_dockerfile():
    path = Path(CONTAINER["dockerfile"])
    return path if path.is_absolute() else REPO / path


@functools.cache
def container_hash():
    """The recipe hash that names the image (read from the files, a few ms); computed only
    when a job needs the image, so a workflow without the container never reads the recipe."""
    from gptflow.container import recipe_hash

    try:
        return recipe_hash(
            REPO, container_dockerfile(), CONTAINER["base_image"], CONTAINER["build_args"]
        )
    except GptflowError as e:
        raise WorkflowError(f"gptflow config: container: {e}") from None


def container_image_file(wildcards=None):
    return f"results/containers/gptflow-{container_hash()}.{CONTAINER['format']}"


def get_build_image_args(wildcards):
    args = [
        *("--repo", str(REPO)),
        *("--dockerfile", str(container_dockerfile())),
        *("--builder", CONTAINER["builder"]),
        *("--base-image", CONTAINER["base_image"]),
    ]
    args += [w for k, v in CONTAINER["build_args"].items() for w in ("--build-arg", f"{k}={v}")]
    args += [f"--build-option={o}" for o in CONTAINER["build_options"]]
    args += [
        word
        for r in CONTAINER["registry_login"]
        for word in ("--registry-login", r["server"], r["username"], r["password_env"])
    ]
    return args


def get_squash_args(wildcards):
    return [
        *("--method", CONTAINER["squash"]),
        f"--squash-options={shlex.join(CONTAINER['squash_options'])}",
    ]


def get_train_container(wildcards):
    """The image training runs in (an input of train_gpt), or nothing."""
    return [container_image_file()] if CONTAINER["enabled"] else []


# The preflight, in the main process only (a job's own Snakemake parses this file too): what
# would fail on the cluster is refused here, before any job waits in the queue.
PLACEMENT = profile_placement()
if workflow.is_main_process:
    try:
        PREFLIGHT = preflight.run(
            CFG,
            PLACEMENT,
            tokenizer_json=Path(tokenizer_json()),
            datasets=DATASETS,
            tokens_dir=Path(f"results/tokens/{TOKENIZER}"),
            runtimes={
                "default-resources runtime": profile_value("all", "runtime"),
                "set-resources train_gpt runtime": profile_value("train_gpt", "runtime"),
            },
            config_threads=dict.fromkeys(
                ("tokenize_shard", "tokenize_part"), CFG["tokenize"]["workers"]
            ),
            profile_threads={
                name: threads.value
                for name, threads in (workflow.resource_settings.overwrite_threads or {}).items()
            },
        )
    except GptflowError as e:
        raise WorkflowError(f"gptflow preflight ({CONFIG_SOURCE} and the profile): {e}") from None
    for line in PREFLIGHT.lines:
        logger.info(line)
    why.dump_preflight(PREFLIGHT)
