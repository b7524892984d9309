"""Snakemake adapter: the data-quality stage's manifests -> the report's "Data quality" page
and its numbers (data-quality.json)."""

from gptflow.errors import report_errors
from gptflow.results.quality_report import quality_report

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    quality_report(
        list(sm.params.recipes),
        list(sm.input.manifests),
        list(sm.input.groups),
        page=sm.output.page,
        summary=sm.output.summary,
    )
