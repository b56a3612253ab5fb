"""The EAGLE-3 head against an independent torch implementation (fp32, CPU): the target's aux
hidden states equal Hugging Face's hidden_states at those layers; the head's pass over a prompt
(paged KV) and a decode step after it (reading that KV) equal the reference's rows; its drafts
are the reference's argmax mapped through d2t."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferrum.eagle3_config import read_eagle3_config
from ferrum.model_executor.layers.aux_hidden_states import AuxHiddenStates
from ferrum.model_executor.speculative.eagle3_loader import load_eagle3_head, read_head_tensors
from tests.utils.eagle3_heads import (
    head_config,
    random_head_tensors,
    reference_head,
    write_head,
)
from tests.utils.model_step import BLOCK_SIZE, NUM_BLOCKS, Seq, build_step, load, prompt
from tests.utils.tiny_checkpoints import load_hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
AUX_LAYERS = [3, 0, 2]


@torch.inference_mode()
def test_head_pass_and_decode_step_equal_the_reference(tiny_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    """With the target's embedding, then with the head's own."""
    path = tiny_checkpoint("qwen3", num_hidden_layers=4)
    target_config, target = load(path, dtype="float32")
    aux = AuxHiddenStates(AUX_LAYERS, 64, 64, torch.float32, torch.device("cpu"))
    target.model.aux_hidden_states = aux
    tokens = prompt(11, offset=3)
    blocks = [5, 2, 7, 9]
    ids, positions, metadata = build_step([Seq(tokens, blocks, len(tokens))])
    target(ids, positions, metadata)
    hf = load_hf_model(path)(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    expected_aux = torch.cat([hf.hidden_states[i][0] for i in AUX_LAYERS], dim=-1)
    torch.testing.assert_close(aux.buffer[: len(tokens)], expected_aux, atol=1e-5, rtol=1e-5)

    config = head_config(eagle_aux_hidden_state_layer_ids=AUX_LAYERS)
    tensors = random_head_tensors(config, seed=5)
    own_embedding = {**tensors, "embed_tokens.weight": 0.15 * torch.randn(384, 64)}
    for head_tensors in (tensors, own_embedding):
        head_path = write_head(tmp_path / str(len(head_tensors)), config, head_tensors)
        eagle = read_eagle3_config(head_path, target_config.arch)
        cpu = torch.device("cpu")
        head = load_eagle3_head(eagle, target, torch.float32, cpu, "torch", False, None)
        head.bind_kv_caches([torch.zeros((2, NUM_BLOCKS, BLOCK_SIZE, 2, 16))])
        embedding = head_tensors.get("embed_tokens.weight", target.model.embed_tokens.weight)
        check_head(head, head_tensors, config, embedding, aux.buffer[: len(tokens)], tokens)


def check_head(
    head: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    config: dict,
    embedding: torch.Tensor,
    aux: torch.Tensor,
    tokens: list[int],
) -> None:
    # The pass: row i pairs hidden state i with token i + 1 (the last one a sampled 17).
    blocks = [5, 2, 7, 9]
    _, positions, metadata = build_step([Seq(tokens, blocks, len(tokens))])
    next_ids = torch.tensor(tokens[1:] + [17])
    fused = head.fuse(aux)
    normed, prenorm = head(next_ids, positions, metadata, fused)
    ref_normed, ref_prenorm = reference_head(tensors, config, embedding[next_ids], fused)
    torch.testing.assert_close(normed, ref_normed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prenorm, ref_prenorm, atol=1e-5, rtol=1e-5)
    draft = (ref_normed @ tensors["lm_head.weight"].T).argmax(-1)
    assert head.draft_token_ids(normed).tolist() == (draft + tensors["d2t"][draft]).tolist()

    # A decode step at the next position: the previous draft, the head's own pre-norm output.
    step_ids, step_positions, step_metadata = build_step([Seq(tokens + [17], blocks, 1)])
    step_ids[0] = 99
    step_normed, _ = head(step_ids, step_positions, step_metadata, prenorm[-1:])
    all_ids = torch.cat([next_ids, torch.tensor([99])])
    all_hidden = torch.cat([fused, prenorm[-1:]])
    ref_normed, _ = reference_head(tensors, config, embedding[all_ids], all_hidden)
    torch.testing.assert_close(step_normed, ref_normed[-1:], atol=1e-5, rtol=1e-5)


def test_heads_load_from_pytorch_model_bin(tmp_path: Path) -> None:
    """Most public heads ship a pytorch_model.bin: read with weights_only, like safetensors."""
    config = head_config()
    tensors = random_head_tensors(config, seed=1)
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    loaded = read_head_tensors(str(tmp_path))
    assert sorted(loaded) == sorted(tensors)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
