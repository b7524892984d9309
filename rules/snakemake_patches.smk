"""Six patches of Snakemake's internals that make a plan of thousands of jobs cost what plain
rules cost (bench/plan.py: 1.20-1.30x plain Snakemake at 1,000 and 10,000 parts), each
measured on Snakemake 9.27.1 (the version pyproject.toml pins) and written so it could be
offered upstream: each says what Snakemake repeats, what the patch does once instead, and what
that saves; each keeps Snakemake's behaviour (the plans are the same: bench/plan.py and
tests/workflow/test_plan_cost.py count each patch's effect and fail without it) and is
applied once per process (a job's own Snakemake parses the Snakefile again).

Plain Python, no rules: tests/unit/test_snakemake_patches.py loads the functions from this
file (runpy) without applying them; the Snakefile includes it, which applies them all."""

SNAKEMAKE_MEASURED = "9.27.1"


def read_signatures_once():
    """Snakemake reads the signature of every input, params and resources function
    (inspect.signature, tens of microseconds) twice each time it calls one, and it calls several
    per job: a third of what a plan of 1,000 parts paid beyond plain rules' CPU time
    (bench/plan.py, --profile). A function's signature does not change, so each is read once:
    every binding of snakemake.common.get_function_params gets a cached one (the same mapping
    it returns). Which of a call's arguments (input, output, threads, ...) a function takes
    is read from it the same way each call (get_input_function_aux_params: a walk over its
    parameters, 11 calls a part, 15 with its download): it is read once per function too."""
    import sys

    import snakemake.common

    read = snakemake.common.get_function_params
    if getattr(read, "reads_once", False):
        return  # a second parse in this process (a job's own Snakemake, a test's API calls)
    known = {}

    def get_function_params(func):
        try:
            return known[func]
        except KeyError:
            known[func] = found = read(func)
            return found
        except TypeError:  # an unhashable callable: read every time, as Snakemake does
            return read(func)

    select = snakemake.common.get_input_function_aux_params
    takes = {}  # a function's parameter names, or None where it takes **kwargs (every one)

    def get_input_function_aux_params(func, candidate_params):
        try:
            names = takes[func]
        except KeyError:
            params = get_function_params(func).values()
            keywords = any(p.kind == p.VAR_KEYWORD for p in params)
            names = takes[func] = None if keywords else frozenset(p.name for p in params)
        except TypeError:  # an unhashable callable: as Snakemake does
            return select(func, candidate_params)
        if names is None:
            return candidate_params
        return {k: v for k, v in candidate_params.items() if k in names}

    get_function_params.reads_once = True
    patched = {"get_function_params": (read, get_function_params)}
    patched["get_input_function_aux_params"] = (select, get_input_function_aux_params)
    for name, loaded in list(sys.modules.items()):  # (`module` is a Snakemake keyword)
        if not name.startswith("snakemake"):
            continue
        for attribute, (original, once) in patched.items():
            if getattr(loaded, attribute, None) is original:
                setattr(loaded, attribute, once)


def format_commands_once():
    """A dry run prints each job with its shell command, which Snakemake formats three times
    to print it once (snakemake.jobs.Job.log_info: the event's field, the line and the line's
    field). gptflow's commands have a dozen quoted fields each: the two formats more were
    8 % of a plan's time at 2,000 parts (bench/plan.py --profile). Nothing a command is
    formatted from changes during a dry run, so there each job's is formatted once; a real
    run formats it whenever asked, as Snakemake does (a retry's resources may differ)."""
    import snakemake.jobs

    job_class = snakemake.jobs.Job
    formatted = job_class.shellcmd.fget
    if getattr(formatted, "formats_once", False):
        return  # a second parse in this process

    def shellcmd(job):
        if not job.dag.workflow.dryrun:
            return formatted(job)
        try:
            return job.__dict__["gptflow_shellcmd"]
        except KeyError:
            command = job.__dict__["gptflow_shellcmd"] = formatted(job)
            return command

    shellcmd.formats_once = True
    job_class.shellcmd = property(shellcmd, doc=job_class.shellcmd.__doc__)


def check_scripts_once():
    """Snakemake checks that a `script:` rule's file is there by reading it for every job it
    plans (snakemake.dag.ScriptProcessor: a path may hold wildcards). Ours hold none, so a
    rule's file is read once per plan: N collect jobs read it once, not N times."""
    import snakemake.dag

    processor = snakemake.dag.ScriptProcessor
    process = processor.process_job
    if getattr(process, "checks_once", False):
        return
    checked = set()

    def process_job(self, job):
        key = (type(self), job.rule)
        if key in checked:
            return
        process(self, job)
        script = getattr(job.rule, self.script_type, None)
        if script is not None and "{" not in str(script):
            checked.add(key)

    process_job.checks_once = True
    processor.process_job = process_job


