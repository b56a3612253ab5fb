"""The tensor-parallel group of one rank and the collectives the model layers call. Layers hold a
`TensorParallelGroup` and never see the backend (NCCL, gloo) or the executor. At world size 1 every
collective returns its input (no torch.distributed). Collectives run on the current CUDA stream,
so NCCL ones can be captured in CUDA graphs once the group is initialised.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ferrum.distributed.pipeline_group import PipelineGroup
from ferrum.distributed.symm_mem_all_reduce import SymmMemAllReduce, try_symm_mem_all_reduce

BACKENDS = ("nccl", "gloo")
# torch >= 2.10 names it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallelGroup:
    """One rank's view of its tensor-parallel group: `rank` in [0, world_size)."""

    __slots__ = ("rank", "world_size", "_group", "_small_all_reduce", "_ordered_sum")

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        group: dist.ProcessGroup | None = None,
        small_all_reduce: SymmMemAllReduce | None = None,
        ordered_sum: bool = False,
    ) -> None:
        """`ordered_sum`: all_reduce adds the ranks' tensors in rank order (batch-invariant:
        NCCL's reduction order follows the message size)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank: must be in [0, world_size={world_size}), got {rank}")
        if world_size > 1 and group is None:
            raise ValueError(
                f"world_size: a group of {world_size} ranks needs a torch.distributed process "
                "group (use init_distributed)"
            )
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._small_all_reduce = small_all_reduce
        self._ordered_sum = ordered_sum

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks. It may be computed in place (`tensor` is returned) or into a
        new tensor: callers use the return value and do not read `tensor` afterwards."""
        if self.world_size == 1:
            return tensor
        if self._ordered_sum:
            parts = self.all_gather(tensor.unsqueeze(0), dim=0)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            return total
        if self._small_all_reduce is not None and self._small_all_reduce.applies(tensor):
            return self._small_all_reduce(tensor)
        dist.all_reduce(tensor, group=self._group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all ranks) concatenated along `dim`, in rank
        order, on every rank."""
        if self.world_size == 1:
            return tensor
        dim = dim % tensor.dim()
        gathered = torch.empty(
            (self.world_size * tensor.shape[0], *tensor.shape[1:]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        _all_gather_single(gathered, tensor.contiguous(), group=self._group)
        if dim == 0:
            return gathered
        return _concat_ranks(gathered.view(self.world_size, *tensor.shape), dim)

    def gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `tensor` concatenated along `dim` on rank 0; None on the other ranks."""
        if self.world_size == 1:
            return tensor
        dim = dim % tensor.dim()
        tensor = tensor.contiguous()
        if self.rank != 0:
            dist.gather(tensor, None, dst=0, group=self._group)
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.gather(tensor, parts, dst=0, group=self._group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `tensor` copied into `tensor` on every rank, in place; returns it."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(self._group, src), group=self._group)
        return tensor


def _concat_ranks(gathered: torch.Tensor, dim: int) -> torch.Tensor:
    """[world, *shape] -> the ranks' tensors concatenated along `dim` of `shape`."""
    world = gathered.shape[0]
    shape = list(gathered.shape[1:])
    moved = gathered.movedim(0, dim)  # [..., world, shape[dim], ...]
    shape[dim] *= world
    return moved.reshape(shape)


def init_distributed(
    world_size: int,
    rank: int,
    init_method: str,
    backend: str,
    custom_all_reduce: bool = True,
) -> TensorParallelGroup:
    """Joins this process to the default process group (every rank of the tensor-parallel
    group) and returns its TensorParallelGroup. world_size 1 initialises nothing. On CUDA the
    caller sets this process's device (torch.cuda.set_device) first. With NCCL and
    `custom_all_reduce`, small bf16 all-reduces go through symmetric memory (faster than NCCL
    there, symm_mem_all_reduce.py); every rank must pass the same value."""
    tp_group, _ = init_model_parallel(
        world_size, 1, rank, init_method, backend, custom_all_reduce=custom_all_reduce
    )
    return tp_group


def init_model_parallel(
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    rank: int,
    init_method: str,
    backend: str,
    custom_all_reduce: bool = True,
    batch_invariant: bool = False,
) -> tuple[TensorParallelGroup, PipelineGroup]:
    """Joins this process to the default process group of every rank (tp x pp of them) and
    returns its stage's tensor-parallel group and its pipeline view: global rank `rank` is
    tensor-parallel rank rank % tp of stage rank // tp. One rank initialises nothing. Every rank
    creates every stage's group, in stage order (torch.distributed requires it).
    `batch_invariant`: all-reduces sum in rank order (TensorParallelGroup's ordered_sum)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    for name, size in (("world_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {size!r}")
    world_size = tp * pp
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, {world_size}), got {rank!r}")
    stage, tp_rank = divmod(rank, tp)
    pipeline = PipelineGroup(stage, pp, tp_rank, tp)
    if world_size == 1:
        return TensorParallelGroup(), pipeline
    if dist.is_initialized():
        raise ValueError("init_distributed: this process already belongs to a process group")
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        device_id=device_id,
    )
    if pp == 1:
        group = dist.group.WORLD
    else:
        stage_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        group = stage_groups[stage]
    assert group is not None
    if tp == 1:
        return TensorParallelGroup(), pipeline
    small_all_reduce = None
    if backend == "nccl" and custom_all_reduce and not batch_invariant:
        assert device_id is not None
        small_all_reduce = try_symm_mem_all_reduce(group, device_id)
    return TensorParallelGroup(tp_rank, tp, group, small_all_reduce, batch_invariant), pipeline


def destroy_distributed() -> None:
    """Leaves the process group, if this process joined one (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()
