"""Per-step cost of sending a SchedulerOutput to tensor-parallel workers (the bar: < 5% of a
decode step at batch 256).

What the multiprocess executor does each step, timed on the host alone (no model, no GPU):
the core pickles the step once and writes the bytes to every worker's pipe (`send`); each worker
reads and unpickles it (`recv`). `round_trip` adds a tiny reply from every worker and subtracts an
empty ping's round trip, giving the latency from "the core starts sending" to "the last worker
holds the step". Steps are realistic: decode (every request a diff, one in 16 taking a new
block) and mixed (a decode batch plus new requests with long prompts), with request ids like the
server's (`cmpl-<32 hex>-0`), and constrained (a decode whose first N requests have a grammar: the
core publishes their bitmask rows, Qwen3's vocabulary, in the shared-memory slots of
`bitmask_channel.py` and the step names the slot; each worker copies the rows out).

`--transport ray-graph` times the Ray executor's path instead: one actor per rank, each message
through a compiled Ray graph (constrained rows inline in the message, as the Ray executor sends
them); `ray-actor` one plain actor call per rank and message, the alternative it was chosen over.
The Ray executor sends each step's LaunchStep with the CompleteStep that follows it, in one
execution answered by rank 0, so a step costs about `round_trip_ms` there. Needs
`pip install 'ferrum[ray]'`; starts a local Ray instance.

    python benchmarks/bench_executor_broadcast.py --batch 256 --workers 2 --steps 2000
    python benchmarks/bench_executor_broadcast.py --transport ray-graph ray-actor --workers 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import random
import statistics
import time
import uuid
from multiprocessing.connection import Connection

from ferrum.executor.bitmask_channel import BitmaskLayout, BitmaskReader, BitmaskWriter
from ferrum.executor.messages import (
    CompleteStep,
    GrammarBitmaskRows,
    InlineBitmaskRows,
    LaunchStep,
)
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput

# Qwen3's vocabulary (151,936 tokens: 4,748 int32 words a row), rows for a batch of 256.
LAYOUT = BitmaskLayout(max_rows=256, vocab_size=151_936)


def decode_step(req_ids: list[str], step: int, rng: random.Random) -> SchedulerOutput:
    cached = [
        CachedRequestData(r, [rng.randrange(100_000)] if (i + step) % 16 == 0 else [], 300 + step)
        for i, r in enumerate(req_ids)
    ]
    return SchedulerOutput([], cached, dict.fromkeys(req_ids, 1), len(req_ids), step_id=step)


def mixed_step(
    req_ids: list[str], step: int, rng: random.Random, num_new: int, prompt_len: int
) -> SchedulerOutput:
    out = decode_step(req_ids, step, rng)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256)
    for _ in range(num_new):
        req_id = f"cmpl-{uuid.uuid4().hex}-0"
        prompt = [rng.randrange(150_000) for _ in range(prompt_len)]
        blocks = [rng.randrange(100_000) for _ in range(-(-prompt_len // 16))]
        out.scheduled_new_reqs.append(NewRequestData(req_id, prompt, [], params, blocks, 0))
        out.num_scheduled_tokens[req_id] = prompt_len
        out.total_num_scheduled_tokens += prompt_len
    return out


def _worker(conn: Connection, reply: Connection, rank: int, bitmask_path: str) -> None:
    import torch

    torch.set_num_threads(1)  # two cores here: intra-op threads of two workers fight
    reader = BitmaskReader(os.open(bitmask_path, os.O_RDWR), LAYOUT)
    while True:
        data = conn.recv_bytes()
        if data == b"stop":
            return
        message = pickle.loads(data)
        if message is not None and message.grammar_bitmask is not None:
            reader.read(message.grammar_bitmask.slot)
        reply.send_bytes(b"k")


def run(batch: int, num_workers: int, num_steps: int, kind: str) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    writer = BitmaskWriter(LAYOUT)
    sends, replies, procs = [], [], []
    for rank in range(num_workers):
        recv_end, send_end = ctx.Pipe(duplex=False)
        reply_recv, reply_send = ctx.Pipe(duplex=False)
        bitmask_path = f"/proc/{os.getpid()}/fd/{writer.fd}"
        p = ctx.Process(
            target=_worker, args=(recv_end, reply_send, rank, bitmask_path), daemon=True
        )
        p.start()
        sends.append(send_end)
        replies.append(reply_recv)
        procs.append(p)
    rng = random.Random(0)
    req_ids = [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(batch)]
    num_rows = 0
    if kind == "mixed":
        steps = [mixed_step(req_ids, s, rng, 2, 1024) for s in range(64)]
    else:
        steps = [decode_step(req_ids, s, rng) for s in range(64)]
    if kind.startswith("constrained"):
        num_rows = int(kind.partition("-")[2])
    messages = [LaunchStep(s) for s in steps]
    ping = pickle.dumps(None)
    send_s, rtt_s, ping_s, sizes = [], [], [], []
    for i in range(num_steps):
        message = messages[i % len(messages)]
        t0 = time.perf_counter()
        if num_rows:
            # The rows are filled in place by the matchers (not timed here: the same either way).
            slot, _ = writer.begin(num_rows)
            writer.publish(slot)
            message.grammar_bitmask = GrammarBitmaskRows(req_ids[:num_rows], slot)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in sends:
            conn.send_bytes(data)
        t1 = time.perf_counter()
        for conn in replies:
            conn.recv_bytes()
        t2 = time.perf_counter()
        for conn in sends:
            conn.send_bytes(ping)
        for conn in replies:
            conn.recv_bytes()
        t3 = time.perf_counter()
        send_s.append(t1 - t0)
        rtt_s.append(t2 - t0)
        ping_s.append(t3 - t2)
        sizes.append(len(data))
    for conn in sends:
        conn.send_bytes(b"stop")
    for p in procs:
        p.join(10)
    writer.close()

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs) * 1e3, 4)

    return {
        "kind": kind,
        "batch": batch,
        "workers": num_workers,
        "bytes": int(statistics.median(sizes)),
        "send_ms": ms(send_s),
        "round_trip_ms": ms(rtt_s),
        "ping_ms": ms(ping_s),
        "delivery_ms": round(ms(rtt_s) - ms(ping_s), 4),
        "pickle_ms": _pickle_ms(messages),
        "unpickle_ms": _unpickle_ms(messages),
    }


class _RayRank:
    """A rank that only receives: the Ray executor's actor without a model."""

    def execute(self, messages: list[LaunchStep | CompleteStep] | None) -> bytes:
        return b"k"


