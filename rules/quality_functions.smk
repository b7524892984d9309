"""Input functions of the data-quality stage's rules (rules/quality.smk, which includes this
file): a step's input (the shard, or the previous step's documents) and how to read it, a
deduplication group's shards in order, a shard's place in its group. The recipe and its
groups are gptflow.data.quality.recipe's (PLAN.quality, setup.smk)."""


def quality_step(wildcards):
    """The job's recipe step (its {dataset} and {step}, or its group's first dataset)."""
    dataset = wildcards.dataset if "dataset" in wildcards.keys() else group_datasets(wildcards)[0]
    return PLAN.quality_step[(dataset, wildcards.step)]


def step_source(dataset, shard, step):
    """(the file step `step` reads for a shard, its reader options): the collected shard
    first, then the previous step's JSONL documents."""
    if step.index == 1:
        raw = PLAN.datasets[dataset].shard(shard)
        return raw.input, raw.reader_args()
    before = PLAN.quality_key[(dataset, step.previous)]
    documents = paths.QUALITY_DOCUMENTS.format(step=before.name, dataset=dataset, shard=shard)
    return documents, ["--format", "jsonl", "--json-key", "text"]


def get_step_origins(wildcards):
    """The origins of a step's input documents (gptflow.data.quality.origins): the previous
    step's; none for the first step (its input is the collected shard)."""
    step = quality_step(wildcards)
    if step.index == 1:
        return []
    before = PLAN.quality_key[(wildcards.dataset, step.previous)]
    return paths.QUALITY_ORIGINS.format(
        step=before.name, dataset=wildcards.dataset, shard=wildcards.shard
    )


def signals_step(wildcards):
    """The filters step whose signals the job computes ({dataset}, {signals})."""
    return PLAN.signals_step[(wildcards.dataset, wildcards.signals)]


def get_signals_input(wildcards):
    return step_source(wildcards.dataset, wildcards.shard, signals_step(wildcards))[0]


def get_signals_reader(wildcards):
    return step_source(wildcards.dataset, wildcards.shard, signals_step(wildcards))[1]


def get_signals_tokenizer(wildcards):
    return signals_step(wildcards).settings["tokenizer"]


def get_filter_signals(wildcards):
    """A filters step's signals file for the job's shard."""
    name = quality_step(wildcards).signals_name
    return paths.FILTER_SIGNALS.format(
        signals=name, dataset=wildcards.dataset, shard=wildcards.shard
    )


def get_filter_settings(wildcards):
    """select_documents' flags: --rules and the recipe's rules and thresholds as JSON (one
    shell word, quoted)."""
    return ["--rules", json.dumps(quality_step(wildcards).settings["rules"], sort_keys=False)]


def scores_step(wildcards):
    """The language step whose scores the job computes ({dataset}, {scores})."""
    return PLAN.scores_step[(wildcards.dataset, wildcards.scores)]


def get_scores_input(wildcards):
    return step_source(wildcards.dataset, wildcards.shard, scores_step(wildcards))[0]


def get_scores_reader(wildcards):
    return step_source(wildcards.dataset, wildcards.shard, scores_step(wildcards))[1]


def get_language_model(wildcards):
    """The model file (an input: its sha256 is checked by the job, and at -n)."""
    return str(quality_recipe.language_model(scores_step(wildcards).settings))


def get_language_sha256(wildcards):
    return scores_step(wildcards).settings["sha256"]


def get_scores_where(wildcards):
    return scores_step(wildcards).where


def get_language_scores(wildcards):
    """A language step's scores file for the job's shard."""
    name = quality_step(wildcards).scores_name
    return paths.LANGUAGE_SCORES.format(
        scores=name, dataset=wildcards.dataset, shard=wildcards.shard
    )


def get_language_settings(wildcards):
    """select_language's flags: --languages CODE... --threshold T."""
    s = quality_step(wildcards).settings
    return ["--languages", *s["languages"], "--threshold", str(s["threshold"])]


def get_step_input(wildcards):
    return step_source(wildcards.dataset, wildcards.shard, quality_step(wildcards))[0]


def get_step_reader(wildcards):
    return step_source(wildcards.dataset, wildcards.shard, quality_step(wildcards))[1]


