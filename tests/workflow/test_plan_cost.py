"""What a plan pays per job, where Snakemake repeats work for each job that rules/snakemake_patches.smk
does once: it reads an input, params or resources function's signature (inspect.signature)
twice each time it calls one, several times per job (read_signatures_once); it formats a
job's shell command three times to print it once in a dry run (format_commands_once); it
reads a `script:` rule's file for every job to see that it is there (check_scripts_once); it
walks a function's parameters at each call to see which arguments it takes
(read_signatures_once: once per function, counted as reads of Parameter.kind).
Counted in one real `snakemake -n` of 300 local files (600 collect and tokenize jobs):
without them over 10,000 signature reads, three formats per shell job and one script read
per collect job; with them a few hundred reads (most of them libraries' own at import), one
format per shell job and a read per script rule. It builds a Wildcards object for each of
those function calls, the same values for every function of a job (build_wildcards_once:
one per job's values), and Python's garbage collector walks the objects the plan keeps
every 700 allocations (collect_garbage_rarely: every 100,000). With data.quality, each shard's
removal job takes the output of one job that takes every shard's hashes, and the DAG checks
the file against that job's inputs, a list (find_inputs_by_set: a set)."""

import ast
import re
import subprocess
import sys

from tests.workflow.conftest import snakemake_cmd

COUNTING = """
import atexit, collections, gc, inspect, sys
import snakemake.iocontainers, snakemake.jobs, snakemake.script
calls = collections.Counter()
def collected(phase, info):  # collections while the DAG is built (from its first job on)
    if phase == "start" and calls["Wildcards"]:
        calls["collections"] += 1
gc.callbacks.append(collected)
def counted(owner, name):
    original = getattr(owner, name)
    def count(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)
    setattr(owner, name, count)
counted(inspect, "signature")
counted(snakemake.jobs.Job, "format_wildcards")
counted(snakemake.script, "get_source")
import snakemake.io
same = snakemake.io._IOFile.__eq__
def same_counted(self, other):  # while the DAG is built, as the collections
    calls["eq"] += bool(calls["Wildcards"])
    return same(self, other)
snakemake.io._IOFile.__eq__ = same_counted
build = snakemake.iocontainers.Wildcards.__init__  # (a Namedlist's, inherited)
def build_counted(self, *args, **kwargs):
    calls["Wildcards"] += 1
    build(self, *args, **kwargs)
snakemake.iocontainers.Wildcards.__init__ = build_counted
kind = inspect.Parameter.kind.fget
def kind_counted(parameter):  # while the DAG is built, as the collections
    calls["kind"] += bool(calls["Wildcards"])
    return kind(parameter)
inspect.Parameter.kind = property(kind_counted)
atexit.register(lambda: print(f"calls: {dict(calls)}"))
from snakemake.cli import main
sys.argv = ["snakemake", *sys.argv[1:]]
sys.exit(main())
"""


def counted_plan(tmp_path, write_config, tiny_config, parts: int, **data) -> tuple[int, dict]:
    """`snakemake -n` of `parts` local files (a shard each; `data`: data.* keys) under
    COUNTING: (its jobs, the counts)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(parts):
        (corpus / f"doc{i:05d}.txt").write_text(f"document {i}\n")
    cfg = {
        **tiny_config,
        "datasets": {
            "corpus": {"type": "local", "root": str(corpus), "include": ["*.txt"], "shards": parts}
        },
        "tokenizer": {
            **tiny_config["tokenizer"],
            "train": {**tiny_config["tokenizer"]["train"], "datasets": ["corpus"]},
        },
        "data": {**tiny_config["data"], "blend": [{"dataset": "corpus", "weight": 1.0}], **data},
    }
    config = write_config(tmp_path / "config.yaml", cfg)
    cmd = [sys.executable, "-c", COUNTING, *snakemake_cmd(tmp_path / "work", config, "-n")[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    jobs = int(re.search(r"^total\s+(\d+)\s*$", out.stdout + out.stderr, re.M)[1])
    return jobs, ast.literal_eval(re.search(r"^calls: (\{.*\})$", out.stdout, re.M)[1])


def test_a_plan_reads_each_signature_and_script_once_and_formats_each_command_once(
    tmp_path, write_config, tiny_config
):
    jobs, calls = counted_plan(tmp_path, write_config, tiny_config, 300)
    assert jobs > 600  # 300 collect_local_documents + 300 tokenize_shard + the rest
    assert calls["signature"] < jobs, f"{calls['signature']} signature reads for {jobs} jobs"
    # 300 tokenize_shard jobs and a few more run a shell command, the 300 collect jobs a
    # script: one format each of the former (three each were more than the jobs)
    assert 300 < calls["format_wildcards"] < jobs - 300, (calls, jobs)
    assert calls["get_source"] < 10, (calls, jobs)
    # a function's parameters walked once (which arguments it takes), not at each call of it
    assert calls["kind"] < jobs / 2, (calls, jobs)  # 8,366 before
    # one for each job (Job.wildcards) and one for each job's values (its functions'); one for
    # each function call before (collect: 2, tokenize: 5)
    assert calls["Wildcards"] < 2.2 * jobs, (calls, jobs)
    # a young collection per 100,000 allocations, not per 700 (hundreds for 600 jobs)
    assert calls["collections"] < 20, (calls, jobs)


def test_a_plan_checks_a_shards_file_against_a_jobs_inputs_by_set(
    tmp_path, write_config, tiny_config
):
    """Exact deduplication over 200 shards: 200 removal jobs each take the repeats that one job
    finds from the 200 shards' hashes; the DAG checks each removal job's file against that
    job's inputs: 200 x 200 path comparisons more as a list (113,932 comparisons counted for
    811 jobs), none as a set (find_inputs_by_set: 30,725, the DAG's dictionaries' own)."""
    jobs, calls = counted_plan(
        tmp_path, write_config, tiny_config, 200, quality={"steps": [{"step": "exact"}]}
    )
    assert jobs > 800  # 200 collect, hash, remove and tokenize jobs, and the rest
    assert calls["eq"] < 50 * jobs, (calls, jobs)
