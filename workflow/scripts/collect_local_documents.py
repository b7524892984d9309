"""Snakemake adapter: the files of one local-dataset shard -> JSONL documents + manifest."""

import json
import sys
from pathlib import Path

from gptflow.data.readers import collect_local_documents
from gptflow.data.sources import expand_root
from gptflow.errors import report_errors
from gptflow.fsutil import write_json

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    stats = collect_local_documents(
        [Path(path) for path, _size, _mtime in sm.params.files],
        expand_root(sm.params.root),
        sm.output.jsonl,
        key=sm.params.json_key,
    )
    write_json(
        sm.output.manifest, {"dataset": sm.wildcards.dataset, "shard": sm.wildcards.shard, **stats}
    )
    print(json.dumps(stats), file=sys.stderr)
