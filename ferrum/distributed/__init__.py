"""Process groups and the collectives the model layers call (backend-agnostic)."""

from ferrum.distributed.parallel_state import (
    TensorParallelGroup,
    destroy_distributed,
    init_distributed,
)

__all__ = ["TensorParallelGroup", "destroy_distributed", "init_distributed"]
