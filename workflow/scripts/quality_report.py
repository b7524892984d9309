"""Snakemake adapter: the data-quality stage's manifests -> the report's "Data quality" page."""

from gptflow.errors import report_errors
from gptflow.results.report import quality_page, quality_summary

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    summary = quality_summary(
        [tuple(r) for r in sm.params.recipes], list(sm.input.manifests), list(sm.input.groups)
    )
    quality_page(summary, sm.output[0])
