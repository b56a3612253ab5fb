"""EAGLE-3 through `LLM` (tiny fp32 checkpoints, heads written by tests/utils/eagle3_heads.py):
greedy tokens equal those without speculation under chunked prefill, prefix hits, preemption and
async scheduling; a head crafted to propose the target's continuation gets its first draft
accepted every time; the engine's drafts equal a reference head recomputed from scratch; heads
that cannot serve the target are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.errors import FieldError
from tests.utils.eagle3_heads import (
    head_config,
    random_head_tensors,
    reference_head,
    successor_head_tensors,
    write_head,
    write_successor_target,
)
from tests.utils.speculation import record_proposals
from tests.utils.tiny_checkpoints import load_hf_model
from tests.utils.tiny_llm import make_llm, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = random_prompts([9, 17, 26, 13, 5], seed=21)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def generate(llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def eagle3(head: str, **overrides: object) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": 3,
            "disable_by_batch_size": None, **overrides}  # fmt: skip


@pytest.fixture(scope="module")
def target(tiny_checkpoint) -> str:  # noqa: ANN001
    """Four layers: the default aux layers (2, 2, 1) exist."""
    return tiny_checkpoint("qwen3", num_hidden_layers=4)


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = head_config()
    return write_head(tmp_path_factory.mktemp("head"), config, random_head_tensors(config, 1))


def test_a_head_leaves_greedy_tokens_unchanged(target: str, head: str) -> None:
    """Chunks of 6 tokens, then every prompt again (prefix hits), a pool tight enough to
    preempt, and async scheduling with requests finishing one by one while 3 or more run
    (speculation off) and then fewer (on)."""
    expected = generate(make_llm(target))
    chunked = make_llm(target, speculative_config=eagle3(head), max_num_batched_tokens=6)
    for _ in range(2):
        assert generate(chunked) == expected
    stats = chunked.llm_engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_num_drafts > 0
    tight = make_llm(target, speculative_config=eagle3(head), num_kv_blocks=16)
    assert generate(tight) == expected
    assert tight.llm_engine.stats().num_preemptions > 0
    spec = eagle3(head, disable_by_batch_size=3)
    llm = make_llm(target, speculative_config=spec, async_scheduling=True)
    lengths = [16, 4, 9, 14, 12]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    assert generate(llm, params) == [e[:n] for e, n in zip(expected, lengths)]
    assert llm.llm_engine.stats().spec_num_drafts > 0


def test_a_head_that_knows_the_continuation_gets_its_drafts_accepted(
    tiny_checkpoint,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """The target's greedy token after t is t + 1; the head proposes t + 2 at the row of t:
    every first draft is right (the head's row, its next token and d2t line up), the later
    ones (from the head's own output, which here repeats its input) are not."""
    target = write_successor_target(tiny_checkpoint("qwen3"), tmp_path / "target")
    config = head_config(draft_vocab_size=384, eagle_aux_hidden_state_layer_ids=[1, 0, 1])
    head = write_head(tmp_path / "head", config, successor_head_tensors(target, config))
    expected = generate(make_llm(target))
    assert all(b == (a + 1) % 384 for e in expected for a, b in zip(e, e[1:]))
    llm = make_llm(target, speculative_config=eagle3(head), max_num_batched_tokens=8)
    assert generate(llm) == expected
    stats = llm.llm_engine.stats()
    assert stats.spec_num_drafts > 0
    assert stats.spec_accepted_per_position[0] == stats.spec_num_drafts
    assert stats.spec_num_accepted_tokens == stats.spec_num_drafts


def test_drafts_equal_a_reference_recomputed_from_scratch(tiny_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    """Every proposal (prompt chunks of 5, verify steps accepting some drafts) equals the
    drafts of `reference_head` run on the whole sequence: HF's hidden states of the target, the
    head's rows over them, then each draft appended as a row of its own. The head is the
    successor head with attention and MLP on (random o_proj, down_proj): its first drafts are
    mostly right, and the later ones read the head's KV of every earlier position."""
    target = write_successor_target(tiny_checkpoint("qwen3"), tmp_path / "target")
    config = head_config(draft_vocab_size=384, eagle_aux_hidden_state_layer_ids=[1, 0, 1])
    tensors = successor_head_tensors(target, config)
    noise = random_head_tensors(config, seed=3)
    for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        tensors[name] = noise[name]
    head = write_head(tmp_path / "head", config, tensors)
    llm = make_llm(target, speculative_config=eagle3(head), max_num_batched_tokens=5)
    proposals = record_proposals(llm)
    generate(llm)
    hf, embedding = load_hf_model(target), tensors_of(target)["model.embed_tokens.weight"]
    several = [p for p in proposals if len(p[1]) > 1]
    assert len(several) > 10
    for tokens, drafts in several[:10] + [p for p in proposals if len(p[1]) == 1][:3]:
        assert drafts == reference_drafts(hf, embedding, tensors, config, tokens, len(drafts))


def tensors_of(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")


@torch.inference_mode()
def reference_drafts(
    hf: torch.nn.Module,
    embedding: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    config: dict,
    tokens: list[int],
    k: int,
) -> list[int]:
    """Row p: the target's states at p (before layers 1, 0, 1) with token p + 1; draft i + 1
    from the row of the last known token's predecessor, then from each draft's own row."""
    states = hf(input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in (1, 0, 1)], dim=-1)
    hidden, ids, drafts = aux @ tensors["fc.weight"].T, list(tokens[1:]), []
    for _ in range(k):
        normed, prenorm = reference_head(tensors, config, embedding[ids], hidden)
        draft = int((normed[-1] @ tensors["lm_head.weight"].T).argmax())
        drafts.append(draft + int(tensors["d2t"][draft]))
        hidden, ids = torch.cat([hidden, prenorm[-1:]]), ids + [drafts[-1]]
    return drafts


def test_heads_that_cannot_serve_the_target_are_refused(
    tiny_checkpoint,
    target: str,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    config = head_config()
    tensors = random_head_tensors(config, 1)

    def refused(match: str, path: str = target, **overrides: object) -> None:
        with pytest.raises(FieldError, match=match) as error:
            make_llm(path, speculative_config=eagle3(str(tmp_path), **overrides))
        assert error.value.field.startswith("speculative_config")

    write_head(tmp_path, config, {k: v for k, v in tensors.items() if k != "fc.weight"})
    refused("lacks tensor 'fc.weight'")
    write_head(tmp_path, config, {**tensors, "lm_head.weight": tensors["lm_head.weight"][:200]})
    refused("'lm_head.weight' is \\[200, 64\\].*draft_vocab_size")
    write_head(tmp_path, head_config(vocab_size=512), tensors)
    refused("vocab_size 512 differs")
    write_head(tmp_path, head_config(num_hidden_layers=2), tensors)
    refused("num_hidden_layers")
    write_head(tmp_path, head_config(eagle_aux_hidden_state_layer_ids=[0, 4, 1]), tensors)
    refused("eagle_aux_hidden_state_layer_ids")
    write_head(tmp_path, config, tensors)
    refused("eagle_aux_hidden_state_layer_ids", tiny_checkpoint("qwen3"))  # 2 layers: (2, 1, -1)
    refused("full-attention layers", tiny_checkpoint("mistral_sw", num_hidden_layers=4))
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["X"]}))
    refused("not an EAGLE-3 head")
    refused("speculative_config.model", target, model=None)


def test_dummy_weights_need_only_the_heads_config(target: str, tmp_path: Path) -> None:
    """load_format dummy (benchmarks): the head's config.json alone, random weights."""
    (tmp_path / "config.json").write_text(json.dumps(head_config()))
    expected = generate(make_llm(target, load_format="dummy"))
    llm = make_llm(target, load_format="dummy", speculative_config=eagle3(str(tmp_path)))
    assert generate(llm) == expected
    assert llm.llm_engine.stats().spec_num_drafts > 0
