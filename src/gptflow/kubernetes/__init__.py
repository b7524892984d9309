"""Kubernetes: training as a JobSet that gptflow renders, submits and watches (profiles/kubernetes).

``spec`` is what one submission asks for (a :class:`~gptflow.kubernetes.spec.PodSet`),
``manifests`` renders it as a JobSet and as the operators' kinds, ``sizing`` makes it from the
config and the plan, ``submit`` creates and watches it, ``render`` reads the workflow's config
files for ``gptflow kubernetes render`` and ``driver`` (their flags: gptflow.cli.kubernetes).
"""
