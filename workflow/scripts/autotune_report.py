"""Snakemake adapter: autotune's finished trials -> the ranking, its page and best.yaml."""

from gptflow.errors import report_errors
from gptflow.results.autotune import autotune_report

sm = snakemake  # noqa: F821 - injected by Snakemake
with report_errors(sm.log[0]):
    files = zip(sm.input.done, sm.params.metrics, strict=True)
    trials = {
        name: {"done": done, "metrics": metrics}
        for name, (done, metrics) in zip(sm.params.trials, files, strict=True)
    }
    autotune_report(
        sm.wildcards.run,
        sm.params.candidates,
        trials,
        sm.params.warmup_steps,
        json_out=sm.output.json,
        page_out=sm.output.page,
        best_out=sm.output.best,
    )
