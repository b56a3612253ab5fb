"""Turns a SchedulerOutput into one model forward plus sampling.

The runner keeps its own copy of each scheduled request's tokens and block table (new requests
arrive once in full, running ones as diffs) and never touches the block pool.

Structured outputs: `launch` gets the matchers of the constrained requests; the rows that sample
this step get their next-token bitmask filled on the host (other rows allow everything; see
`grammar_bitmask.py`) and applied to the logits by the sampler. With `defer_sampling` the fill
and the sampling wait for `sample`, so the caller can bring the matchers up to date while the
forward runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ferrum.config import EngineConfig
from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.distributed.pipeline_group import PipelineGroup
from ferrum.kernels import FP8_KV_DTYPE
from ferrum.kv.kv_cache_spec import layer_group_ids
from ferrum.logger import init_logger
from ferrum.model_executor.compile_watch import start_up_compiles, watch_serving_compiles
from ferrum.model_executor.cuda_graph import CUDAGraphRunner
from ferrum.model_executor.gpu_memory_profile import profile_gpu_kv_budget
from ferrum.model_executor.grammar_bitmask import GrammarBitmaskBuffers
from ferrum.model_executor.input_batch import InputBuffers, StepInputs
from ferrum.model_executor.kernel_backend import resolve_kernel_backend
from ferrum.model_executor.kv_cache_sizing import (
    allocate_kv_caches,
    cpu_kv_budget,
    kv_cache_group_specs,
    num_blocks_from_budget,
)
from ferrum.model_executor.model_loader import load_model
from ferrum.model_executor.pipeline_stage import pipeline_stage
from ferrum.model_executor.prompt_logprobs import (
    compute_prompt_logprobs,
    prompt_rows,
)
from ferrum.model_executor.recurrent_slots import (
    copy_recurrent_slots,
    reset_recurrent_slots,
    snapshot_copies,
)
from ferrum.model_executor.runner_state import (
    CachedRequestState,
    LaunchedStep,
    PendingSample,
    append_sampled,
)
from ferrum.model_executor.sampler import Sampler, advance_sampling_generator
from ferrum.model_executor.sampling_metadata import (
    SamplingMetadata,
    SamplingRow,
    sampling_staging,
)
from ferrum.model_executor.warm_up import warm_up_runner
from ferrum.parallel_config import kv_heads_per_rank
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.output import ModelRunnerOutput, SchedulerOutput
from ferrum.structured_output import StructuredOutputMatcher

if TYPE_CHECKING:
    from ferrum.kernels.paged_attention import SplitKVWorkspace

logger = init_logger(__name__)
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's ("auto") or FP8 e4m3 ("fp8", "fp8_e4m3")."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPE


class ModelRunner:
    """The runner of one rank. With a tensor-parallel group of several ranks it builds this
    rank's shard of the model; every rank computes the same full logits and samples them with the
    same generators, so every rank's sampled tokens are identical and each feeds its own next
    step.

    With a pipeline of several stages it builds its stage's layers: a stage after the first
    receives the previous stage's activations, a stage before the last sends its own on, and the
    last stage samples and broadcasts the tokens to every rank (read when the step completes).
    The scheduler never schedules a request whose previous token is still in the pipe, so no
    step reads a placeholder token. A stage's CUDA graphs cover its layers; every stage pads a
    step to the same graph shape, so the activations sent match the receiver's buffer."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        tp_group: TensorParallelGroup | None = None,
        pp_group: PipelineGroup | None = None,
    ) -> None:
        self.config = config
        start_up_compiles()
        if device.type == "cuda":
            # Triton launches, CUDA graphs and memory profiling use the current device: this
            # runner's (a data-parallel replica's core runs on cuda:i * tp). "cuda" alone is
            # the current one.
            index = torch.cuda.current_device() if device.index is None else device.index
            device = torch.device("cuda", index)
            torch.cuda.set_device(device)
        self.device = device
        self.tp_group = TensorParallelGroup() if tp_group is None else tp_group
        self.tp_size = tp_size = config.parallel_config.tensor_parallel_size
        if self.tp_group.world_size != tp_size:
            raise ValueError(
                f"tp_group: {self.tp_group.world_size} ranks, but tensor_parallel_size={tp_size}"
            )
        self.pp_group = PipelineGroup() if pp_group is None else pp_group
        pp_size = config.parallel_config.pipeline_parallel_size
        if self.pp_group.size != pp_size:
            raise ValueError(
                f"pp_group: {self.pp_group.size} stages, but pipeline_parallel_size={pp_size}"
            )
        self.stage = pipeline_stage(
            config.model_config.arch.num_hidden_layers, self.pp_group.rank, pp_size
        )
        self.dtype = torch_dtype(config.model_config.dtype)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache_config.kv_cache_dtype, self.dtype)
        if self.kv_cache_dtype == FP8_KV_DTYPE:
            logger.info("KV cache in %s, per-tensor scales 1.0 (not calibrated)", FP8_KV_DTYPE)
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.kernel_backend = resolve_kernel_backend(config.device_config.kernel_backend, device)
        fp8_kv = self.kv_cache_dtype == FP8_KV_DTYPE
        if fp8_kv and config.model_config.arch.linear_attention_layers:
            raise ValueError(
                f"kv_cache_dtype={config.cache_config.kv_cache_dtype!r}: an FP8 KV cache is not "
                f"supported yet with linear-attention layers ({config.model_config.architecture})"
            )
        if fp8_kv and self.kernel_backend == "triton" and device.type != "cuda":
            raise ValueError(
                f"kv_cache_dtype={config.cache_config.kv_cache_dtype!r}: Triton's CPU "
                "interpreter does not convert FP8; use kernel_backend='torch' on the CPU"
            )
        self.model = load_model(
            config.model_config,
            device,
            self.kernel_backend,
            self.tp_group,
            config.parallel_config.enable_expert_parallel,
            self.stage,
        )
        self.split_kv_workspace = self._allocate_split_kv_workspace()
        # Layer groups of the KV cache (full attention, each sliding window): a block table each.
        self.kv_cache_groups = kv_cache_group_specs(config.model_config)
        self._recurrent_groups = [
            g for g, spec in enumerate(self.kv_cache_groups) if spec.recurrent
        ]
        sched = config.scheduler_config
        max_model_len = config.model_config.max_model_len
        # Buffers for the largest step: a batch, a padded CUDA-graph batch or the memory profile.
        self.inputs = InputBuffers(
            max_num_tokens=max(sched.max_num_batched_tokens, min(sched.max_num_seqs, 512)),
            max_num_reqs=max(sched.max_num_seqs, -(-sched.max_num_batched_tokens // max_model_len)),
            max_model_len=max_model_len,
            block_size=self.block_size,
            device=device,
            num_kv_groups=len(self.kv_cache_groups),
            sdpa_max_len=min(sched.max_num_batched_tokens, max_model_len),
        )
        self.sampling_staging = sampling_staging(sched.max_num_seqs, device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.model_config.seed)
        # Per layer: its KV cache, or a linear-attention layer's (conv, recurrent) state pools.
        self.kv_caches: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda_graphs: CUDAGraphRunner | None = None
        self.requests: dict[str, CachedRequestState] = {}
        # Seeded generators live from a request's first admission to its end, across preemptions.
        self._seeded_generators: dict[str, torch.Generator] = {}
        # The latest launched step's sampled tokens (on the device) and each request's row there.
        self._last_sampled = torch.zeros(0, dtype=torch.int64, device=device)
        self._last_sampled_rows: dict[str, int] = {}
        self.grammar_bitmasks = GrammarBitmaskBuffers(
            config.scheduler_config.max_num_seqs, self.vocab_size, device
        )

    def _allocate_split_kv_workspace(self) -> SplitKVWorkspace | None:
        """Scratch for the split-KV decode kernel on CUDA, sized once for the whole run."""
        if self.kernel_backend != "triton" or self.device.type != "cuda":
            return None
        from ferrum.kernels.paged_attention import (
            allocate_split_kv_workspace,
            split_kv_max_programs,
        )

        model_config = self.config.model_config
        num_kv_heads = kv_heads_per_rank(model_config.num_kv_heads, self.tp_size)
        num_heads = model_config.num_attention_heads // self.tp_size
        # Batches of at least split_kv_max_programs / num_kv_heads requests take one pass.
        max_programs = split_kv_max_programs(self.kv_cache_dtype == FP8_KV_DTYPE)
        max_num_seqs = min(
            self.config.scheduler_config.max_num_seqs, -(-max_programs // num_kv_heads)
        )
        return allocate_split_kv_workspace(
            max_num_seqs, num_heads, model_config.head_dim, self.device
        )

    def determine_num_kv_blocks(self) -> list[int]:
        """KV blocks per layer group: the CPU budget, or what a profiled peak leaves on the GPU."""
        cfg = self.config
        if self.device.type != "cuda":
            budget = cpu_kv_budget(
                cfg.model_config,
                cfg.cache_config,
                cfg.scheduler_config,
                self.kv_cache_dtype,
                self.tp_size,
                self.stage.layer_ids,
            )
        elif cfg.cache_config.kv_cache_memory_bytes is not None:
            budget = cfg.cache_config.kv_cache_memory_bytes
        else:
            budget = profile_gpu_kv_budget(self)
        return num_blocks_from_budget(
            budget,
            cfg.model_config,
            cfg.cache_config,
            cfg.scheduler_config,
            self.kv_cache_dtype,
            # On the CPU an unused default budget would only cost memory; a GPU keeps every
            # block it can for the prefix cache.
            cap_to_need=self.device.type != "cuda",
            tp_size=self.tp_size,
            layer_ids=self.stage.layer_ids,
        )

    def initialize_kv_cache(self, num_blocks: int | list[int]) -> None:
        """Allocates every layer's cache (`num_blocks` per layer group, or one count for all)."""
        self.kv_caches = allocate_kv_caches(
            self.config.model_config,
            num_blocks,
            self.block_size,
            self.kv_cache_dtype,
            self.device,
            self.tp_size,
            self.stage.layer_ids,
        )
        self.model.bind_kv_caches(
            self.kv_caches, self.split_kv_workspace, layer_group_ids(self.kv_cache_groups)
        )

    def warm_up(self, num_blocks: int | list[int]) -> None:
        """Compiles the Triton kernel variants a first request would otherwise wait for
        (`warm_up.py`). Writes KV only into blocks that no request holds yet."""
        if self._compiles_triton():
            warm_up_runner(self, num_blocks)

    def uses_cuda_graphs(self) -> bool:
        """Graphs need CUDA and the Triton kernels (the torch MoE path syncs with the host)."""
        return self._compiles_triton() and not self.config.device_config.enforce_eager

    def _compiles_triton(self) -> bool:
        return self.kernel_backend == "triton" and self.device.type == "cuda"

    def capture_cuda_graphs(self) -> None:
        """Captures decode graphs for batch sizes up to max_num_seqs and single-request prefill
        graphs for chunks of up to 512 tokens (the KV cache must be bound). Start-up ends here:
        a Triton kernel compiled from now on is logged (`compile_watch.py`)."""
        if self.uses_cuda_graphs():
            self._capture_cuda_graphs()
        if self._compiles_triton():
            watch_serving_compiles()

    def _capture_cuda_graphs(self) -> None:
        sched = self.config.scheduler_config
        self.cuda_graphs = CUDAGraphRunner(
            self.model,
            self.inputs,
            max_batch_size=min(sched.max_num_seqs, 512),
            max_prefill_tokens=min(sched.max_num_batched_tokens, self.inputs.max_model_len),
            device=self.device,
            stage_input_size=None
            if self.pp_group.is_first
            else self.config.model_config.arch.hidden_size,
            stage_input_dtype=self.dtype,
        )
        self.cuda_graphs.capture()

    # -- request state ---------------------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self._seeded_generators.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            self.requests.pop(req_id, None)
        fresh_slots: list[int] = []
        hit_src: list[int] = []
        hit_dst: list[int] = []
        for new in scheduler_output.scheduled_new_reqs:
            if len(new.block_ids) != len(self.kv_cache_groups):
                raise ValueError(
                    f"block_ids of {new.req_id!r}: expected one table per KV cache group "
                    f"({len(self.kv_cache_groups)}), got {len(new.block_ids)}"
                )
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                token_ids=new.prompt_token_ids + new.output_token_ids,
                params=new.sampling_params,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=self._generator_for(
                    new.req_id, new.sampling_params, len(new.output_token_ids)
                ),
            )
            for g in self._recurrent_groups:
                table = new.block_ids[g]
                if new.num_computed_tokens == 0:
                    fresh_slots.append(table[0])
                else:  # a prefix hit: its snapshot ends the hit's blocks
                    hit_src.append(table[new.num_computed_tokens // self.block_size - 1])
                    hit_dst.append(table[0])
        self._reset_recurrent_states(fresh_slots)
        self._copy_recurrent_states(hit_src, hit_dst)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for block_ids, new_block_ids in zip(state.block_ids, cached.new_block_ids):
                block_ids.extend(new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _reset_recurrent_states(self, slot_ids: list[int]) -> None:
        reset_recurrent_slots(self.kv_caches, slot_ids, self.device)

    def _copy_recurrent_states(self, src_slots: list[int], dst_slots: list[int]) -> None:
        copy_recurrent_slots(self.kv_caches, src_slots, dst_slots, self.device)

    def _snapshot_recurrent_states(self, num_scheduled: dict[str, int]) -> None:
        """After a step's forward: a chunk that ended on a block whose state-group entry holds
        a snapshot slot (the KV manager took one there) gets its live state copied into it."""
        src, dst = snapshot_copies(
            self.requests, num_scheduled, self.block_size, self._recurrent_groups
        )
        self._copy_recurrent_states(src, dst)

    def _generator_for(
        self, req_id: str, params: SamplingParams, num_output_tokens: int
    ) -> torch.Generator | None:
        """A seeded request's generator. One made for a request that already has output tokens
        (resumed by a new engine core) replays the draws that sampled them: its next token is
        the one the request would have drawn without the restart."""
        if params.seed is None or params.temperature == 0.0:
            return None
        generator = self._seeded_generators.get(req_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
            advance_sampling_generator(generator, num_output_tokens, self.vocab_size, self.device)
            self._seeded_generators[req_id] = generator
        return generator

    # -- one step --------------------------------------------------------------------------------

    def _fill_placeholders(self, inputs: StepInputs) -> None:
        """Writes each placeholder's token, sampled by the previous launched step, into the
        device input ids (stream-ordered after that step's sampling: no host sync)."""
        n = inputs.num_placeholders
        if n == 0:
            return
        if inputs.placeholder_index is None:
            inputs.input_ids[:n].copy_(self._last_sampled[:n])
        else:
            index, rows = inputs.placeholder_index
            inputs.input_ids[index] = self._last_sampled[rows]

    def _forward(
        self, inputs: StepInputs, graph_shape: tuple[int, int] | None, num_tokens: int
    ) -> torch.Tensor | None:
        """The step's hidden states; None on a pipeline stage before the last."""
        self._fill_placeholders(inputs)
        if graph_shape is None:
            return self._run_stage(inputs, num_tokens)
        graphs = self.cuda_graphs
        assert graphs is not None
        pp = self.pp_group
        if pp.size == 1:
            return graphs.replay(graph_shape, num_tokens)
        # Every stage pads to the same shape: the activations go over padded.
        if not pp.is_first:
            pp.recv_from_prev(graphs.stage_input(graph_shape[0]))
        output = graphs.replay(graph_shape, num_tokens)
        if pp.is_last:
            return output
        pp.send_to_next(torch.stack(output))
        return None

    def _run_stage(self, inputs: StepInputs, num_tokens: int) -> torch.Tensor | None:
        """This rank's part of an eager forward of `num_tokens` tokens: the whole model, or its
        pipeline stage between receiving the previous stage's activations and sending its own
        (None then, before the last stage)."""
        pp = self.pp_group
        if pp.size == 1:
            return self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        intermediate = None
        if not pp.is_first:
            hidden_size = self.config.model_config.arch.hidden_size
            received = torch.empty(2, num_tokens, hidden_size, dtype=self.dtype, device=self.device)
            pp.recv_from_prev(received)
            intermediate = (received[0], received[1])
        out = self.model(
            inputs.input_ids[:num_tokens],
            inputs.positions[:num_tokens],
            inputs.attn_metadata,
            intermediate,
        )
        if pp.is_last:
            return out
        hidden, residual = out
        pp.send_to_next(torch.stack((hidden[:num_tokens], residual[:num_tokens])))
        return None

    def _grammar_bitmask(
        self, states: list[CachedRequestState], matchers: dict[str, StructuredOutputMatcher]
    ) -> torch.Tensor | None:
        """[len(states), vocab/32] int32 on the device: each constrained row's allowed next
        tokens, all ones elsewhere; None when no row is constrained. Below min_tokens a row's
        stop tokens are cleared, unless the grammar allows nothing else (it can only end: the
        request then stops there, with a valid output)."""
        rows = []
        for i, state in enumerate(states):
            matcher = matchers.get(state.req_id)
            if matcher is not None:
                num_outputs = len(state.output_token_ids) + state.num_output_placeholders
                below_min = num_outputs < state.params.min_tokens
                rows.append((i, matcher, state.params.all_stop_token_ids if below_min else ()))
        return self.grammar_bitmasks.fill(len(states), rows) if rows else None

    @torch.inference_mode()
    def launch(
        self,
        scheduler_output: SchedulerOutput,
        matchers: dict[str, StructuredOutputMatcher] | None = None,
        defer_sampling: bool = False,
    ) -> LaunchedStep:
        """Queues one step's forward and sampling on the device and the copy of its tokens to
        the host, without waiting for any of it. Steps complete (`complete`) in launch order;
        between the two, the next step may be launched: a decode whose input is this step's
        token reads it on the device. `matchers`: the grammars of the constrained requests.

        With `defer_sampling`, a step that samples a constrained row queues only its forward
        (`awaits_sampling`): the caller brings every matcher up to date (completes the previous
        step) while the device runs it, then calls `sample`. Otherwise the matchers must have
        accepted all of their requests' output tokens already."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return LaunchedStep([], [], None, None)
        num_scheduled = scheduler_output.num_scheduled_tokens
        num_tokens = scheduler_output.total_num_scheduled_tokens
        graphs = self.cuda_graphs
        shape = None if graphs is None else graphs.padded_shape(len(num_scheduled), num_tokens)
        inputs = self.inputs.prepare(
            self.requests, num_scheduled, num_tokens, self._last_sampled_rows, pad_to=shape
        )
        hidden_states = self._forward(inputs, shape, num_tokens)
        if self._recurrent_groups:
            self._snapshot_recurrent_states(num_scheduled)
        prompt_chunks = []
        if hidden_states is not None:
            prompt_chunks = [
                compute_prompt_logprobs(hidden_states, rows, self.model.compute_logits)
                for rows in prompt_rows(self._prompt_views(num_scheduled), num_scheduled)
            ]
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        if not inputs.sampled_req_ids:
            return LaunchedStep([], [], None, None, prompt_chunks)
        if hidden_states is None:  # a stage before the last: the tokens come from the last
            return self._await_stage_tokens(inputs.sampled_req_ids)

        if inputs.logits_indices is not None:
            hidden_states = hidden_states[inputs.logits_indices]
        logits = self.model.compute_logits(hidden_states)
        states = [self.requests[r] for r in inputs.sampled_req_ids]
        step = LaunchedStep(inputs.sampled_req_ids, states, None, None, prompt_chunks)
        constrained = bool(matchers) and any(r in matchers for r in step.req_ids)
        step.pending = PendingSample(logits, matchers if constrained else None)
        if not (defer_sampling and constrained):
            self.sample(step)
        return step

    @torch.inference_mode()
    def sample(self, step: LaunchedStep) -> None:
        """Queues the sampling of a launched step that `awaits_sampling` and the copy of its
        tokens to the host; its constrained rows' bitmask is filled from the matchers now."""
        pending, step.pending = step.pending, None
        assert pending is not None, "the step was sampled already"
        states = step.states
        rows = [
            SamplingRow(
                params=s.params,
                prompt_token_ids=s.prompt_token_ids,
                output_token_ids=s.output_token_ids,
                generator=s.generator,
                stop_token_ids=s.params.all_stop_token_ids,
                num_output_placeholders=s.num_output_placeholders,
            )
            for s in states
        ]
        metadata = SamplingMetadata.from_rows(rows, self.vocab_size, self.sampling_staging)
        if pending.matchers:
            metadata.grammar_bitmask = self._grammar_bitmask(states, pending.matchers)
        sampler_output = self.sampler(pending.logits, metadata, self.generator)
        self._last_sampled = sampler_output.sampled_token_ids
        self._last_sampled_rows = {r: i for i, r in enumerate(step.req_ids)}
        for state in states:
            state.num_output_placeholders += 1
        if self.pp_group.size > 1:
            tokens = self._last_sampled
            if not self.pp_group.is_token_root:  # the root's tokens are the same
                tokens = torch.empty_like(tokens)
            step.token_broadcast = (tokens, self.pp_group.broadcast_tokens(tokens))
        step.output = sampler_output.start_copy_to_host()
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()

    def _prompt_views(
        self, num_scheduled: dict[str, int]
    ) -> dict[str, tuple[list[int], int, int | None]]:
        """What `prompt_rows` needs of each scheduled request, before this step's forward."""
        views = {}
        for req_id in num_scheduled:
            state = self.requests[req_id]
            k = state.params.prompt_logprobs
            views[req_id] = (state.prompt_token_ids, state.num_computed_tokens, k)
        return views

    def _await_stage_tokens(self, req_ids: list[str]) -> LaunchedStep:
        """A stage before the last: the step's sampled tokens arrive by the last stage's
        broadcast, joined now (stream-ordered) and read by `complete`."""
        states = [self.requests[r] for r in req_ids]
        for state in states:
            state.num_output_placeholders += 1
        tokens = torch.empty(len(req_ids), dtype=torch.int64, device=self.device)
        step = LaunchedStep(req_ids, states, None, None)
        step.token_broadcast = (tokens, self.pp_group.broadcast_tokens(tokens))
        return step

    def complete(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Waits for a launched step's tokens and hands them to the host."""
        assert step.pending is None, "a step awaiting its sampling cannot complete"
        prompt_logprobs = (
            {c.req_id: c.to_host() for c in step.prompt_logprobs} if step.prompt_logprobs else None
        )
        if step.token_broadcast is not None:
            tokens, work = step.token_broadcast
            if work is not None:
                work.wait()
            if step.output is None:  # a stage before the last
                return append_sampled(step, tokens.tolist(), None, prompt_logprobs)
        if step.output is None:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs)
        if step.done is not None:
            step.done.synchronize()
        sampled, logprobs = step.output.to_host([s.params.logprobs for s in step.states])
        return append_sampled(step, sampled, logprobs, prompt_logprobs)
