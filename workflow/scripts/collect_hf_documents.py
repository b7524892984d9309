"""Snakemake adapter: one row range of a Hugging Face dataset -> JSONL documents + manifest."""

import json
import sys

from gptflow.data.hf import collect_hf_documents
from gptflow.data.sources import HfSource
from gptflow.errors import report_errors
from gptflow.fsutil import write_json

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    manifest = collect_hf_documents(
        HfSource(**sm.params.source), int(sm.wildcards.shard), sm.params.shards, sm.output.jsonl
    )
    write_json(
        sm.output.manifest,
        {"dataset": sm.wildcards.dataset, "shard": sm.wildcards.shard, **manifest},
    )
    print(json.dumps(manifest), file=sys.stderr)
