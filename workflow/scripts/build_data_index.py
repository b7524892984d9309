"""Snakemake adapter: the data settings + the shards -> the shared data index and its summary."""

import sys

from gptflow.errors import report_errors
from gptflow.fsutil import write_json
from gptflow.train.run_config import build_data_index

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    summary = build_data_index(
        sm.params.settings,
        sm.params.shards,
        sm.output[0],
        heldout=sm.params.heldout,
        origins=sm.params.origins,
    )
    write_json(sm.output[0], summary)
    print(
        f"{sm.output[0]}: samples {summary['samples']}, {summary['seconds']:.2f} s, "
        f"cache {summary['cache_dir']}",
        file=sys.stderr,
    )