def build_wildcards_once():
    """Snakemake builds a new Wildcards object (a Namedlist: ~10 us here) for every input,
    params and resources function it calls (snakemake.rules.Rule.apply_input_function), with
    the same values for every function of a job: 5 a tokenize job, 2 a collect job, 6 a
    download job. Equal values give an equal object, so one is built per job's values and
    handed to each of its functions (ours only read it); Snakemake's own Job.wildcards stays
    its own. Only the rules module's binding is replaced (apply_input_function is its one
    caller); the most recent 4,096 values are kept (a plan expands a job's functions
    together)."""
    import snakemake.rules

    build = snakemake.rules.Wildcards
    if getattr(build, "builds_once", False):
        return  # a second parse in this process
    built = {}

    def wildcards_of(toclone=None, fromdict=None, **options):
        if toclone is not None or fromdict is None or options:
            return build(toclone, fromdict, **options)
        key = tuple(fromdict.items())
        try:
            return built[key]
        except KeyError:
            if len(built) >= 4096:
                built.clear()
            built[key] = found = build(fromdict=fromdict)
            return found
        except TypeError:  # an unhashable value: built every time, as Snakemake does
            return build(fromdict=fromdict)

    wildcards_of.builds_once = True
    snakemake.rules.Wildcards = wildcards_of


def find_inputs_by_set(least=64):
    """For each input file of each job and each job that could make it, Snakemake's DAG checks
    that the file is not among the maker's own inputs (snakemake.dag.DAG.update: `file in
    job.input`, a scan of the list). A job taking every shard's file whose output every shard's
    job takes -- data.quality's find_exact_repeats, read by each shard's remove_duplicates --
    makes that N x N comparisons: 4.2 million at 2,000 parts, 10^8 at 10,000. So membership in
    a job's inputs, from `least` files on, is a lookup in a set of them, built at the first
    question and dropped when the list changes (a file's hash and equality are its path's, as
    the list's scan compares them; an unhashable item: the scan)."""
    from snakemake.iocontainers import InputFiles

    if getattr(InputFiles, "finds_by_set", False):
        return  # a second parse in this process
    scan = InputFiles.__contains__

    def __contains__(self, item):
        if len(self) < least:
            return scan(self, item)
        try:
            members = self.__dict__.get("_members_once")
            if members is None:
                members = self.__dict__["_members_once"] = frozenset(self)
            return item in members
        except TypeError:
            return scan(self, item)

    def dropping(name):
        change = getattr(InputFiles, name)

        def changed(self, *args, **kwargs):
            self.__dict__.pop("_members_once", None)
            return change(self, *args, **kwargs)

        return changed

    for name in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse",
                 "__setitem__", "__delitem__", "__iadd__", "__imul__"):  # fmt: skip
        setattr(InputFiles, name, dropping(name))
    InputFiles.__contains__ = __contains__
    InputFiles.finds_by_set = True


def collect_garbage_rarely(threshold=100_000):
    """Python's cyclic garbage collector walks the young objects every 700 allocations, the
    survivors of ten such walks again, and every tenth of those the whole heap (Snakemake's DAG
    included) once it has grown by a quarter. A plan allocates millions of objects and frees
    almost no cycles: at 10,000 parts (20,009 jobs) it spent 5.1 of its 18.7 CPU seconds
    collecting (gc.callbacks; plain rules of as many jobs: 2.6 of 12.7). A young walk every
    `threshold` allocations instead: 1.2 of 14.7 s. At most that many young objects wait for
    their walk (a few MB; the plan's peak RSS 598 -> 600 MB); the older generations' ratios
    stay. Only ever raised: a process that set a higher threshold keeps it."""
    import gc

    young, *older = gc.get_threshold()
    if 0 < young < threshold:
        gc.set_threshold(threshold, *older)


def apply_all():
    """Every patch, in this process (each returns at once when it is applied already)."""
    read_signatures_once()
    format_commands_once()
    check_scripts_once()
    build_wildcards_once()
    find_inputs_by_set()
    collect_garbage_rarely()


if "workflow" in globals():  # included by the Snakefile, not loaded by a test
    apply_all()
