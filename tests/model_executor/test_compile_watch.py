"""The watch that reports Triton kernels compiled after start-up, and (on a GPU) that serving
an engine's steps of arbitrary token counts compiles none."""

from __future__ import annotations

import pytest
import torch

from ferrum.model_executor import compile_watch
from ferrum.model_executor.compile_watch import CompileWatch, describe_variant


class _FnInfo:
    name = "_kernel"


def _hook_kwargs() -> dict:
    return {
        "fn": _FnInfo(),
        "repr": "triton's repr",
        "compile": {
            "signature": {"x_ptr": "*bf16", "n": "i32", "m": "i32", "one": "constexpr"},
            "constants": {(3,): 1},
            "configs": [
                {(0,): [["tt.divisibility", 16]], (1,): [], (2,): [["tt.divisibility", 16]]}
            ],
        },
    }


def test_describes_constants_and_multiples_of_16() -> None:
    assert (
        describe_variant(_hook_kwargs()) == "_kernel(x_ptr: *bf16 %16, n: i32, m: i32 %16, one=1)"
    )


def test_falls_back_to_tritons_repr_for_an_unknown_layout() -> None:
    kwargs = _hook_kwargs()
    del kwargs["compile"]["configs"]
    assert describe_variant(kwargs) == "triton's repr"


def test_records_only_while_armed() -> None:
    watch = CompileWatch()
    watch.record("_start_up_kernel", "compiled by the warm-up")
    watch.arm()
    watch.record("_late_kernel", "compiled while serving")
    watch.disarm()
    watch.record("_next_runner_kernel", "another runner's start-up")
    assert [v.kernel for v in watch.variants()] == ["_late_kernel"]


def test_install_chains_the_hook_already_set(monkeypatch) -> None:
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw))
    watch = CompileWatch()
    assert watch.install()
    assert watch.install()  # idempotent: still one link
    watch.arm()
    knobs.runtime.jit_post_compile_hook(**_hook_kwargs())
    assert len(seen) == 1
    assert [v.kernel for v in watch.variants()] == ["_kernel"]


@pytest.fixture(autouse=True)
def _restore_tritons_hook(monkeypatch):
    """Every test here leaves Triton's process-wide post-compile hook as it found it."""
    try:
        from triton import knobs
    except ImportError:
        return
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", knobs.runtime.jit_post_compile_hook)


def test_install_again_rechains_after_the_hook_was_replaced(monkeypatch) -> None:
    from triton import knobs

    watch = CompileWatch()
    watch.install()
    watch.arm()
    replaced = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: replaced.append(1))
    assert watch.install()
    knobs.runtime.jit_post_compile_hook(**_hook_kwargs())
    assert replaced == [1] and len(watch.variants()) == 1


def test_a_hook_that_wrapped_ours_does_not_record_twice(monkeypatch) -> None:
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    watch = CompileWatch()
    watch.install()
    watch.arm()
    ours = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: ours(**kw)  # another library wraps it
    watch.install()  # chains in front of the wrapper, which still calls the old link
    knobs.runtime.jit_post_compile_hook(**_hook_kwargs())
    assert len(watch.variants()) == 1


def test_a_failing_record_never_fails_the_compile(monkeypatch) -> None:
    from triton import knobs

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw))
    watch = CompileWatch()
    watch.install()
    watch.arm()
    knobs.runtime.jit_post_compile_hook(no_fn_here=True)  # record cannot read the kernel
    assert len(seen) == 1 and watch.variants() == []


def _forget_compiled_kernels() -> None:
    """Empties the in-memory variants of every ferrum Triton kernel, so this process compiles
    (or loads from Triton's disk cache) each one again, through the post-compile hook."""
    import sys

    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if not name.startswith("ferrum.kernels"):
            continue
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                value.device_caches.clear()


