"""LoRA around the decoder layers' linear layers: `LoRALinear` wraps a column-parallel merged
layer (qkv, gate_up: one slice per shard) or a row-parallel one (o, down) and adds, per token,
its adapter's product to the base output: y += (x A_s^T) B_s^T, A and B read from a pool of
`max_loras` device slots (a slot never used, or cleared, is all zeros). A model-dtype layer
keeps every slot's A as extra rows below its weight: one GEMM gives the base output and every
slot's t, one kernel adds each token's B product (`lora_expand.lora_expand_extended`); other
formats keep A apart (shrink, then expand in place). Tensor parallelism
splits A and B like the base weight: column-parallel layers hold their rows of each shard's B,
row-parallel ones their input columns of A, and the partial product joins the base layer's
partial output before its all-reduce. The step's token -> slot map lives in `LoRABatch`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ferrum.kernels.lora_ref import (
    lora_expand_extended_torch,
    lora_expand_slices_torch,
    lora_shrink_torch,
)
from ferrum.kernels.lora_segments import LoRASegments
from ferrum.model_executor.layers.linear import Linear, MergedLinear
from ferrum.model_executor.layers.parallel_linear import RowParallelLinear
from ferrum.model_executor.layers.quantization.dense import DenseLinearMethod

# The modules of a decoder layer that take adapters (`lora_checkpoint.MODULES`' targets).
LORA_MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LoRABatch:
    """The step's adapter slot per token (-1: none), in a buffer sized once (CUDA graphs read
    it in place), and its grouping by slot for the Triton kernels."""

    def __init__(
        self,
        max_tokens: int,
        max_loras: int,
        device: torch.device,
        is_triton: bool,
        fuses_gemv: bool = False,
        linear: Callable[..., torch.Tensor] = torch.nn.functional.linear,
    ) -> None:
        # The kernels' model-dtype linear (`Kernels.dense_linear`), for extended weights.
        self.linear = linear
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.segments = LoRASegments.empty(max_tokens, max_loras, device) if is_triton else None
        # Whether a one-row step of a model-dtype layer takes the GEMV with its adapter in one
        # launch (Triton kernels, not batch-invariant: that mode keeps its own linear).
        self.fuses_gemv = fuses_gemv and is_triton
        # The forward's number, raised as every forward of the model begins (a pre-hook, so
        # captured in CUDA graphs too): the fused GEMV tells its own t from an older one by it.
        self.forward_seq = torch.zeros(1, dtype=torch.int32, device=device)
        # Whether the layers run their LoRA work: False for a step without adapters (eager, and
        # the graph runner replays its graph without them). A graph captures whatever it is
        # then (`adapters`). True until the first step, so the profile and warm-up run it.
        self.active = True

    @contextlib.contextmanager
    def adapters(self, active: bool) -> Iterator[None]:
        """Forwards run (and graphs capture) the layers with their LoRA work or without it
        while inside."""
        before, self.active = self.active, active
        try:
            yield
        finally:
            self.active = before

    def raise_forward_number(self) -> None:
        if self.fuses_gemv:
            self.forward_seq.add_(1)

    def reset_forward_numbers(self, layers: Iterable[LoRALinear]) -> None:
        """Number 0 again and every layer's t untagged (stream-ordered: between steps)."""
        self.forward_seq.zero_()
        for layer in layers:
            layer.untag_t()

    def regroup(self) -> None:
        """Refreshes the grouping after `token_slots` changed (Triton only)."""
        if self.segments is not None:
            self.segments.fill(self.token_slots)

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
        if self.segments is not None:
            from ferrum.kernels.lora_shrink import lora_shrink

            return lora_shrink(x, lora_a, self.segments)
        return lora_shrink_torch(x, lora_a, self.token_slots[: x.shape[0]])

    def expand(
        self, t: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, slice_starts: tuple[int, ...]
    ) -> None:
        """y += each shard's part of t times its columns of B (shards start at `slice_starts`;
        t holds one rank-wide block per shard)."""
        if self.segments is not None:
            from ferrum.kernels.lora_expand import lora_expand

            lora_expand(t, lora_b, self.segments, y, slice_starts)
            return
        lora_expand_slices_torch(t, lora_b, self.token_slots[: t.shape[0]], y, slice_starts)

    def expand_extended(
        self, y_ext: torch.Tensor, n: int, lora_b: torch.Tensor, slice_starts: tuple[int, ...]
    ) -> torch.Tensor:
        """The layer's output [T, n] from an extended weight's GEMM output (every slot's t
        beside the base output: `lora_expand.lora_expand_extended`)."""
        if self.segments is not None:
            from ferrum.kernels.lora_expand import lora_expand_extended

            return lora_expand_extended(y_ext, n, lora_b, self.segments, slice_starts)
        return lora_expand_extended_torch(y_ext, n, lora_b, self.token_slots, slice_starts)


