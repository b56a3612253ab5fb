"""Multi-LoRA speed (issue 41): the same workloads on the base model and with `--num-adapters`
random rank-`--rank` adapters on every linear layer of the decoder (q/k/v/o, gate/up/down),
spread over the requests (request i runs adapter i mod N), with ferrum or vLLM.

    python benchmarks/bench_lora.py --model benchmarks/models/qwen3-8b --out lora.json
    python benchmarks/bench_lora.py --model benchmarks/models/qwen3-8b --engine vllm --out v.json

Dummy weights of the config's shapes, token-id prompts, `ignore_eos`. The adapters are written
in PEFT's folder layout (adapter_config.json + adapter_model.safetensors, PEFT's tensor names)
from config.json alone: PEFT itself would need the base model's weights in memory. Workloads:
`c64` (64 prompts of 256 tokens, 256 out), `nano` (the nano-vllm recipe), `lat` (one request:
TPOT = (t(1 + 256 tokens) - t(1 token)) / 256, medians of 3), `prefill` (32 prompts of 2,048
tokens, 1 out: prompt tokens a second, the long-chunk shapes). Each mode gets its own engine:
`base` (LoRA off), `lora` (LoRA on, requests spread over the adapters), `lora-idle` (LoRA on,
every request on the base model: what LoRA costs traffic without adapters). Prints one line per
(mode, workload) and the ratios the issue's bar reads: lora / base throughput and TPOT.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

from ferrum.bench import workloads  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model: str, out: Path, num: int, rank: int, seed: int = 0) -> list[str]:
    """`num` random adapters of the model's shapes (std 0.02 / sqrt(rank): small deltas)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model) / "config.json").read_text())
    config = config.get("text_config", config)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}  # fmt: skip
    folders = []
    for index in range(num):
        generator = torch.Generator().manual_seed(seed + index)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for name, (n_in, n_out) in shapes.items():
                block = "self_attn" if name[0] in "qkvo" else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                std = 0.02 / rank**0.5
                for part, shape in (("A", (rank, n_in)), ("B", (n_out, rank))):
                    values = torch.randn(shape, generator=generator) * std
                    tensors[f"{key}.lora_{part}.weight"] = values.to(torch.bfloat16)
        folder = out / f"adapter{index}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        adapter_config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": model,
            "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
            "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
            "fan_in_fan_out": False, "modules_to_save": None,
        }  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        folders.append(str(folder))
    return folders


def make_engine(args: argparse.Namespace, lora: bool) -> Any:
    kwargs: dict[str, Any] = dict(
        load_format="dummy",
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        seed=0,
    )
    if lora:
        kwargs |= dict(
            enable_lora=True,
            max_loras=args.num_adapters,
            max_lora_rank=args.rank,
            max_cpu_loras=args.num_adapters,
        )
    kwargs |= json.loads(args.engine_args)
    if args.engine == "vllm":
        from vllm import LLM

        return LLM(args.model, **kwargs)
    from ferrum import LLM

    return LLM(args.model, **(kwargs | {"device": args.device} if args.device else kwargs))


def lora_requests(args: argparse.Namespace, folders: list[str], n: int) -> list[Any] | None:
    if not folders:
        return None
    if args.engine == "vllm":
        from vllm.lora.request import LoRARequest
    else:
        from ferrum import LoRARequest
    adapters = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(folders)]
    return [adapters[i % len(adapters)] for i in range(n)]


def timed(llm: Any, args: argparse.Namespace, prompts, output_lens, temperature, loras) -> float:
    """Seconds of one generate call (the engine synchronizes before returning its outputs)."""
    if args.engine == "vllm":
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    else:
        from ferrum import SamplingParams

        inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in output_lens
    ]
    start = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start


def run_workload(name: str, llm: Any, args: argparse.Namespace, folders: list[str]) -> dict:
    vocab = args.vocab_size
    scale = args.scale

    def scaled(n: int) -> int:
        return max(1, round(n * scale))

    if name == "lat":
        prompt = workloads.fold_to_vocab([workloads.lat_prompt(seed=1, n_in=scaled(128))], vocab)
        decode = scaled(256)
        loras = lora_requests(args, folders[:1], 1)
        timed(llm, args, prompt, [decode], 0.0, loras)  # warm-up
        firsts = [timed(llm, args, prompt, [1], 0.0, loras) for _ in range(3)]
        fulls = [timed(llm, args, prompt, [1 + decode], 0.0, loras) for _ in range(3)]
        tpot = (statistics.median(fulls) - statistics.median(firsts)) / decode
        return {"tpot_ms": tpot * 1e3, "decode_tokens": decode}
    if name == "c64":
        prompts, lens = workloads.batch(scaled(64), scaled(256), scaled(256), seed=0)
        temperature = 1.0
    elif name == "prefill":
        prompts, lens = workloads.batch(scaled(32), scaled(2048), 1, seed=0)
        temperature = 1.0
    else:
        prompts, lens = workloads.nano(
            seed=0, num_seqs=scaled(256), max_in=max(100, scaled(1024)),
            max_out=max(100, scaled(1024)),
        )  # fmt: skip
        temperature = 0.6
    prompts = workloads.fold_to_vocab(prompts, vocab)
    loras = lora_requests(args, folders, len(prompts))
    k = min(8, len(prompts))  # warm-up: compiles the prefill and decode paths untimed
    timed(llm, args, prompts[:k], [8] * k, temperature, None if loras is None else loras[:k])
    seconds = timed(llm, args, prompts, lens, temperature, loras)
    if name == "prefill":
        return {"prompt_tokens_per_second": sum(map(len, prompts)) / seconds, "seconds": seconds}
    return {"output_tokens_per_second": sum(lens) / seconds, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a folder with config.json")
    parser.add_argument("--engine", choices=("ferrum", "vllm"), default="ferrum")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--workloads", default="c64,nano,lat")
    parser.add_argument(
        "--modes", default="base,lora", help="base (LoRA off), lora, lora-idle (comma-separated)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None, help="ferrum only (default: cuda if present)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every count")
    parser.add_argument(
        "--engine-args",
        default="{}",
        help="JSON of further LLM(...) arguments (e.g. vLLM's compilation_config)",
    )
    parser.add_argument("--out", default=None, help="write the figures as JSON")
    parser.add_argument(
        "--stack-dump-after",
        type=float,
        default=0.0,
        help="seconds: then print every thread's stack and exit (where a start-up hangs; run "
        "vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0 so its engine core is in this process)",
    )
    args = parser.parse_args()
    if args.stack_dump_after > 0:
        faulthandler.dump_traceback_later(args.stack_dump_after, exit=True)
    config = json.loads((Path(args.model) / "config.json").read_text())
    args.vocab_size = config.get("text_config", config)["vocab_size"]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_adapters(args.model, Path(tmp), args.num_adapters, args.rank)
        for mode in args.modes.split(","):
            llm = make_engine(args, lora=mode.startswith("lora"))
            for name in args.workloads.split(","):
                figures = run_workload(name, llm, args, folders if mode == "lora" else [])
                results[f"{mode}/{name}"] = figures
                print(f"{args.engine} {mode:5s} {name:5s} {json.dumps(figures)}", flush=True)
            if hasattr(llm, "shutdown"):
                llm.shutdown()
            del llm
    for name in args.workloads.split(","):
        base, lora = results.get(f"base/{name}"), results.get(f"lora/{name}")
        if base and lora:
            key = next(k for k in lora if k != "seconds" and k != "decode_tokens")
            print(f"{name}: lora / base {key} = {lora[key] / base[key]:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
