"""Before and around the jobs, in the workflow's own process and on the login node: the workflow
config validated (:mod:`~gptflow.plan.workflow_config`), the preflight at ``snakemake -n``
(:mod:`~gptflow.plan.preflight` and the modules of its checks), ``gptflow why``, ``gptflow
status``, and the submissions a cluster refused. Imports everything below it; nothing imports
it but the CLI."""
