"""A run as planning knows it (:class:`RunPlan`): its config, and its train settings and model
as the trainer's own dataclasses, built once per plan (gptflow.plan.build) and read by every
check and count of the plan -- the preflight, the study's table, the harness's steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from gptflow.config.settings import ModelConfig, TrainConfig
from gptflow.plan.run_size import model_config, vocab_size


@dataclass(frozen=True, eq=False)
class RunPlan:
    """`config`: the run's config (gptflow.plan.workflow_config.run_configs: what its run.yaml
    is rendered from); `train`: its settings; `tokenizer_json`: where the run's tokenizer is
    (or will be), whose vocabulary the model is counted with -- read when first asked (the
    preflight), not when a job's own Snakemake parses the workflow."""

    name: str
    config: dict
    train: TrainConfig
    tokenizer_json: Path | None = None

    @cached_property
    def vocabulary(self) -> tuple[int, str]:
        """The vocabulary (unpadded) and where the number comes from (run_size.vocab_size)."""
        return vocab_size(self.config, self.tokenizer_json)

    @property
    def vocab(self) -> int:
        return self.vocabulary[0]

    @property
    def vocab_source(self) -> str:
        return self.vocabulary[1]

    @cached_property
    def model(self) -> ModelConfig:
        """The architecture with that vocabulary, padded as the trainer pads it."""
        return model_config(self.config, self.vocab)


def run_plan(name: str, cfg: dict, tokenizer_json: Path | None) -> RunPlan:
    """Run `name` of config `cfg` (its settings checked already: load_workflow_config)."""
    return RunPlan(name, cfg, TrainConfig(**cfg["train"]), tokenizer_json)