@functools.cache
def group_shards(step, group):
    """A group's shards in order, {(dataset, shard): ordinal}: datasets in blend order, then
    shards; the first copy in this order is kept."""
    datasets = step_group_members(step, group)
    places = [(d, s.name) for d in datasets for s in PLAN.datasets[d].shards]
    return {place: i for i, place in enumerate(places)}


def step_group_members(step, group):
    """A group's datasets, from the recipe (the base's or a study run's) that has the step:
    the recipes having it agree (quality_recipe.check_groups, setup.smk)."""
    for recipe in (PLAN.quality, *PLAN.run_quality.values()):
        members = quality_recipe.group_members(recipe, PLAN.blended, step, group)
        if members:
            return members
    return []


def group_datasets(wildcards):
    return step_group_members(wildcards.step, wildcards.group)


def group_files(pattern, wildcards):
    return [
        pattern.format(step=wildcards.step, dataset=d, shard=s)
        for d, s in group_shards(wildcards.step, wildcards.group)
    ]


def get_group_hashes(wildcards):
    return group_files(paths.EXACT_HASHES, wildcards)


def get_group_signatures(wildcards):
    return group_files(paths.MINHASH_SIGNATURES, wildcards)


def get_group_pairs(wildcards):
    bands = range(quality_step(wildcards).settings["bands"])
    return [
        paths.MINHASH_PAIRS.format(step=wildcards.step, group=wildcards.group, band=f"{b:03d}")
        for b in bands
    ]


def group_job_resources(job, wildcards, input, attempt):
    """gptflow.data.quality.sizing.group_resources of a deduplication group job, from its
    input files' sizes; a plan made before they exist shows <TBD> (the FileNotFoundError):
    Snakemake evaluates it again when it submits the job."""
    names = {"minhash_buckets": ["signatures"], "find_exact_repeats": ["hashes"]}
    sizes = {
        name: [os.path.getsize(f) for f in getattr(input, name)]
        for name in names.get(job, ["signatures", "pairs"])
    }
    settings = quality_step(wildcards).settings
    return quality_sizing.group_resources(
        job, sizes, settings.get("bands", 14), settings.get("rows", 8), attempt
    )


def get_buckets_mem_mb(wildcards, input, attempt):
    return group_job_resources("minhash_buckets", wildcards, input, attempt)["mem_mb"]


def get_buckets_runtime(wildcards, input, attempt):
    return group_job_resources("minhash_buckets", wildcards, input, attempt)["runtime"]


def get_clusters_mem_mb(wildcards, input, attempt):
    return group_job_resources("cluster_minhash_pairs", wildcards, input, attempt)["mem_mb"]


def get_clusters_runtime(wildcards, input, attempt):
    return group_job_resources("cluster_minhash_pairs", wildcards, input, attempt)["runtime"]


def get_repeats_mem_mb(wildcards, input, attempt):
    return group_job_resources("find_exact_repeats", wildcards, input, attempt)["mem_mb"]


def get_repeats_runtime(wildcards, input, attempt):
    return group_job_resources("find_exact_repeats", wildcards, input, attempt)["runtime"]


def get_minhash_settings(wildcards):
    """The signature settings as flags: --ngram N --bands B --rows R --seed S --tokenizer T."""
    s = quality_step(wildcards).settings
    return [f"--{k}={s[k]}" for k in ("ngram", "bands", "rows", "seed", "tokenizer")]


def get_minhash_rows(wildcards):
    return quality_step(wildcards).settings["rows"]


def get_band(wildcards):
    return int(wildcards.band)


def get_removed(wildcards):
    group = quality_step(wildcards).group(wildcards.dataset)
    return paths.QUALITY_REMOVED.format(step=wildcards.step, group=group)


def get_removal_settings(wildcards):
    """remove_duplicates' flags: --ordinal (the shard's place in its group) and --reason (what
    the manifest counts the removed as: the step's kind)."""
    step = quality_step(wildcards)
    ordinal = group_shards(wildcards.step, step.group(wildcards.dataset))[
        (wildcards.dataset, wildcards.shard)
    ]
    return ["--ordinal", str(ordinal), "--reason", step.kind]


