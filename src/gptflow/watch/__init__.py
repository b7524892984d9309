"""Watching runs, from their files and the scheduler's queue: ``gptflow status`` (where each
run is), ``gptflow summary`` (what each finished run left) and ``gptflow why`` (what the next
run reruns, and why). Above planning: ``why`` runs Snakemake's dry run and reads the plan's
records (gptflow.plan.records); nothing below imports this."""