def run_ray(batch: int, num_workers: int, num_steps: int, kind: str, transport: str) -> dict:
    import ray
    import torch
    from ray.dag import InputNode, MultiOutputNode

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    ranks = [ray.remote(num_cpus=0)(_RayRank).remote() for _ in range(num_workers)]
    graph = None
    if transport == "ray-graph":
        with InputNode() as message_node:
            outputs = [rank.execute.bind(message_node) for rank in ranks]
        graph = MultiOutputNode(outputs).experimental_compile(_submit_timeout=-1)

    def submit(message: list[LaunchStep | CompleteStep] | None) -> list:
        if graph is not None:
            return graph.execute(message)
        return [rank.execute.remote(message) for rank in ranks]

    def read(refs: list) -> None:
        if graph is not None:
            for ref in refs:
                ref.get(timeout=-1)
        else:
            ray.get(refs)

    rng = random.Random(0)
    req_ids = [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(batch)]
    if kind == "mixed":
        steps = [mixed_step(req_ids, s, rng, 2, 1024) for s in range(64)]
    else:
        steps = [decode_step(req_ids, s, rng) for s in range(64)]
    messages = [LaunchStep(s) for s in steps]
    if kind.startswith("constrained"):
        num_rows = int(kind.partition("-")[2])
        rows = torch.zeros(num_rows, LAYOUT.width, dtype=torch.int32)
        for m in messages:
            m.grammar_bitmask = InlineBitmaskRows(req_ids[:num_rows], rows)
    read(submit(None))  # warm
    send_s, rtt_s, ping_s = [], [], []
    for i in range(num_steps):
        t0 = time.perf_counter()
        refs = submit([messages[i % len(messages)], CompleteStep()])
        t1 = time.perf_counter()
        read(refs)
        t2 = time.perf_counter()
        read(submit(None))
        t3 = time.perf_counter()
        send_s.append(t1 - t0)
        rtt_s.append(t2 - t0)
        ping_s.append(t3 - t2)
    if graph is not None:
        graph.teardown()
    for rank in ranks:
        ray.kill(rank)

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs) * 1e3, 4)

    return {
        "transport": transport,
        "kind": kind,
        "batch": batch,
        "workers": num_workers,
        "send_ms": ms(send_s),
        "round_trip_ms": ms(rtt_s),
        "ping_ms": ms(ping_s),
        "delivery_ms": round(ms(rtt_s) - ms(ping_s), 4),
    }


def _pickle_ms(messages: list[LaunchStep]) -> float:
    start = time.perf_counter()
    for m in messages * 10:
        pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)
    return round((time.perf_counter() - start) / (len(messages) * 10) * 1e3, 4)


def _unpickle_ms(messages: list[LaunchStep]) -> float:
    blobs = [pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in messages] * 10
    start = time.perf_counter()
    for b in blobs:
        pickle.loads(b)
    return round((time.perf_counter() - start) / len(blobs) * 1e3, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--transport", nargs="+", default=["mp"], choices=["mp", "ray-graph", "ray-actor"]
    )
    args = parser.parse_args()
    for transport in args.transport:
        for kind in ("decode", "mixed", "constrained-16", "constrained-256"):
            for n in args.workers:
                if transport == "mp":
                    result = run(args.batch, n, args.steps, kind)
                else:
                    result = run_ray(args.batch, n, args.steps, kind, transport)
                print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
