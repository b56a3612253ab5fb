"""Train the byte-level BPE tokenizer of ferrum's tiny model and encode the corpus with it.

Usage: python tools/train_tokenizer.py --corpus .device_carry/corpus [--model-dir DIR]

Reads train.jsonl / heldout.jsonl from tools/build_corpus.py. Writes tokenizer.json and
tokenizer_config.json (ChatML chat template) into the model folder, and train.npy / heldout.npy
(uint16 token ids, each document followed by <|endoftext|>) into the corpus folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model_config as cfg  # noqa: E402


def iter_texts(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def train_tokenizer(train_jsonl: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(cfg.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_texts(train_jsonl), trainer=trainer)
    for token_id, token in enumerate(cfg.SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token} did not get id {token_id}")
    if tokenizer.get_vocab_size() != cfg.VOCAB_SIZE:
        raise RuntimeError(f"vocab size {tokenizer.get_vocab_size()} != {cfg.VOCAB_SIZE}")
    return tokenizer


def encode_split(tokenizer: Tokenizer, jsonl: Path) -> np.ndarray:
    """All documents of `jsonl` as one uint16 stream, each followed by <|endoftext|>."""
    texts = list(iter_texts(jsonl))
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(cfg.ENDOFTEXT_ID)
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=Path(".device_carry/corpus"))
    parser.add_argument("--model-dir", type=Path, default=cfg.MODEL_DIR)
    args = parser.parse_args()

    tokenizer = train_tokenizer(args.corpus / "train.jsonl")
    args.model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.model_dir / "tokenizer.json"))
    cfg.write_tokenizer_config(args.model_dir)
    for split in ("train", "heldout"):
        ids = encode_split(tokenizer, args.corpus / f"{split}.jsonl")
        np.save(args.corpus / f"{split}.npy", ids)
        chars = sum(len(t) for t in iter_texts(args.corpus / f"{split}.jsonl"))
        print(f"{split}: {len(ids):,} tokens, {chars / len(ids):.2f} chars/token")


if __name__ == "__main__":
    main()
