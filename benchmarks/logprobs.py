"""Completion log-probs, forward + backward: whole logits vs vocabulary chunks, beside
tokamax's fused linear + softmax cross-entropy (a summed loss only) where it is installed.

    python benchmarks/logprobs.py                     # vs-TRL: 64 rows x 64 tokens, E 256, V 4096
    python benchmarks/logprobs.py --rows 32 --completion 4 --hidden 64 --vocab 16 --chunk 8
                                                      # the quickstart's microbatch
    python benchmarks/logprobs.py --rows 64 --completion 512 --hidden 1536 --vocab 151936 \\
        --dtype bfloat16 --chunk 8192 16384 --json    # Qwen2.5-1.5B's head, on a GPU/TPU

Workload: hidden states h [R, C, E] (R = --rows, C = --completion, E = --hidden) ~ N(0, 1),
the output projection w [E, V] ~ N(0, 1/E), targets uniform over V, all from seed 0. Each
implementation is timed as `jax.jit(jax.value_and_grad(f, argnums=(0, 1)))` (gradients for
h and w, as the policy loss takes them), with fixed random per-token cotangents g, u:

    whole        f = sum g * logp + u * H   logits [R, C, V] in float32, `token_log_probs` and
                                            `token_entropy` (completion_log_probs, no chunking)
    chunked-K    f = the same, `chunked_log_probs_and_entropy` with K vocabulary columns per
                 chunk (completion_log_probs with algo.logprob_chunk_size = K)
    tokamax-I    f = sum_t -logp_t          `tokamax.linear_softmax_cross_entropy_loss`,
                 implementation I (mosaic_tpu on TPU v5+, else xla). Its only output is that
                 summed (or mean) loss: no per-token log-probs, no entropy, no per-token
                 cotangent, so it cannot serve the policy loss; it is here as the cost of a
                 fused head where one exists, not as a candidate. Listed when tokamax is
                 installed (`pip install tokamax==0.0.12`; no jaxrl extra pulls it in).

Timed: --repeats rounds after one warm-up call each; every round calls each implementation
once, in turn (interleaved, so a slower stretch of a shared machine hits all alike); the
median and min of the rounds. temp_mib: XLA's temporaries of the compiled program
(`compiled.memory_analysis()`), where the backend reports them. max_err: the largest
|logp - logp_whole| (tokamax: |loss - sum(-logp_whole)| / R·C), a check that all compute
the same numbers. --json: the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rl import chunked_log_probs_and_entropy, token_entropy, token_log_probs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--completion", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--chunk", type=int, nargs="+", default=[1024, 2048],
                   help="vocabulary columns per chunk; one chunked run per value")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--no-tokamax", action="store_true", help="leave tokamax out")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return p.parse_args()


def whole(h_BxTxE, w_ExV, targets_BxT):
    logits_BxTxV = jnp.einsum("bte,ev->btv", h_BxTxE, w_ExV, preferred_element_type=jnp.float32)
    return token_log_probs(logits_BxTxV, targets_BxT), token_entropy(logits_BxTxV)


def policy_like(logprobs_fn, g_BxT, u_BxT):
    """f(h, w, targets) = sum g * logp + u * H: per-token weights, as the policy loss has."""
    def f(h_BxTxE, w_ExV, targets_BxT):
        logp_BxT, entropy_BxT = logprobs_fn(h_BxTxE, w_ExV, targets_BxT)
        return jnp.sum(g_BxT * logp_BxT + u_BxT * entropy_BxT), logp_BxT
    return f


def tokamax_impls() -> dict:
    """{name: f(h, w, targets) -> (summed -logp, None)} for the tokamax kernel usable here."""
    try:
        import tokamax
        from absl import flags
    except ImportError:
        return {}
    # tokamax reads its options as absl flags and, unless flags were parsed, parses sys.argv
    # on first use: this script's own arguments would be rejected as unknown flags.
    flags.FLAGS.mark_as_parsed()
    device = jax.devices()[0]
    impl = "xla"
    if device.platform == "tpu":
        from tokamax._src.ops.linear_softmax_cross_entropy_loss import api
        kernel = api.IMPLEMENTATIONS.get("mosaic_tpu")
        if kernel is not None and kernel.supported_on(device):
            impl = "mosaic_tpu"

    def f(h_BxTxE, w_ExV, targets_BxT):
        loss = tokamax.linear_softmax_cross_entropy_loss(
            h_BxTxE.reshape(-1, h_BxTxE.shape[-1]), targets_BxT.reshape(-1), w_ExV,
            reduction="sum", implementation=impl)
        return loss, None
    return {f"tokamax-{impl}": f}


def main() -> None:
    args = parse_args()
    dtype = jnp.dtype(args.dtype)
    kh, kw, kt, kg, ku = jax.random.split(jax.random.key(0), 5)
    shape = (args.rows, args.completion)
    h_BxTxE = jax.random.normal(kh, (*shape, args.hidden), dtype)
    w_ExV = (jax.random.normal(kw, (args.hidden, args.vocab)) / args.hidden ** 0.5).astype(dtype)
    targets_BxT = jax.random.randint(kt, shape, 0, args.vocab)
    g_BxT, u_BxT = jax.random.normal(kg, shape), jax.random.normal(ku, shape)

    fns = {"whole": policy_like(whole, g_BxT, u_BxT)}
    for k in args.chunk:
        fns[f"chunked-{k}"] = policy_like(
            lambda h, w, t, k=k: chunked_log_probs_and_entropy(h, w, t, chunk_size=k),
            g_BxT, u_BxT)
    if not args.no_tokamax:
        fns.update(tokamax_impls())

    inputs = (h_BxTxE, w_ExV, targets_BxT)
    compiled, temp_mib, max_err = {}, {}, {}
    ref_logp_BxT = None
    for name, f in fns.items():
        step = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
        compiled[name] = step.lower(*inputs).compile()
        try:
            temp_mib[name] = compiled[name].memory_analysis().temp_size_in_bytes / 2 ** 20
        except Exception:  # backends without buffer-assignment stats raise various errors
            temp_mib[name] = None
        (value, logp_BxT), _ = jax.block_until_ready(compiled[name](*inputs))  # warm-up
        if name == "whole":
            ref_logp_BxT = logp_BxT
        if logp_BxT is not None:
            max_err[name] = float(jnp.max(jnp.abs(logp_BxT - ref_logp_BxT)))
        else:  # tokamax: only sum_t -logp_t
            max_err[name] = float(jnp.abs(value + jnp.sum(ref_logp_BxT)) / ref_logp_BxT.size)

    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name in fns:
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*inputs))
            times[name].append(time.perf_counter() - start)

    device = jax.devices()[0]
    print(f"{device.platform} ({device.device_kind}), {jax.__version__}; rows {args.rows} x "
          f"completion {args.completion}, hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.dtype}; forward + backward, {args.repeats} interleaved rounds")
    base = float(np.median(times["whole"]))
    results = {}
    for name in fns:
        med, best = float(np.median(times[name])), float(np.min(times[name]))
        results[name] = dict(median_ms=med * 1e3, min_ms=best * 1e3, vs_whole=med / base,
                             temp_mib=temp_mib[name], max_err=max_err[name])
        temp = "-" if temp_mib[name] is None else f"{temp_mib[name]:.2f}"
        print(f"  {name:<20} median {med * 1e3:9.3f} ms  min {best * 1e3:9.3f} ms  "
              f"x{med / base:5.2f} of whole  temp {temp:>8} MiB  max_err {max_err[name]:.1e}")
    if args.json:
        print(json.dumps(dict(platform=device.platform, device_kind=device.device_kind,
                              jax=jax.__version__, **vars(args), results=results)))


if __name__ == "__main__":
    main()