class LoRALinear(nn.Module):
    """A base linear layer plus `max_loras` adapter slots of rank up to `max_rank`."""

    def __init__(
        self, base: Linear, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.base_layer = base
        self.batch = batch
        self.max_rank = max_rank
        tp = getattr(base, "tp_group", None)
        self.tp_size = 1 if tp is None else tp.world_size
        self.tp_rank = 0 if tp is None else tp.rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        # Output slices: (shard id, first local output row, local rows, first checkpoint row).
        if isinstance(base, MergedLinear):
            rows = getattr(base, "checkpoint_rows", None)
            self.slices = [
                (name, base.shard_offsets[name], size, rows[name][0] if rows else 0)
                for name, size in base.shard_sizes.items()
            ]
        else:
            self.slices = [(None, 0, base.output_size, 0)]
        self.slice_starts = tuple(offset for _, offset, _, _ in self.slices)
        num_slices, device = len(self.slices), base_device(base)
        a_rows = max_loras * num_slices * max_rank
        # A model-dtype weight gains every slot's A below its rows; `base.weight` and `lora_a`
        # are views of that one tensor. Other formats keep A apart (shrink, then expand).
        self.weight_ext, self.bias_ext = extend_weight(base, a_rows, dtype)
        if self.weight_ext is not None:
            a = self.weight_ext[base.weight.shape[0] :]
            self.lora_a = a.view(max_loras, num_slices * max_rank, base.input_size)
        else:
            self.lora_a = torch.zeros(
                max_loras, num_slices * max_rank, base.input_size, dtype=dtype, device=device
            )
        self.lora_b = torch.zeros(max_loras, base.output_size, max_rank, dtype=dtype, device=device)
        # The fused one-row GEMV's tagged partials of t: this layer's own, made by its first
        # launch and kept from one forward to the next.
        self.t_scratch: torch.Tensor | None = None

    def untag_t(self) -> None:
        """No forward's number on this layer's t any more (nothing passes for current)."""
        if self.t_scratch is not None:
            from ferrum.kernels.gemv_lora import UNTAGGED

            self.t_scratch.fill_(UNTAGGED)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Never: the adapter's product reads x in the model dtype."""
        return False

    def set_slot(
        self, slot: int, shards: dict[str | None, tuple[torch.Tensor, torch.Tensor]] | None
    ) -> None:
        """Fills `slot` with an adapter's (A, scaled B) per shard (full, unsharded: this rank's
        part is taken here); shards it lacks, or all with None, are zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for index, (name, offset, size, first_row) in enumerate(self.slices):
            if shards is None or name not in shards:
                continue
            a, b = shards[name]
            rank = a.shape[0]
            if self.row_parallel:
                local = self.base_layer.input_size
                a = a[:, self.tp_rank * local : (self.tp_rank + 1) * local]
            else:
                b = b[first_row : first_row + size]
            start = index * self.max_rank
            # Pinned host tensors on CUDA: queued without waiting (the host cache keeps them).
            self.lora_a[slot, start : start + rank].copy_(a, non_blocking=True)
            self.lora_b[slot, offset : offset + size, :rank].copy_(b, non_blocking=True)

    def _add_lora(self, y: torch.Tensor, x: torch.Tensor) -> None:
        if not self.batch.active:
            return
        t = self.batch.shrink(x, self.lora_a)
        self.batch.expand(t, self.lora_b, y, self.slice_starts)

    def _extended(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Base output plus adapters: the extended weight's GEMM, then each token's B product."""
        weight = self.base_layer.weight
        y_ext = self.batch.linear(x.reshape(-1, x.shape[-1]), self.weight_ext, bias)
        y = self.batch.expand_extended(y_ext, weight.shape[0], self.lora_b, self.slice_starts)
        return y.view(*x.shape[:-1], weight.shape[0])

    def _fused_gemv(self, x: torch.Tensor) -> torch.Tensor | None:
        """The layer's output with its adapter from one launch (gemv_lora.py) where adapters
        run, x is one row and the base layer would take the model-dtype GEMV; else None."""
        batch, base = self.batch, self.base_layer
        if not batch.fuses_gemv or not batch.active:
            return None
        if not isinstance(base.quant_method, DenseLinearMethod):
            return None
        from ferrum.kernels.dense_linear import gemv_tile_for

        tile = gemv_tile_for(x, base.weight)
        if tile is None:
            return None
        from ferrum.kernels.gemv_lora import gemv_lora, new_t_scratch

        if self.t_scratch is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("LoRA GEMV: run one-row steps once before CUDA graph capture")
            self.t_scratch = new_t_scratch(base.weight, tile, len(self.slices), self.max_rank)
        out = gemv_lora(
            x.reshape(1, -1), base.weight, self.lora_a, self.lora_b, batch.token_slots,
            self.slice_starts, tile, self.t_scratch, batch.forward_seq, base.bias,
        )  # fmt: skip
        return out.view(*x.shape[:-1], base.weight.shape[0])

    def forward(self, x: torch.Tensor, x_fp8: object = None) -> torch.Tensor:
        if x_fp8 is not None:
            raise ValueError("x_fp8: a LoRA layer takes no FP8 rows")
        base = self.base_layer
        if not (self.row_parallel and self.tp_size > 1):
            fused = self._fused_gemv(x)
            if fused is not None:
                return fused
            if self.weight_ext is not None and self.batch.active:
                return self._extended(x, self.bias_ext)
            y = base(x)
            self._add_lora(y, x)
            return y
        # Row parallel: this rank's partial product, its adapter part, then the all-reduce.
        if self.weight_ext is not None and self.batch.active:
            partial = self._extended(x, None)
        else:
            if base.quant_method is not None:
                partial = base.quant_method.apply(base, x, None, None)
            else:
                partial = torch.nn.functional.linear(x, base.weight)
            self._add_lora(partial, x)
        out = base.tp_group.all_reduce(partial)
        return out if base.bias is None else out + base.bias


def base_device(layer: nn.Module) -> torch.device:
    return next(layer.parameters()).device


def extend_weight(
    base: Linear, a_rows: int, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A model-dtype layer's weight moved into [W; zeros(a_rows, K)] (returned; `base.weight`
    becomes a view of its first rows) and its bias padded to match (None without one); (None,
    None) for any other weight format."""
    if not isinstance(base.quant_method, DenseLinearMethod) or base.weight.dtype != dtype:
        return None, None
    weight = base.weight
    n, k = weight.shape
    extended = torch.zeros(n + a_rows, k, dtype=dtype, device=weight.device)
    extended[:n].copy_(weight.detach())
    view = nn.Parameter(extended[:n], requires_grad=weight.requires_grad)
    view.__dict__.update(weight.__dict__)  # the loader's attributes, if any
    base.weight = view
    bias = base.bias
    if bias is None:
        return extended, None
    return extended, torch.cat([bias.detach(), bias.new_zeros(a_rows)])


def install_lora_layers(
    model: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype
) -> dict[tuple[int, str], LoRALinear]:
    """Wraps every LoRA-capable linear layer of the model's decoder layers (this pipeline
    stage's) in place, and has every forward of the model raise the batch's forward number
    first; returns the layers by (layer index, module name)."""
    layers: dict[tuple[int, str], LoRALinear] = {}
    decoder = model.model.layers
    for layer_idx in model.stage.layer_ids:
        for name in LORA_MODULES:
            parent_name, attr = name.split(".")
            parent = getattr(decoder[layer_idx], parent_name, None)
            base = getattr(parent, attr, None)
            if not isinstance(base, Linear):
                continue  # e.g. MoE experts: the adapter loader refuses their targets
            wrapped = LoRALinear(base, batch, max_loras, max_rank, dtype)
            setattr(parent, attr, wrapped)
            layers[(layer_idx, name)] = wrapped
    model.register_forward_pre_hook(lambda module, args: batch.raise_forward_number())
    if batch.token_slots.is_cuda:
        torch.cuda.empty_cache()  # the weights' old storage, replaced by extended copies
    return layers
