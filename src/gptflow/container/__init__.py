"""The container stage: Dockerfile -> image -> enroot squashfs or Apptainer SIF, and how a
training task starts inside it (:mod:`gptflow.container.image`). Imports only the top-level
leaves."""
