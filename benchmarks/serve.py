"""Load test of `jaxrl serve`: concurrent clients against the running JetStream server.

    python benchmarks/serve.py --model DIR [--clients 16] [--requests 128]
        [--prompt-len 32 128] [--output-len 16 128] [--slots 16] [--seed 0] [--json]
        [-- SERVE_OVERRIDES ...]
    python benchmarks/serve.py --address HOST:PORT --vocab V ...   (a server already running)
    python benchmarks/serve.py --make-model DIR [--layers 4 --hidden 256]   (a random policy)
    python benchmarks/serve.py --engine-steps DIR [--slots 4 16]   (the engine alone)

With `--model` it starts `jaxrl serve` on that HF directory itself (a free port, greedy,
`rollout.ignore_eos=true` so every request runs to its max_tokens, `serve.max_slots=--slots`,
prompts up to the largest prompt length), waits for its address, runs the load, then stops
it with SIGTERM. Needs the jetstream extra (its gRPC client stubs).

Each request sends a prompt of random token ids (client-side tokenization, so lengths are
exact) with a length drawn uniformly from `--prompt-len LO HI` and `max_tokens` uniformly from
`--output-len LO HI`; `--clients` threads each send their next request when the last one
finished (a closed loop), `--requests` in all, after `--warmup` requests that are not
counted. Prints:

    requests/s          finished requests per second of the measured wall time
    output tokens/s     tokens received per second
    TTFT p50 / p99      time to first token: request sent -> first token received
    TPOT p50 / p99      time per output token after the first: (last - first) / (n - 1)
    latency p50 / p99   request sent -> last token received

`--engine-steps` times the engine's compiled calls alone, without JetStream's threads or
gRPC: one generate step (every slot live, and one slot live) and one prefill of the largest
prompt, for each slot count: what the served TPOT and TTFT would be with no orchestration.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def make_model(path: str, layers: int, hidden: int) -> None:
    """A random qwen2 policy with a character tokenizer (what the tests serve, larger)."""
    from flax import nnx

    from jaxrl.data.tokenizer import make_char_tokenizer
    from jaxrl.models import Transformer, save_pretrained
    from jaxrl.models.config import tiny_config

    tokenizer = make_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 +=?")
    heads = max(hidden // 64, 2)
    config = tiny_config("qwen2", vocab_size=len(tokenizer), eos_token_id=2, num_layers=layers,
                         hidden_size=hidden, intermediate_size=4 * hidden, num_heads=heads,
                         num_kv_heads=max(heads // 2, 1), head_dim=hidden // heads,
                         max_position_embeddings=4096)
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), path)
    tokenizer.save_pretrained(path)
    print(f"wrote a {config.num_params():,}-parameter policy to {path}")


def engine_steps(model_dir: str, slot_counts: list[int], max_prompt: int,
                 max_output: int, steps: int = 100) -> None:
    """Prints the engine's generate step and prefill times (module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models import from_pretrained
    from jaxrl.rollout import serving, slots
    from jaxrl.rollout.sampling import SamplingParams

    model = from_pretrained(model_dir)
    graphdef, params = nnx.split(model)
    greedy, stops = SamplingParams(temperature=0.0), slots.Stops()
    xla = slots.PagedAttentionSettings()
    for num_slots in slot_counts:
        layout = serving.pool_layout(num_slots, max_prompt, max_output, 16)
        generate = jax.jit(lambda p, st, layout=layout: serving.emit_and_generate(
            nnx.merge(graphdef, p), st, layout, stops, greedy, xla), donate_argnums=1)
        prefill = jax.jit(lambda p, ids, n: serving.prefill_request(
            nnx.merge(graphdef, p), ids, n, jax.random.key(0), greedy, max_output))
        insert = jax.jit(lambda st, pf, s, layout=layout: serving.insert_request(
            st, pf, s, layout, stops), donate_argnums=0)
        ids = jnp.ones((max_prompt,), jnp.int32)
        for live in sorted({1, num_slots}):
            state = slots.init(model.config, layout, num_slots)
            for slot in range(live):
                state = insert(state, prefill(params, ids, max_prompt - 8), slot)
            state, out = generate(params, state)
            jax.block_until_ready(out)
            start = time.perf_counter()
            for _ in range(steps):
                state, out = generate(params, state)
            jax.block_until_ready(out)
            step_ms = 1e3 * (time.perf_counter() - start) / steps
            print(f"slots {num_slots:3d}, {live:3d} live: generate step {step_ms:.2f} ms "
                  f"({live / step_ms * 1e3:.0f} tokens/s)")
        start = time.perf_counter()
        for _ in range(20):
            prefix = prefill(params, ids, max_prompt - 8)
        jax.block_until_ready(prefix)
        print(f"prefill of {max_prompt} tokens: "
              f"{1e3 * (time.perf_counter() - start) / 20:.2f} ms")


