"""What a prefix-cache lookup costs the dispatcher, beside today's count-only parse.

A lookup needs the prompt's token ids, not only their count: the dispatcher must encode the
prompt (``parse_request(..., token_ids=True)``: the exact count first, then the ids by the same
counter's steps, ``PromptTokenizer.prompt_ids``; tokenizers' own Encoding is timed beside), hash
its full blocks as vLLM does (``block_keys``: sha256 over pickle, one per 16 tokens), and walk
the nodes' index (``PrefixIndex.longest_prefix_tokens``); ``prompt_prefix_hits`` does the last
two lazily, hashing no further than the first block no node holds. Each part is timed in process on the
same bodies as ``bench/micro/gateway_overhead.py`` (about 2 KB and 100 KB of English-like text, the
tiny model's tokenizer), and on token-id prompts of 1K/10K/32K tokens (no tokenizer: the hash
and the walk alone, the sizes of ``bench/micro/decision_latency.py``), at 2, 16 and 128 nodes.

The index is the worst case for the walk: one node holds the whole prompt (the walk, and the
hashing, run to its end), the others a prefix of it growing with their number, and each node
also holds ``--filler`` unrelated blocks; one row times the best case, no node holding the
prompt's first block. Last, what ingesting one event batch costs the dispatcher (decode, sequence
check, apply), for batches of 1, 16 and 223 blocks.

    python -m bench.micro.prefix_lookup [--reps 300] [--filler 4096] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.harness.bodies import completion_body
from bench.harness.results import percentiles_us, write_result
from kairos.api.openai_request import RequestLimits, parse_request
from kairos.api.tokenizer import PromptTokenizer
from kairos.common.block_hash import block_keys
from kairos.common.kv_events import BlockStored, KvEventBatch, decode_batch, decode_message, encode_message
from kairos.core.kv_event_sync import EventStreamSync
from kairos.core.prefix_index import PrefixIndex, prompt_prefix_hits
from kairos.launcher.tinymodel import build_tiny_model

BLOCK = 16  # vLLM's default block size on GPU
NODES = (2, 16, 128)
BODIES = {"2KB": 2048, "100KB": 102_400}
ID_PROMPTS = (1024, 10240, 32768)
PATH = "/v1/completions"


def timed(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return percentiles_us(samples)


def index_for(keys: list[int], nodes: int, filler: int, rng: random.Random) -> PrefixIndex:
    ix = PrefixIndex(capacity_blocks=len(keys) + filler)
    for n in range(nodes):
        ix.add_node(f"n{n}", 0.0)
        held = keys if n == 0 else keys[: len(keys) * n // nodes]
        junk = tuple(rng.getrandbits(64) for _ in range(filler))
        ix.apply(f"n{n}", [BlockStored(tuple(held), None, (), BLOCK, None, "GPU", None)], 0.0)
        ix.apply(f"n{n}", [BlockStored(junk, None, (), BLOCK, None, "GPU", None)], 0.0)
    return ix


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--filler", type=int, default=4096, help="unrelated blocks per node")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        tok = PromptTokenizer.from_dir(build_tiny_model(Path(tmp) / "tiny"))
    limits = RequestLimits()
    rows: list[dict[str, Any]] = []
    head = f"{'prompt':>14} {'tokens':>6} {'nodes':>5}  {'part':<34} {'p50 µs':>9} {'p99 µs':>9}"
    print(head)

    def row(prompt: str, tokens: int, nodes: int | None, part: str, stats: dict[str, float]) -> None:
        rows.append({"prompt": prompt, "tokens": tokens, "nodes": nodes, "part": part, **stats})
        print(f"{prompt:>14} {tokens:>6} {nodes or '':>5}  {part:<34} {stats['p50_us']:>9.1f} {stats['p99_us']:>9.1f}")

    for label, size in BODIES.items():
        body = completion_body(size, seed=1)
        reps = args.reps if size < 16_384 else max(40, args.reps // 6)
        ids = parse_request(PATH, body, tok, limits, token_ids=True).prompt_token_ids or []
        keys = block_keys(ids, BLOCK)
        prompt = f"{label} text"
        count_only = timed(lambda b=body: parse_request(PATH, b, tok, limits, stop_over_context=True), reps)
        row(prompt, len(ids), None, "parse + count (today)", count_only)
        with_ids = lambda b=body: parse_request(PATH, b, tok, limits, stop_over_context=True, token_ids=True)  # noqa: E731
        row(prompt, len(ids), None, "parse + token ids (count: their len)", timed(with_ids, reps))
        text = json.loads(body)["prompt"]
        encode = lambda p=text: tok.encode(p)  # noqa: E731
        row(prompt, len(ids), None, "(an Encoding instead, for scale)", timed(encode, reps))
        row(prompt, len(ids), None, "hash blocks", timed(lambda i=ids: block_keys(i, BLOCK), reps))
        for nodes in NODES:
            ix = index_for(keys, nodes, args.filler, rng)
            row(
                prompt,
                len(ids),
                nodes,
                "index walk",
                timed(lambda k=keys, x=ix: x.longest_prefix_tokens({BLOCK: k}, 0.0), reps),
            )

            def whole(b: bytes = body, x: PrefixIndex = ix) -> None:
                got = parse_request(PATH, b, tok, limits, stop_over_context=True, token_ids=True)
                prompt_prefix_hits(x, got.prompt_token_ids or [], 0.0)

            total = timed(whole, reps)
            row(prompt, len(ids), nodes, "parse + ids + hits (whole prompt held)", total)
            row(
                prompt,
                len(ids),
                nodes,
                "added over today (p50, p99 of each)",
                {"p50_us": total["p50_us"] - count_only["p50_us"], "p99_us": total["p99_us"] - count_only["p99_us"]},
            )
        cold = index_for(block_keys(list(range(4096, 4096 + 64)), BLOCK), 2, args.filler, rng)  # holds none of it
        row(
            prompt,
            len(ids),
            2,
            "hits, no node holds its first block",
            timed(lambda x=cold, i=ids: prompt_prefix_hits(x, i, 0.0), reps),
        )
    for tokens in ID_PROMPTS:
        ids = [rng.randrange(4096) for _ in range(tokens)]
        keys = block_keys(ids, BLOCK)
        reps = args.reps if tokens <= 10240 else max(40, args.reps // 3)
        row("token ids", tokens, None, "hash blocks", timed(lambda i=ids: block_keys(i, BLOCK), reps))
        for nodes in NODES:
            ix = index_for(keys, nodes, args.filler, rng)
            row(
                "token ids",
                tokens,
                nodes,
                "index walk",
                timed(lambda k=keys, x=ix: x.longest_prefix_tokens({BLOCK: k}, 0.0), reps),
            )
    # What the dispatcher pays per event batch it ingests (decode + sequence + apply), by size:
    # one block (a decode's new block), 16 (a short prompt), 223 (a 3,569-token prompt).
    for blocks in (1, 16, 223):
        ix = PrefixIndex()
        ix.add_node("n", 0.0)
        sync = EventStreamSync(ix, "n")
        keys = tuple(rng.getrandbits(64) for _ in range(blocks))
        tokens = tuple(rng.randrange(100_000) for _ in range(blocks * BLOCK))
        event = BlockStored(keys, None, tokens, BLOCK, None, "GPU", None, group_idx=0)
        frames = encode_message("kv-events", 0, KvEventBatch(1.0, (event,), 0))

        counter = itertools.count()

        def ingest(
            f: tuple[bytes, bytes, bytes] = frames, s: EventStreamSync = sync, seqs: Iterator[int] = counter
        ) -> None:
            _, _, payload = decode_message(f)
            s.on_live(next(seqs), decode_batch(payload), 0.0)

        row("event batch", blocks * BLOCK, None, f"ingest {len(frames[2])} B", timed(ingest, args.reps))
    write_result("prefix_lookup", {"block_size": BLOCK, "filler_blocks": args.filler, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
