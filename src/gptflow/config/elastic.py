"""``train.elastic``: the node counts an elastic run may train on (torchrun's
``--nnodes=MIN:MAX``); its launch options are gptflow.train.distributed's, the check that the
global batch splits on each count gptflow.plan.placement's."""

from __future__ import annotations

from dataclasses import dataclass

from gptflow.errors import GptflowError


@dataclass(frozen=True)
class ElasticConfig:
    """Elastic training (keys of ``train.elastic:``): torchrun's ``--nnodes=MIN:MAX`` with a
    c10d rendezvous; see the schema and :func:`gptflow.train.distributed.elastic_options`."""

    min_nodes: int
    max_nodes: int
    max_restarts: int = 3  # after failed ranks; a membership change uses none
    join_timeout_s: int = 600  # torchrun's join_timeout
    last_call_s: int = 30  # torchrun's last_call_timeout

    def __post_init__(self) -> None:
        if self.min_nodes > self.max_nodes:
            raise GptflowError(
                f"train.elastic.min_nodes {self.min_nodes} is above train.elastic.max_nodes "
                f"{self.max_nodes}; swap them or lower min_nodes"
            )

    @property
    def node_counts(self) -> range:
        return range(self.min_nodes, self.max_nodes + 1)
