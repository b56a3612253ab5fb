"""Train ferrum's tiny Qwen3 model from scratch (plain PyTorch), and manage its weight files.

Subcommands (run from the repository root):
  train        --data DIR --out DIR [--epochs E | --steps N] [--max-minutes M]
               Trains on DIR/train.npy (uint16 ids from tools/train_tokenizer.py) on the GPU
               with bf16 autocast, AdamW and a cosine schedule. Every eval interval it measures
               the loss on the first half of DIR/heldout.npy (validation) and, when that
               improved, writes the model to --out as safetensors shards of at most 12 MiB
               (model-0000i-of-0000n.safetensors) plus config.json, generation_config.json,
               metrics.json and train_log.txt. The reported held-out loss is on the second half.
  assemble     --shards DIR [--model-dir DIR]: merges the shards into one model.safetensors and
               copies config.json / generation_config.json into the model folder.
  init-random  [--model-dir DIR]: writes config files and random bf16 weights into the folder.

The parameter names equal Hugging Face's Qwen3ForCausalLM (tied embeddings: no lm_head.weight).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model_config as cfg  # noqa: E402

SHARD_BYTES = 12 * 1024 * 1024


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[2, seq_len, head_dim] cos and sin tables, each half-dim frequency repeated twice."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class Qwen3Attention(nn.Module):
    def __init__(self, c: dict, dropout: float) -> None:
        super().__init__()
        hidden, self.head_dim = c["hidden_size"], c["head_dim"]
        self.num_heads, self.num_kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, c["rms_norm_eps"])
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope[0, :t].to(q.dtype), rope[1, :t].to(q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dropout(self.o_proj(out.transpose(1, 2).reshape(b, t, -1)))


class Qwen3MLP(nn.Module):
    def __init__(self, c: dict, dropout: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, c: dict, dropout: float) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(c, dropout)
        self.mlp = Qwen3MLP(c, dropout)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, c: dict, dropout: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(c, dropout) for _ in range(c["num_hidden_layers"])
        )
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with tied input/output embeddings; forward returns logits [batch, seq, vocab]."""

    def __init__(self, c: dict, dropout: float = 0.0) -> None:
        super().__init__()
        self.model = Qwen3Model(c, dropout)
        rope = rope_cos_sin(c["max_position_embeddings"], c["head_dim"], c["rope_theta"], "cpu")
        self.register_buffer("rope", rope, persistent=False)
        std = c["initializer_range"]
        residual_scale = 1 / math.sqrt(2 * c["num_hidden_layers"])
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # Residual-branch outputs start smaller so the stream's variance stays ~1.
                is_residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(p, mean=0.0, std=std * (residual_scale if is_residual else 1.0))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, self.rope)
        return self.model.norm(x) @ self.model.embed_tokens.weight.t()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def bf16_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()
    }


def save_shards(tensors: dict[str, torch.Tensor], out_dir: Path) -> list[Path]:
    """Writes `tensors` as safetensors files of at most SHARD_BYTES each (whole tensors)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append({})
            size = 0
        groups[-1][name] = tensors[name]
        size += nbytes
    for old in out_dir.glob("model-*-of-*.safetensors"):
        old.unlink()
    paths = []
    for i, group in enumerate(groups):
        path = out_dir / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(path), metadata={"format": "pt"})
        paths.append(path)
    return paths


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping [n, seq_len + 1] windows (each shares its last token with the next)."""
    n = (len(tokens) - 1) // seq_len
    starts = torch.arange(n, device=tokens.device)[:, None] * seq_len
    return tokens[starts + torch.arange(seq_len + 1, device=tokens.device)[None]]


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over all windows of `data`."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(data), batch_size):
        batch = data[start : start + batch_size]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=data.is_cuda):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"
        )
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def lr_at(step: int, total_steps: int, peak_lr: float, warmup_steps: int) -> float:
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "train_log.txt", "w", encoding="utf-8") as log_file:

        def log(msg: str) -> None:
            print(msg, flush=True)
            log_file.write(msg + "\n")
            log_file.flush()

        _train_loop(args, device, out_dir, log)


