"""Train an EAGLE-3 head for the shipped tiny model (ferrum-tiny-qwen3) on the CPU, on the
model's own generations (the way EAGLE and SpecForge train when the corpus is not at hand).

    python tools/train_eagle3_head.py data --out /tmp/e3       # generations + features
    python tools/train_eagle3_head.py train --data /tmp/e3 --out HEAD_DIR --minutes 10

`data`: prompts are a capitalized word and a lower-case word from the tokenizer's vocabulary
("Table columns", "When using"); a hash of the first word puts a prompt in the train or the
held-out split (held-out also gets the words of the model card's sample prompts). transformers
generates from them (sampled at the model's defaults T=0.8, top-p 0.95, top-k 50, one sequence
in five greedy), then one fp32 forward gives the residual stream at the inputs of decoder
layers 2, 4 and 5 (vLLM's ids for 8 layers; `hidden_states[i]`) and the target's greedy token
at every position (the label: the draft that the target accepts most often).
`train`: one EAGLE-3 layer over fc(aux) with the target's tied embedding shared, a draft
vocabulary of the most frequent labels, and the training-time test of EAGLE-3: steps 2 and 3
read the head's own pre-norm output of the step before (at the previous position) and attend
to the earlier steps' keys the way the engine's decode steps do. The head is written as
config.json + model.safetensors (bf16) in the public EAGLE-3 format that ferrum loads."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import zlib

import ferrum  # noqa: F401  (before torch: ferrum sets the CPU threads' wait policy)

# isort: split
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ferrum.default_model import DEFAULT_MODEL_DIR

AUX_LAYERS = (2, 4, 5)
HELD_OUT_WORDS = ("The", "To", "Rust", "Python")  # the model card's sample prompts start so


def prompt_words(tokenizer) -> tuple[list[int], list[int]]:
    """(capitalized word tokens, lower-case word tokens) of the vocabulary ("ĠTable": " Table")."""
    caps, lower = [], []
    for token, i in tokenizer.get_vocab().items():
        word = token[1:]
        if token.startswith("Ġ") and word.isascii() and word.isalpha() and len(word) >= 3:
            (caps if word[0].isupper() and word[1:].islower() else lower).append(i)
    return sorted(caps), sorted(i for i in lower if tokenizer.decode([i])[1:].islower())


def is_held_out(word: str) -> bool:
    return word in HELD_OUT_WORDS or zlib.crc32(word.encode()) % 8 == 0


def make_prompts(tokenizer, held_out: bool, n: int, seed: int) -> list[list[int]]:
    """n prompts of a capitalized word (its first token without the space) and a lower-case
    word; the capitalized words of the held-out split never start a train prompt."""
    caps, lower = prompt_words(tokenizer)
    g = torch.Generator().manual_seed(seed)
    firsts = []
    for i in caps:
        word = tokenizer.decode([i]).strip()
        if is_held_out(word) == held_out:
            firsts.append(tokenizer.encode(word, add_special_tokens=False))
    for word in HELD_OUT_WORDS if held_out else ():
        firsts.append(tokenizer.encode(word, add_special_tokens=False))
    prompts = []
    for _ in range(n):
        first = firsts[int(torch.randint(len(firsts), (1,), generator=g))]
        prompts.append(first + [lower[int(torch.randint(len(lower), (1,), generator=g))]])
    return prompts


@torch.no_grad()
def generate(model, prompts: list[list[int]], new_tokens: int, greedy: bool, seed: int):
    """[n, prompt + new_tokens] token ids (prompts grouped by length; no early end-of-text)."""
    torch.manual_seed(seed)
    rows = []
    for length in sorted({len(p) for p in prompts}):
        ids = torch.tensor([p for p in prompts if len(p) == length])
        for chunk in ids.split(128):
            kw = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 0.8,
                                                      "top_p": 0.95, "top_k": 50}  # fmt: skip
            out = model.generate(input_ids=chunk, attention_mask=torch.ones_like(chunk),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0, **kw)  # fmt: skip
            rows.extend(out[:, -(new_tokens + 2) :])  # the same length for every prompt
    return torch.stack(rows)


@torch.no_grad()
def features(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """aux: [n, T, 3 * hidden] bf16 (the inputs of AUX_LAYERS); label: [n, T] the target's
    greedy next token at each position."""
    aux, label = [], []
    for chunk in ids.split(32):
        out = model(chunk, output_hidden_states=True)
        aux.append(torch.cat([out.hidden_states[i] for i in AUX_LAYERS], -1).bfloat16())
        label.append(out.logits.argmax(-1))
    return {"ids": ids, "aux": torch.cat(aux), "label": torch.cat(label)}


def cmd_data(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    os.makedirs(args.out, exist_ok=True)
    for split, n, seed in (("train", args.train_seqs, 1), ("heldout", args.heldout_seqs, 2)):
        start = time.time()
        prompts = make_prompts(tokenizer, split == "heldout", n, seed)
        n_greedy = n // 5
        ids = torch.cat([
            generate(model, prompts[:n_greedy], args.new_tokens, True, seed),
            generate(model, prompts[n_greedy:], args.new_tokens, False, seed),
        ])  # fmt: skip
        data = features(model, ids)
        torch.save(data, os.path.join(args.out, f"{split}.pt"))
        print(f"{split}: {tuple(ids.shape)} tokens in {time.time() - start:.0f} s", flush=True)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Head(nn.Module):
    """The head with the checkpoint's parameter names (`midlayer.*`, `fc`, `norm`, `lm_head`)."""

    def __init__(self, cfg: dict, embedding: torch.Tensor, draft_ids: torch.Tensor) -> None:
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.heads, self.kv, self.d = (
            cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])  # fmt: skip
        self.fc = nn.Linear(len(AUX_LAYERS) * h, h, bias=False)
        mid = {
            "self_attn.q_proj": (self.heads * self.d, 2 * h),
            "self_attn.k_proj": (self.kv * self.d, 2 * h),
            "self_attn.v_proj": (self.kv * self.d, 2 * h),
            "self_attn.o_proj": (h, self.heads * self.d),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }
        self.midlayer = nn.Module()
        for name, (o, i) in mid.items():
            part, proj = name.split(".")
            if not hasattr(self.midlayer, part):
                self.midlayer.add_module(part, nn.Module())
            getattr(self.midlayer, part).add_module(proj, nn.Linear(i, o, bias=False))
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            self.midlayer.register_parameter(name, nn.Parameter(torch.ones(h)))
        self.norm = nn.Parameter(torch.ones(h))
        # The target's (tied) LM head rows of the draft tokens: a start that already scores.
        self.lm_head = nn.Linear(h, len(draft_ids), bias=False)
        self.lm_head.weight.data.copy_(embedding[draft_ids])
        self.register_buffer("embedding", embedding, persistent=False)
        inv = cfg["rope_theta"] ** (-torch.arange(0, self.d, 2).float() / self.d)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, tokens, hidden, caches):
        """One step over [B, T] rows (row q: the token after q, hidden at q, position q);
        `caches`: the earlier steps' (k, v), each step's shifted one position further back.
        Returns (normed, pre-norm, (k, v))."""
        b, t, _ = hidden.shape
        m, a = self.midlayer, self.midlayer.self_attn
        x = torch.cat(
            [rms(self.embedding[tokens], m.input_layernorm), rms(hidden, m.hidden_norm)], -1
        )
        angles = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        q = rotate(a.q_proj(x).view(b, t, self.heads, self.d).transpose(1, 2), cos, sin)
        k = rotate(a.k_proj(x).view(b, t, self.kv, self.d).transpose(1, 2), cos, sin)
        v = a.v_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        step = len(caches)
        # Step 0's keys up to q - step, then step i's key at q - (step - i), then its own.
        k0, v0 = caches[0] if caches else (k, v)
        scores = [q @ k0.transpose(-1, -2) / math.sqrt(self.d)]
        mask = torch.ones(t, t, dtype=torch.bool).tril(-step)
        scores[0] = scores[0].masked_fill(~mask, float("-inf"))
        values = []
        for i, (ki, vi) in enumerate([*caches[1:], (k, v)] if caches else [], start=1):
            shift = step - i
            ki, vi = F.pad(ki, (0, 0, shift, 0))[:, :, :t], F.pad(vi, (0, 0, shift, 0))[:, :, :t]
            scores.append((q * ki).sum(-1, keepdim=True) / math.sqrt(self.d))
            values.append(vi)
        probs = torch.cat(scores, -1).softmax(-1)
        out = probs[..., :t] @ v0
        for j, vi in enumerate(values):
            out = out + probs[..., t + j : t + j + 1] * vi
        residual = hidden + a.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        y = rms(residual, m.post_attention_layernorm)
        residual = residual + m.mlp.down_proj(F.silu(m.mlp.gate_proj(y)) * m.mlp.up_proj(y))
        return rms(residual, self.norm), residual, (k, v)