class _EveryShapeTable:
    """A GEMV tile table listing every weight shape; the LM head (N = vocab) gets a tile of its
    own, as on a real table, so its variant is not one the projections compiled."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def get(self, shape: tuple[int, int]):
        from ferrum.kernels.gemv_config import GemvTile

        return GemvTile(2, 32) if shape[0] == self.vocab_size else GemvTile(4, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "model",
    [
        "qwen3",
        "qwen3_moe",
        "gemma3",
        "qwen3_5",
        "qwen3+sdpa",
        "qwen3+fp8",
        "qwen3_moe+fp8",
        "qwen3+fp8+sdpa",
    ],
)
def test_serving_compiles_no_kernel_after_start_up(tiny_checkpoint, monkeypatch, model) -> None:
    """ "+sdpa": chunks of 64+ tokens take SDPA's prefill, which splits steps around them (fresh
    ones and ones after a cached prefix, whose keys and values are gathered from the cache).
    "+fp8": quantized on load (W8A8 GEMMs, the GEMV, FP8 rows from the norms, the SiLU and the
    attention (heads of 128), FP8 experts)."""
    import json
    import random
    from pathlib import Path

    import ferrum.kernels.dense_linear as dense_linear_module
    import ferrum.kernels.sdpa_prefill as sdpa_module
    from ferrum import SamplingParams
    from ferrum.kernels.rms_norm import _rms_norm_kernel
    from tests.utils.tiny_llm import cuda_llm, random_prompts

    sdpa_calls = []
    through_sdpa = model.endswith("+sdpa")
    if through_sdpa:
        model = model.removesuffix("+sdpa")
        monkeypatch.setattr(sdpa_module, "SDPA_PREFILL_MIN_TOKENS", 64)
        real = sdpa_module.sdpa_prefill

        def recorded(query, key, value, starts, *args, context=None, **kwargs):
            # Per call: whether a chunk followed a cached prefix (the cache gather's path).
            chunks = [b - a for a, b in zip(starts[:-1], starts[1:])]
            sdpa_calls.append(any(n > c for n, c in zip(context.seq_lens, chunks)))
            return real(query, key, value, starts, *args, context=context, **kwargs)

        monkeypatch.setattr("ferrum.model_executor.layers.attention.sdpa_prefill", recorded)
    fp8 = model.endswith("+fp8")
    model = model.removesuffix("+fp8")
    # FP8 experts take the split down GEMV at 1-2 tokens: the rule's choice (fused_moe_rule) for
    # the tiny shape, which has no tuned file, as in the H100 file.
    # FP8 layers need input sizes that are multiples of 128; heads of 128 make the attention
    # write o_proj's FP8 rows.
    fp8_shapes = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 128}
    if model == "qwen3_moe":
        fp8_shapes["moe_intermediate_size"] = 128
    path = tiny_checkpoint(model, **fp8_shapes) if fp8 else tiny_checkpoint(model)
    config = json.loads((Path(path) / "config.json").read_text())
    vocab_size = config.get("text_config", config)["vocab_size"]
    table = _EveryShapeTable(vocab_size)
    monkeypatch.setattr(dense_linear_module, "gemv_tile", lambda n, k, device: table.get((n, k)))
    _forget_compiled_kernels()
    llm = cuda_llm(
        path,
        dtype="bfloat16",
        num_kv_blocks=512,
        max_num_batched_tokens=256,
        max_num_seqs=32,
        quantization="fp8" if fp8 else None,
    )
    before = len(compile_watch.compiled_while_serving())
    rng = random.Random(0)

    def serve_round(round_index: int) -> None:
        # Prompts of random lengths arriving together: chunked prefills beside decodes make
        # steps of nearly every token count up to the budget; one-prompt rounds decode alone.
        num_prompts = 1 if round_index % 3 == 0 else rng.randint(2, 32)
        lengths = [rng.randint(1, 200) for _ in range(num_prompts)]
        prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, seed=round_index)]
        params = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randint(1, 24), ignore_eos=True)
            for i in range(num_prompts)
        ]
        llm.generate(prompts, params, use_tqdm=False)

    for round_index in range(6):
        serve_round(round_index)
    assert [v.description for v in compile_watch.compiled_while_serving()[before:]] == []
    if through_sdpa:
        assert sdpa_calls and any(sdpa_calls) and not all(sdpa_calls)
    # The watch does see a compile: a kernel whose variants are forgotten compiles again in
    # the eager prefill of a round of several prompts.
    _rms_norm_kernel.device_caches.clear()
    serve_round(7)
    late = compile_watch.compiled_while_serving()[before:]
    assert late and {v.kernel for v in late} == {"_rms_norm_kernel"}