def _train_loop(
    args: argparse.Namespace, device: torch.device, out_dir: Path, log: Callable[[str], None]
) -> None:
    train_ids = torch.from_numpy(np.load(args.data / "train.npy").astype(np.int64)).to(device)
    heldout_ids = torch.from_numpy(np.load(args.data / "heldout.npy").astype(np.int64)).to(device)
    half = len(heldout_ids) // 2
    val = windows(heldout_ids[:half], args.seq_len)
    test = windows(heldout_ids[half:], args.seq_len)
    log(
        f"device={device} train_tokens={len(train_ids):,} val_windows={len(val)} "
        f"test_windows={len(test)}"
    )

    model = Qwen3ForCausalLM(cfg.MODEL_CONFIG, dropout=args.dropout).to(device)
    num_params = count_parameters(model)
    log(f"parameters={num_params:,}")
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    compiled = torch.compile(model) if args.compile and device.type == "cuda" else None
    gen = torch.Generator(device=device).manual_seed(args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    total_steps = args.steps or math.ceil(args.epochs * len(train_ids) / tokens_per_step)
    log(f"total_steps={total_steps} tokens_per_step={tokens_per_step}")
    start = time.perf_counter()
    deadline = start + args.max_minutes * 60
    best_val = float("inf")
    best: dict[str, object] = {}
    step = 0
    while step < total_steps:
        lr = lr_at(step, total_steps, args.lr, args.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(
            0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=gen, device=device
        )
        batch = train_ids[offsets[:, None] + torch.arange(args.seq_len + 1, device=device)[None]]
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = (model if compiled is None else compiled)(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
        except Exception as exc:  # torch.compile failing on its first call: train eagerly.
            if compiled is None or step > 0:
                raise
            log(f"torch.compile failed ({type(exc).__name__}: {exc}); training eagerly")
            compiled = None
            optimizer.zero_grad(set_to_none=True)
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        out_of_time = time.perf_counter() > deadline
        last = step == total_steps or out_of_time
        if step % args.eval_interval == 0 or last:
            val_loss = evaluate(model, val, args.batch_size)
            elapsed = time.perf_counter() - start
            epochs = step * tokens_per_step / len(train_ids)
            log(
                f"step {step}/{total_steps} lr {lr:.2e} "
                f"train_loss {loss.item():.4f} val_loss {val_loss:.4f} "
                f"epochs {epochs:.2f} elapsed {elapsed:.0f}s"
            )
            if val_loss < best_val:
                best_val = val_loss
                test_loss = evaluate(model, test, args.batch_size)
                best = {
                    "step": step,
                    "tokens_seen": step * tokens_per_step,
                    "epochs": round(epochs, 3),
                    "train_loss": round(loss.item(), 4),
                    "val_loss": round(val_loss, 4),
                    "heldout_test_loss": round(test_loss, 4),
                    "heldout_test_perplexity": round(math.exp(test_loss), 3),
                }
                save_shards(bf16_state_dict(model), out_dir)
                cfg.write_model_config_files(out_dir)
                log(f"  saved checkpoint: {json.dumps(best)}")
            metrics = {
                "parameters": num_params,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "seed": args.seed,
                "total_steps": total_steps,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "peak_lr": args.lr,
                "warmup_steps": args.warmup_steps,
                "weight_decay": args.weight_decay,
                "dropout": args.dropout,
                "train_tokens": len(train_ids),
                "steps_done": step,
                "train_seconds": round(elapsed, 1),
                "best": best,
            }
            (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if out_of_time:
            log(f"stopped at step {step}: --max-minutes {args.max_minutes} reached")
            break
    log(f"done: best {json.dumps(best)}")


def assemble(shards_dir: Path, model_dir: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(shards_dir.glob("model-*-of-*.safetensors")):
        tensors.update(load_file(str(path)))
    if not tensors:
        raise ValueError(f"shards: no model-*-of-*.safetensors in {shards_dir}")
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(shards_dir / name, model_dir / name)


def init_random(model_dir: Path, seed: int) -> None:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg.MODEL_CONFIG)
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        bf16_state_dict(model), str(model_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    cfg.write_model_config_files(model_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train")
    p_train.add_argument("--data", type=Path, default=Path(".device_carry/corpus"))
    p_train.add_argument("--out", type=Path, required=True)
    p_train.add_argument("--epochs", type=float, default=6.0)
    p_train.add_argument("--max-minutes", type=float, default=7.0, help="wall-clock cap")
    p_train.add_argument("--steps", type=int, default=0, help="step count (overrides --epochs)")
    p_train.add_argument("--batch-size", type=int, default=32)
    p_train.add_argument("--seq-len", type=int, default=512)
    p_train.add_argument("--lr", type=float, default=2e-3)
    p_train.add_argument("--warmup-steps", type=int, default=300)
    p_train.add_argument("--weight-decay", type=float, default=0.1)
    p_train.add_argument("--dropout", type=float, default=0.1)
    p_train.add_argument("--eval-interval", type=int, default=200)
    p_train.add_argument("--seed", type=int, default=1234)
    p_train.add_argument("--no-compile", dest="compile", action="store_false")
    p_asm = sub.add_parser("assemble")
    p_asm.add_argument("--shards", type=Path, required=True)
    p_asm.add_argument("--model-dir", type=Path, default=cfg.MODEL_DIR)
    p_init = sub.add_parser("init-random")
    p_init.add_argument("--model-dir", type=Path, default=cfg.MODEL_DIR)
    p_init.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "train":
        train(args)
    elif args.command == "assemble":
        assemble(args.shards, args.model_dir)
    else:
        init_random(args.model_dir, args.seed)


if __name__ == "__main__":
    main()