def unrolled_loss(head, batch, steps, t2d_index):
    """Cross-entropy of each of `steps` unrolled steps against the target's greedy token two
    positions on (rows whose label is outside the draft vocabulary are skipped); and top-1
    accuracy per step."""
    ids, aux, label = batch["ids"], batch["aux"].float(), batch["label"]
    tokens, target = ids[:, 1:], t2d_index[label[:, 1:]]  # row q: token q + 1, predicts q + 2
    hidden = head.fc(aux[:, :-1])
    caches, losses, accs = [], [], []
    for step in range(steps):
        normed, prenorm, kv = head(tokens, hidden, caches)
        caches.append(kv)
        logits = head.lm_head(normed)[:, step:]
        y = target[:, step:]
        losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1))
        accs.append(((logits.argmax(-1) == y) & (y >= 0)).sum().item() / max(1, y.numel()))
        hidden = F.pad(prenorm, (0, 0, 1, 0))[:, :-1]  # step + 1 at q reads step's at q - 1
    return losses, accs


def head_config(args, target: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "intermediate_size": args.intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": target["rope_theta"],
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": args.draft_vocab,
        "target_hidden_size": target["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def draft_vocabulary(labels: torch.Tensor, size: int, vocab: int):
    """(the `size` most frequent labels, sorted; target id -> draft id or -1; coverage)."""
    counts = torch.bincount(labels.flatten(), minlength=vocab)
    draft_ids = counts.topk(size).indices.sort().values
    t2d_index = torch.full((vocab,), -1, dtype=torch.int64)
    t2d_index[draft_ids] = torch.arange(size)
    return draft_ids, t2d_index, counts[draft_ids].sum().item() / counts.sum().item()


def evaluate(head, data, steps, t2d_index) -> list[float]:
    head.eval()
    totals = [0.0] * steps
    with torch.no_grad():
        n = len(data["ids"])
        for s in range(0, n, 64):
            batch = {key: value[s : s + 64] for key, value in data.items()}
            _, accs = unrolled_loss(head, batch, steps, t2d_index)
            totals = [t + a * len(batch["ids"]) / n for t, a in zip(totals, accs)]
    head.train()
    return totals


def save_head(head, cfg: dict, draft_ids: torch.Tensor, out: str) -> None:
    tensors = {}
    for name, value in head.state_dict().items():
        if name.endswith(("norm", "layernorm")):
            name += ".weight"
        tensors[name] = value.detach().to(torch.bfloat16).contiguous()
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(tensors, os.path.join(out, "model.safetensors"))


def cmd_train(args) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    train = torch.load(os.path.join(args.data, "train.pt"))
    heldout = torch.load(os.path.join(args.data, "heldout.pt"))
    with open(os.path.join(DEFAULT_MODEL_DIR, "config.json")) as f:
        target = json.load(f)
    cfg = head_config(args, target)
    draft_ids, t2d_index, coverage = draft_vocabulary(
        train["label"][:, 1:], args.draft_vocab, target["vocab_size"]
    )
    held_labels = heldout["label"][:, 1:].flatten()
    held_coverage = (t2d_index[held_labels] >= 0).float().mean().item()
    print(f"draft vocabulary {args.draft_vocab}: covers {coverage:.3f} of train labels, "
          f"{held_coverage:.3f} of held-out", flush=True)  # fmt: skip
    embedding = load_file(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors"))
    head = Head(cfg, embedding["model.embed_tokens.weight"].float(), draft_ids)
    params = [p for p in head.parameters() if p.requires_grad]
    print(f"head parameters: {sum(p.numel() for p in params):,}", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    weights = [0.8**s for s in range(args.steps)]
    start, step, n = time.time(), 0, len(train["ids"])
    budget = args.minutes * 60
    while time.time() - start < budget:
        order = torch.randperm(n)
        for s in range(0, n - args.batch + 1, args.batch):
            frac = (time.time() - start) / budget
            if frac >= 1:
                break
            warm = min(1.0, (step + 1) / 30)
            for group in opt.param_groups:
                group["lr"] = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            batch = {key: value[order[s : s + args.batch]] for key, value in train.items()}
            losses, accs = unrolled_loss(head, batch, args.steps, t2d_index)
            loss = sum(w * item for w, item in zip(weights, losses)) / sum(weights)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                print(f"step {step} ({time.time() - start:.0f} s) loss {loss.item():.3f} "
                      f"acc {[round(a, 3) for a in accs]}", flush=True)  # fmt: skip
        print(f"held-out top-1 per step: {evaluate(head, heldout, args.steps, t2d_index)}",
              flush=True)  # fmt: skip
    save_head(head, cfg, draft_ids, args.out)
    print(f"wrote {args.out} after {step} steps, {time.time() - start:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    data = sub.add_parser("data", help="generate text and compute the target's features")
    data.add_argument("--out", required=True)
    data.add_argument("--train-seqs", type=int, default=1280)
    data.add_argument("--heldout-seqs", type=int, default=128)
    data.add_argument("--new-tokens", type=int, default=190)
    train = sub.add_parser("train", help="train the head on `data`'s output and write it")
    train.add_argument("--data", required=True)
    train.add_argument("--out", required=True)
    train.add_argument("--minutes", type=float, default=10.0)
    train.add_argument("--draft-vocab", type=int, default=1024)
    train.add_argument("--intermediate", type=int, default=256)
    train.add_argument("--steps", type=int, default=3, help="unrolled steps (training-time test)")
    train.add_argument("--batch", type=int, default=32)
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cmd_data(args) if args.cmd == "data" else cmd_train(args)


if __name__ == "__main__":
    main()