@functools.cache
def cleaned_shard(dataset, shard, last):
    """What tokenization reads of a shard of a dataset with quality steps: its recipe's last
    step's documents (`last`: its name; the shard's name and files kept); once per shard, not
    per input function."""
    documents = paths.QUALITY_DOCUMENTS.format(step=last, dataset=dataset, shard=shard.name)
    return dataclasses.replace(
        shard, input=documents, fmt="jsonl", json_key="text", member="*", member_format=None
    )


def runs_by_recipe():
    """A data ablation's recipes, each with the runs cleaning with it: {recipe (its datasets'
    variants): [run names]}, in the runs' order."""
    runs = {}
    for name, variants in PLAN.run_variants.items():
        runs.setdefault(tuple(variants.values()), []).append(name)
    return runs


def collected_sizes():
    """{dataset with quality steps: (bytes of its collected shards, whether one is compressed
    or an archive), or None while one is not there}: the size of each step's copy, at -n."""
    out = {}
    for name in {name for name, _ in PLAN.quality_step}:
        total, compressed = 0, False
        for shard in PLAN.datasets[name].shards:
            path = Path(shard.input)
            if not path.is_file():
                total = None
                break
            total += path.stat().st_size
            kind, compression = READER_FORMATS.get(shard.fmt, ("", None))
            compressed |= compression is not None or kind in ("zip", "parquet")
        out[name] = None if total is None else (total, compressed)
    return out


def quality_plan_lines():
    """-n's lines: each recipe's steps and whether each will run (its manifests present), and
    the copies its steps write; a data ablation's recipes each once, after the runs that
    clean with it, and the base config's when no run trains on it (its shards are the
    held-out text: its steps run too), as the report's page shows them."""
    done = {
        (step.name, name): all(
            Path(
                paths.QUALITY_MANIFEST.format(step=step.name, dataset=name, shard=s.name)
            ).is_file()
            for s in PLAN.datasets[name].shards
        )
        for (name, _), step in PLAN.quality_step.items()
    }
    sizes = collected_sizes()
    if all(recipe is PLAN.quality for recipe in PLAN.run_quality.values()):
        return quality_recipe.plan_lines(PLAN.quality, done, sizes)
    lines = []
    runs = runs_by_recipe()
    for names in runs.values():
        lines.append(f"gptflow: study runs {', '.join(names)}:")
        recipe = PLAN.run_quality[names[0]]
        lines += (
            quality_recipe.plan_lines(recipe, done, sizes)
            if recipe
            else ["  no data quality steps"]
        )
    if PLAN.quality and tuple(PLAN.base_variants.values()) not in runs:
        lines.append("gptflow: the base config (the held-out text):")
        lines += quality_recipe.plan_lines(PLAN.quality, done, sizes)
    return lines


def get_quality_manifests(wildcards):
    """Every step's shard manifests, of every recipe (a data ablation's runs' too)."""
    return [
        paths.QUALITY_MANIFEST.format(step=step.name, dataset=name, shard=shard.name)
        for (name, _), step in PLAN.quality_step.items()
        for shard in PLAN.datasets[name].shards
    ]


def get_quality_group_stats(wildcards):
    """The deduplication groups' counts (minhash's hold its cluster sizes)."""
    groups = {
        (step.name, step.group(name))
        for (name, _), step in PLAN.quality_step.items()
        if step.kind in ("exact", "minhash")
    }
    return sorted(paths.QUALITY_GROUP_STATS.format(step=s, group=g) for s, g in groups)


def get_quality_report_recipes():
    """The page's recipes, each [label, {dataset: [{name, describe}]}]: the config's (label
    None); in a data ablation each recipe with steps once, labelled by the runs cleaning with
    it, and the base config's when no run trains on it (its shards are the held-out text)."""

    def steps_of(recipe):
        return {
            name: [{"name": s.name, "describe": s.describe()} for s in steps]
            for name, steps in recipe.items()
        }

    if all(recipe is PLAN.quality for recipe in PLAN.run_quality.values()):
        return [[None, steps_of(PLAN.quality)]]
    runs = runs_by_recipe()
    out = [
        [f"study runs {', '.join(names)}", steps_of(PLAN.run_quality[names[0]])]
        for names in runs.values()
        if PLAN.run_quality[names[0]]
    ]
    if PLAN.quality and tuple(PLAN.base_variants.values()) not in runs:
        out.append(["the base config (the held-out text)", steps_of(PLAN.quality)])
    return out
