"""What a plan pays per job: Snakemake reads an input, params or resources function's signature
(inspect.signature) twice each time it calls one, several times per job; rules/setup.smk reads
each once (read_signatures_once). Counted in a real `snakemake -n` of 300 local files (600
collect and tokenize jobs): without it over 10,000 reads, with it a few hundred, most of them
libraries' own at import."""

import re
import subprocess
import sys

from tests.workflow.conftest import snakemake_cmd

COUNTING = """
import atexit, inspect, sys
calls = [0]
signature = inspect.signature
def counted(*args, **kwargs):
    calls[0] += 1
    return signature(*args, **kwargs)
inspect.signature = counted
atexit.register(lambda: print(f"inspect.signature calls: {calls[0]}"))
from snakemake.cli import main
sys.argv = ["snakemake", *sys.argv[1:]]
sys.exit(main())
"""


def test_a_plan_reads_each_function_signature_once(tmp_path, write_config, tiny_config):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(300):
        (corpus / f"doc{i:05d}.txt").write_text(f"document {i}\n")
    cfg = {
        **tiny_config,
        "datasets": {
            "corpus": {"type": "local", "root": str(corpus), "include": ["*.txt"], "shards": 300}
        },
        "tokenizer": {
            **tiny_config["tokenizer"],
            "train": {**tiny_config["tokenizer"]["train"], "datasets": ["corpus"]},
        },
        "data": {**tiny_config["data"], "blend": [{"dataset": "corpus", "weight": 1.0}]},
    }
    config = write_config(tmp_path / "config.yaml", cfg)
    cmd = [sys.executable, "-c", COUNTING, *snakemake_cmd(tmp_path / "work", config, "-n")[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    jobs = int(re.search(r"^total\s+(\d+)\s*$", out.stdout + out.stderr, re.M)[1])
    assert jobs > 600  # 300 collect_local_documents + 300 tokenize_shard + the rest
    calls = int(re.search(r"inspect\.signature calls: (\d+)", out.stdout)[1])
    assert calls < jobs, f"{calls} signature reads for {jobs} jobs"