def start_server(model: str, slots: int, max_prompt: int, max_output: int,
                 overrides: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "jaxrl.cli", "serve", f"model.path={model}",
            f"serve.port={port}", "serve.host=127.0.0.1", f"serve.max_slots={slots}",
            "serve.sampling.temperature=0", "rollout.ignore_eos=true",
            f"serve.max_prefill_length={max_prompt}", f"serve.max_new_tokens={max_output}",
            *overrides]
    process = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True)
    ready = threading.Event()

    def read():
        for line in process.stderr:
            if "serving on" in line or "error" in line:
                sys.stderr.write(line)
            if "serving on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(600):
        process.kill()
        raise SystemExit("jaxrl serve did not start within 600 s")
    return process, f"127.0.0.1:{port}"


def run_load(address: str, vocab: int, clients: int, requests: int, warmup: int,
             prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> dict:
    import grpc

    from jaxrl.serve.jetstream import jetstream_pb2, jetstream_pb2_grpc

    rng = np.random.default_rng(seed)
    total = warmup + requests
    lengths = rng.integers(prompt_len[0], prompt_len[1] + 1, total)
    outputs = rng.integers(output_len[0], output_len[1] + 1, total)
    prompts = [rng.integers(4, vocab, n).tolist() for n in lengths]  # past the special ids
    channel = grpc.insecure_channel(address)
    stub = jetstream_pb2_grpc.OrchestratorStub(channel)
    records: list[tuple[float, float, float, int] | None] = [None] * total
    lock = threading.Lock()

    def client(queue):
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            request = jetstream_pb2.DecodeRequest(
                token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompts[i]),
                max_tokens=int(outputs[i]))
            sent, first, n = time.perf_counter(), None, 0
            for response in stub.Decode(request, timeout=600):
                got = sum(len(s.token_ids) for s in response.stream_content.samples)
                if got and first is None:
                    first = time.perf_counter()
                n += got
            records[i] = (sent, first or time.perf_counter(), time.perf_counter(), n)

    def run(indices) -> float:
        queue = iter(indices)
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(lambda _: client(queue), range(clients)))
        return time.perf_counter() - start

    run(range(warmup))  # not counted: compiles, first queues
    wall = run(range(warmup, total))
    measured = [r for r in records[warmup:] if r is not None]
    asked = int(outputs[warmup:].sum())
    received = sum(r[3] for r in measured)
    ttft = np.array([r[1] - r[0] for r in measured])
    tpot = np.array([(r[2] - r[1]) / (r[3] - 1) for r in measured if r[3] > 1])
    latency = np.array([r[2] - r[0] for r in measured])

    def pct(x, q):
        return float(np.percentile(x, q)) if len(x) else float("nan")

    return {
        "clients": clients, "requests": len(measured), "wall_s": wall,
        "requests_per_s": len(measured) / wall, "output_tokens_per_s": received / wall,
        "output_tokens": received, "output_tokens_asked": asked,
        "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99),
        "latency_p50_s": pct(latency, 50), "latency_p99_s": pct(latency, 99),
        "prompt_len": list(prompt_len), "output_len": list(output_len),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF model directory to serve (starts jaxrl serve)")
    parser.add_argument("--address", help="HOST:PORT of a server already running")
    parser.add_argument("--vocab", type=int, help="vocabulary size (with --address)")
    parser.add_argument("--make-model", help="write a random policy to this directory, exit")
    parser.add_argument("--engine-steps", metavar="DIR",
                        help="time the engine's calls alone on this model directory, exit")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--slots", type=int, nargs="+", default=[16],
                        help="decode slots of the server started (--engine-steps: each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    if args.make_model:
        make_model(args.make_model, args.layers, args.hidden)
        return
    if args.engine_steps:
        engine_steps(args.engine_steps, args.slots, args.prompt_len[1], args.output_len[1])
        return
    if bool(args.model) == bool(args.address):
        parser.error("give --model DIR (start a server) or --address HOST:PORT (use one)")
    process = None
    if args.model:
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        process, address = start_server(args.model, args.slots[0], args.prompt_len[1],
                                        args.output_len[1], overrides)
    else:
        if args.vocab is None:
            parser.error("--address needs --vocab (the model's vocabulary size)")
        vocab, address = args.vocab, args.address
    try:
        result = run_load(address, vocab, args.clients, args.requests, args.warmup,
                          tuple(args.prompt_len), tuple(args.output_len), args.seed)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(120)
    result["slots"] = args.slots[0] if args.model else None
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['requests']} requests, {args.clients} clients, slots {result['slots']}, "
          f"prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, on {os.cpu_count()} CPUs")
    print(f"  requests/s        {result['requests_per_s']:.2f}")
    print(f"  output tokens/s   {result['output_tokens_per_s']:.1f} "
          f"({result['output_tokens']} of {result['output_tokens_asked']} asked)")
    print(f"  TTFT p50 / p99    {result['ttft_p50_ms']:.1f} / {result['ttft_p99_ms']:.1f} ms")
    print(f"  TPOT p50 / p99    {result['tpot_p50_ms']:.2f} / {result['tpot_p99_ms']:.2f} ms")
    print(f"  latency p50 / p99 {result['latency_p50_s']:.2f} / {result['latency_p99_s']:.2f} s")


if __name__ == "__main__":
    main()
