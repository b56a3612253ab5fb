"""Turns a SchedulerOutput into one model forward plus sampling (`launch`, `sample`, `complete`).
Beside the step it holds its requests' states, the pipeline stage's traffic, the linear-attention
state slots, grammar bitmasks and prompt logprobs; it never touches the block pool. Constrained
rows get their bitmask filled from the matchers; with `defer_sampling` the fill and the sampling
wait for `sample`, so the caller brings the matchers up to date while the forward runs."""

from __future__ import annotations

import torch

from ferrum.config import EngineConfig
from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.distributed.pipeline_group import PipelineGroup
from ferrum.kv.kv_cache_spec import layer_group_ids
from ferrum.lora.runner import lora_runner
from ferrum.model_executor.compile_watch import start_up_compiles, watch_serving_compiles
from ferrum.model_executor.cuda_graph import CUDAGraphRunner, max_graph_batch_size
from ferrum.model_executor.gpu_memory_profile import (
    kv_cache_torch_dtype,
    num_kv_blocks,
    split_kv_workspace,
)
from ferrum.model_executor.grammar_bitmask import GrammarBitmaskBuffers
from ferrum.model_executor.input_batch import InputBuffers, StepInputs, profile_batch
from ferrum.model_executor.kernel_backend import attach_flash_attention, resolve_kernel_backend
from ferrum.model_executor.kv_cache_sizing import allocate_kv_caches, kv_cache_group_specs
from ferrum.model_executor.model_loader import load_model
from ferrum.model_executor.pipeline_stage import pipeline_stage
from ferrum.model_executor.pipeline_transport import StageTransport
from ferrum.model_executor.prompt_logprobs import step_prompt_logprobs
from ferrum.model_executor.recurrent_state_cache import RecurrentStateCache
from ferrum.model_executor.runner_state import (
    LaunchedStep,
    PendingSample,
    RequestStates,
    append_sampled,
    append_verified,
    with_drafts,
)
from ferrum.model_executor.sampler import Sampler
from ferrum.model_executor.sampling_metadata import (
    SamplingMetadata,
    SamplingRow,
    sampling_staging,
)
from ferrum.model_executor.speculative.decoder import (
    speculative_decoder,
    verify_graph_sizes,
)
from ferrum.model_executor.speculative.verification import (
    accept,
    drafts_in_tokens,
    expand_rows,
    generator_states,
    rewind_generators,
)
from ferrum.model_executor.verify_states import verify_state_layout, with_scratch_slots
from ferrum.model_executor.warm_up import warm_up_runner
from ferrum.scheduler.output import ModelRunnerOutput, SchedulerOutput
from ferrum.speculative_config import max_sampled_rows
from ferrum.structured_output import StructuredOutputMatcher

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    """The runner of one rank. With a tensor-parallel group of several ranks it builds this
    rank's shard of the model; every rank computes the same full logits and samples them with the
    same generators, so every rank's sampled tokens are identical and each feeds its own next
    step. With a pipeline of several stages it builds its stage's layers; the scheduler never
    schedules a request whose previous token is still in the pipe."""

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
        model_config = config.model_config
        arch = model_config.arch
        self.stage = pipeline_stage(arch.num_hidden_layers, self.pp_group.rank, pp_size)
        self.dtype = _TORCH_DTYPES[model_config.dtype]
        self.block_size = config.cache_config.block_size
        self.vocab_size = model_config.vocab_size
        self.kernel_backend = resolve_kernel_backend(config.device_config, device)
        self.kv_cache_dtype = kv_cache_torch_dtype(config, self.dtype, self.kernel_backend, device)
        self.model = load_model(
            model_config,
            device,
            self.kernel_backend,
            self.tp_group,
            config.parallel_config.enable_expert_parallel,
            self.stage,
            config.device_config.batch_invariant,
        )
        flash_attention = attach_flash_attention(
            self.model, config.device_config, device, self.kernel_backend, self.dtype,
            self.kv_cache_dtype,
        )  # fmt: skip
        self.transport = StageTransport(
            self.pp_group, self.model, arch.hidden_size, self.dtype, device
        )
        self.split_kv_workspace = (
            split_kv_workspace(config, self.kv_cache_dtype, tp_size, device)
            if self._compiles_triton() and not config.device_config.batch_invariant
            else None
        )
        # KV cache layer groups (full attention, each sliding window, linear attention).
        self.kv_cache_groups = kv_cache_group_specs(model_config)
        self.recurrent = RecurrentStateCache(self.kv_cache_groups, self.block_size, device)
        self.inputs = InputBuffers.for_config(config, len(self.kv_cache_groups), device)
        self.inputs.marks_flash_attention = flash_attention
        self.speculative = speculative_decoder(
            config, self.model, self.inputs, self.kv_cache_groups, self.kernel_backend, device
        )
        max_rows = max_sampled_rows(config.scheduler_config.max_num_seqs, config.speculative_config)
        self.sampling_staging = sampling_staging(max_rows, device)
        self.sampler = Sampler(config.device_config.batch_invariant)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(model_config.seed)
        self.cuda_graphs: CUDAGraphRunner | None = None
        self.requests = RequestStates(len(self.kv_cache_groups), self.vocab_size, device)
        # The latest launched step's sampled tokens (on the device) and each request's row there.
        self._last_sampled = torch.zeros(0, dtype=torch.int64, device=device)
        self._last_sampled_rows: dict[str, int] = {}
        self.grammar_bitmasks = GrammarBitmaskBuffers(max_rows, self.vocab_size, device)
        self.lora = lora_runner(self.model, config, self.dtype, device)

    def determine_num_kv_blocks(self) -> list[int]:
        """KV blocks per layer group: the CPU budget, or what a profiled peak leaves on the GPU."""
        return num_kv_blocks(self)

    def initialize_kv_cache(self, num_blocks: int | list[int]) -> None:
        """Allocates every layer's cache (`num_blocks` per layer group, or one count for all;
        linear-attention pools get the verify steps' scratch slots past those)."""
        counts = (
            [num_blocks] * len(self.kv_cache_groups) if isinstance(num_blocks, int) else num_blocks
        )
        kv_caches = allocate_kv_caches(
            self.config.model_config,
            with_scratch_slots(self.config, self.kv_cache_groups, counts),
            self.block_size,
            self.kv_cache_dtype,
            self.device,
            self.tp_size,
            self.stage.layer_ids,
        )
        self.model.bind_kv_caches(
            kv_caches, self.split_kv_workspace, layer_group_ids(self.kv_cache_groups)
        )
        self.inputs.verify_layout = verify_state_layout(self.config, self.kv_cache_groups, counts)
        self.recurrent.bind(kv_caches)
        if self.speculative is not None:
            self.speculative.bind_kv_cache(counts, self.block_size, self.kv_cache_dtype)

    def disable_sdpa_after_prefixes(self) -> None:
        """Chunks after a cached prefix attend through the paged kernel, not through SDPA."""
        self.inputs.sdpa_prefix_per_chunk = 0

    def release_kv_cache(self) -> None:
        """Drops every layer's cache (the memory profile's, before the real one is sized)."""
        self.recurrent.bind([])
        self.inputs.verify_layout = None
        self.model.bind_kv_caches([])
        if self.speculative is not None:
            self.speculative.release_kv_cache()

    def forward_prompts(self, seq_lens: list[int]) -> torch.Tensor | None:
        """An eager forward of whole prompts (`profile_batch`); None before the last stage."""
        requests, num_scheduled = profile_batch(
            seq_lens, self.block_size, len(self.kv_cache_groups), self.recurrent.groups
        )
        batch = self.inputs.prepare(requests, num_scheduled, sum(seq_lens), {})
        return self.transport.run_eager(batch, sum(seq_lens))

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
            sched = self.config.scheduler_config
            self.cuda_graphs = CUDAGraphRunner(
                self.model,
                self.inputs,
                max_batch_size=max_graph_batch_size(sched.max_num_seqs),
                max_prefill_tokens=min(sched.max_num_batched_tokens, self.inputs.max_model_len),
                device=self.device,
                # A stage after the first reads the previous one's activations.
                stage_input_size=None if self.stage.is_first else self.transport.hidden_size,
                stage_input_dtype=self.dtype,
                **verify_graph_sizes(self.config),
                lora_batch=None if self.lora is None else self.lora.batch,
            )
            self.cuda_graphs.capture()
            if self.speculative is not None:
                self.speculative.capture_graphs(self.cuda_graphs)
        if self._compiles_triton():
            watch_serving_compiles()

    def _forward(
        self, inputs: StepInputs, graph_shape: tuple[int, int] | None, num_tokens: int
    ) -> torch.Tensor | None:
        """The step's hidden states (None on a pipeline stage before the last), after each
        placeholder's input id is set from the previous launched step's sampled tokens (in stream
        order: no host sync)."""
        n = inputs.num_placeholders
        if n and inputs.placeholder_index is None:
            inputs.input_ids[:n].copy_(self._last_sampled[:n])
        elif n:
            index, rows = inputs.placeholder_index
            inputs.input_ids[index] = self._last_sampled[rows]
        if graph_shape is None:
            return self.transport.run_eager(inputs, num_tokens)
        assert self.cuda_graphs is not None
        return self.transport.replay(self.cuda_graphs, graph_shape, num_tokens)

    @torch.inference_mode()
    def launch(
        self,
        scheduler_output: SchedulerOutput,
        matchers: dict[str, StructuredOutputMatcher] | None = None,
        defer_sampling: bool = False,
    ) -> LaunchedStep:
        """Queues one step's forward, sampling and token copy without waiting; steps complete
        in launch order, and the next may launch before (a decode reads this step's token on
        the device). With `defer_sampling` a step sampling a constrained row queues its forward
        only (`awaits_sampling`) until `sample`; otherwise `matchers` (the constrained requests'
        grammars) must have accepted every output token already."""
        requests = self.requests
        requests.apply(scheduler_output)
        if self.lora is not None:
            self.lora.apply(scheduler_output)
        self.recurrent.start_requests(scheduler_output.scheduled_new_reqs)
        if scheduler_output.is_empty:
            return LaunchedStep([], [], None, None)
        num_scheduled = scheduler_output.num_scheduled_tokens
        if self.lora is not None:
            self.lora.prepare(num_scheduled)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        graphs = self.cuda_graphs
        shape = (
            None
            if graphs is None
            else graphs.padded_shape(len(num_scheduled), num_tokens, max(num_scheduled.values()))
        )
        drafts = scheduler_output.scheduled_spec_decode_tokens
        with drafts_in_tokens(requests, drafts):
            inputs = self.inputs.prepare(
                requests, num_scheduled, num_tokens, self._last_sampled_rows, shape, drafts
            )
        hidden_states = self._forward(inputs, shape, num_tokens)
        if self.speculative is not None:
            self.speculative.follow(
                inputs, shape, num_tokens, requests, num_scheduled, hidden_states
            )
        self.recurrent.snapshot(requests, num_scheduled, drafts)
        prompt_chunks = step_prompt_logprobs(
            hidden_states, requests, num_scheduled, self.model.compute_logits
        )
        for req_id, n in num_scheduled.items():
            requests[req_id].num_computed_tokens += n
        req_ids = inputs.sampled_req_ids
        step = LaunchedStep(req_ids, [requests[r] for r in req_ids], None, None, prompt_chunks)
        if drafts:
            step.drafts = [drafts.get(r, []) for r in req_ids]
        if not req_ids:
            return step
        if hidden_states is None:  # a stage before the last: the tokens come from the last
            for state in step.states:
                state.num_output_placeholders += 1
            self.transport.receive_tokens(step)
            return step
        if inputs.logits_indices is not None:
            hidden_states = hidden_states[inputs.logits_indices]
        constrained = bool(matchers) and any(r in matchers for r in req_ids)
        step.pending = PendingSample(
            self.model.compute_logits(hidden_states), matchers if constrained else None
        )
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
        if step.drafts is not None:
            rows = expand_rows(rows, step.drafts)
            step.generator_states = generator_states(states, step.drafts)
        metadata = SamplingMetadata.from_rows(rows, self.vocab_size, self.sampling_staging)
        if pending.matchers:
            metadata.grammar_bitmask = self.grammar_bitmasks.fill(
                states, pending.matchers, step.drafts
            )
        sampler_output = self.sampler(pending.logits, metadata, self.generator)
        self._last_sampled = sampler_output.sampled_token_ids
        if self.speculative is not None:
            step.head_rows = self.speculative.after_sampling(self._last_sampled)
        # A verify step's rows are per draft: none may be a placeholder's input (the core
        # completes a verify step before it schedules the next).
        self._last_sampled_rows = (
            {} if step.drafts is not None else {r: i for i, r in enumerate(step.req_ids)}
        )
        for state in states:
            state.num_output_placeholders += 1
        self.transport.send_tokens(step, self._last_sampled)
        step.output = sampler_output.start_copy_to_host()
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record()

    def complete(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Waits for a launched step's tokens and hands them to the host."""
        assert step.pending is None, "a step awaiting its sampling cannot complete"
        prompt_logprobs = (
            {c.req_id: c.to_host() for c in step.prompt_logprobs} if step.prompt_logprobs else None
        )
        if step.token_broadcast is not None:
            tokens = self.transport.wait_tokens(step)
            if step.output is None:  # a stage before the last
                return append_sampled(step, tokens.tolist(), None, prompt_logprobs)
        if step.output is None:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs)
        if step.done is not None:
            step.done.synchronize()
        if step.drafts is None:
            sampled, logprobs = step.output.to_host([s.params.logprobs for s in step.states])
            output = append_sampled(step, sampled, logprobs, prompt_logprobs)
        else:
            asked = [s.params.logprobs for s, d in zip(step.states, step.drafts) for _ in [0, *d]]
            sampled, logprobs = step.output.to_host(asked)
            tokens, token_logprobs = accept(step.drafts, sampled, logprobs)
            layout = self.inputs.verify_layout
            if layout is not None:
                live = [self.requests.get(s.req_id) is s for s in step.states]
                self.recurrent.roll_back(step.states, step.drafts, tokens, live, layout)
            output = append_verified(step, tokens, token_logprobs, prompt_logprobs)
            rewind_generators(
                step.states, step.generator_states, tokens, self.vocab_size, self.device
            )
        if self.speculative is not None:
            # Not for a request preempted or finished since the step launched (async): its
            # blocks may be another's by now, and a draft model would write into them.
            live = [s for s in step.states if self.requests.get(s.req_id) is s]
            drafts = self.speculative.propose(
                live, len(self.requests), self.inputs, self.block_size, step, output
            )
            output.spec_decode = with_drafts(output.spec_decode, drafts)
        return output
