"""The layers of each pipeline stage and which checkpoint names a stage loads."""

from __future__ import annotations

import pytest

from ferrum.model_executor.pipeline_stage import pipeline_stage


@pytest.mark.parametrize(
    ("num_layers", "size", "ranges"),
    [
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 4)]),
        (3, 2, [(0, 2), (2, 3)]),  # the earlier stages take the extra layers
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_stages_split_the_layers_evenly_and_in_order(num_layers, size, ranges) -> None:  # noqa: ANN001
    stages = [pipeline_stage(num_layers, rank, size) for rank in range(size)]
    assert [(s.start_layer, s.end_layer) for s in stages] == ranges
    assert [s.is_first for s in stages] == [True] + [False] * (size - 1)
    assert [s.is_last for s in stages] == [False] * (size - 1) + [True]


def test_a_stage_holds_its_layers_the_embedding_first_and_the_head_last() -> None:
    first, last = pipeline_stage(4, 0, 2), pipeline_stage(4, 1, 2)
    assert first.holds_parameter("model.layers.1.mlp.down_proj.weight")
    assert not first.holds_parameter("model.layers.2.mlp.down_proj.weight")
    assert last.holds_parameter("model.layers.3.self_attn.qkv_proj.weight")
    assert first.holds_parameter("model.embed_tokens.weight")
    assert not last.holds_parameter("model.embed_tokens.weight")
    assert last.holds_parameter("lm_head.weight") and last.holds_parameter("model.norm.weight")
    assert not first.holds_parameter("lm_head.weight")
    assert not first.holds_parameter("model.norm.weight")


@pytest.mark.parametrize(
    ("args", "message"),
    [((2, 2, 2), r"rank: must be in \[0, pipeline_parallel_size=2\)"), ((2, 0, 3), "at least")],
)
def test_bad_stages_are_refused(args, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        pipeline_stage(*args)


def test_linear_attention_models_refuse_a_pipeline(tiny_checkpoint) -> None:  # noqa: ANN001
    from ferrum.config import ModelConfig
    from ferrum.kernels.interface import torch_kernels
    from ferrum.model_executor.models.registry import get_model_class

    config = ModelConfig(tiny_checkpoint("qwen3_5"))
    model_class = get_model_class(config.architecture)
    stage = pipeline_stage(config.arch.num_hidden_layers, 0, 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size: .* one GPU only"):
        model_class(config.arch, torch_kernels(), pipeline_stage=stage)
