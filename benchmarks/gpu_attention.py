"""cuDNN attention vs XLA attention in the model's training forward + backward, on a GPU.

    python benchmarks/gpu_attention.py OUT_DIR            # GPU: bf16, cudnn vs xla
    python benchmarks/gpu_attention.py OUT_DIR --tiny     # CPU: small, float32; the cudnn arm
                                                          # runs the same rotation through jax's
                                                          # XLA attention (what the tests prove)

A random Qwen2-shaped policy (head_dim 128, GQA) scores left-padded rows with a masked tail
(prompt pads, real tokens, then invalid tokens after EOS), once with attention_impl "xla" and
once "cudnn": the same parameters, the loss = mean log p(target) over real tokens, jitted
value_and_grad. Asserted: logits on real tokens, the loss and every gradient agree (bf16:
relative to the reference's scale) and, on GPU, the compiled cudnn program holds cuDNN's
fused attention custom call. Timed: the median of `--steps` calls after one warm-up, each
arm alone. Writes OUT_DIR/attention.json and prints one summary line; exit 1 on a mismatch.
Installs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models import Transformer, attention
from jaxrl.models import attention_kernels as kernels
from jaxrl.models.config import ModelConfig

# (logits, loss, gradient) tolerance, relative to the reference's largest entry / norm.
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-5}


def _config(tiny: bool) -> ModelConfig:
    dtype = "float32" if tiny else "bfloat16"
    sizes = (dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, vocab_size=256) if tiny else
             dict(hidden_size=1024, intermediate_size=2816, num_layers=4, num_heads=8,
                  num_kv_heads=2, head_dim=128, vocab_size=8192))
    return ModelConfig(model_type="qwen2", qkv_bias=True, tie_word_embeddings=True,
                       param_dtype=dtype, compute_dtype=dtype, attention_impl="xla", **sizes)


def _batch(config: ModelConfig, rows: int, seq: int):
    rng = np.random.default_rng(0)
    prompt = seq // 4
    pads = rng.integers(0, prompt, rows)
    pads[0] = 0
    ends = rng.integers(prompt + 1, seq + 1, rows)
    ends[0] = seq
    t = np.arange(seq)[None]
    valid = (t >= pads[:, None]) & (t < ends[:, None])
    ids = rng.integers(0, config.vocab_size, (rows, seq + 1)).astype(np.int32)
    return jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:]), jnp.asarray(valid)


def _step(config: ModelConfig):
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))

    def loss(state, ids, targets, valid):
        logits = nnx.merge(graphdef, state)(ids, attention_mask=valid)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return -jnp.sum(jnp.where(valid, logp, 0)) / jnp.sum(valid), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True)), state


def _time(step, args, steps: int) -> list[float]:
    jax.block_until_ready(step(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return times


def _relative(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows, seq = args.rows or (4 if args.tiny else 8), args.seq or (32 if args.tiny else 2048)
    backend = jax.default_backend()
    if not args.tiny and backend != "gpu":
        print(f"gpu_attention: no GPU (backend {backend!r}); use --tiny on CPU", file=sys.stderr)
        return 3
    if args.tiny:  # the cudnn arm's rotation through XLA's attention, on any platform
        attention.cudnn_attention = functools.partial(kernels.cudnn_attention,
                                                      implementation="xla")

    xla_config = _config(args.tiny)
    arms = {"xla": xla_config,
            "cudnn": dataclasses.replace(xla_config, attention_impl="cudnn")}
    ids, targets, valid = _batch(xla_config, rows, seq)
    results, timings, fused_call = {}, {}, None
    for name, config in arms.items():
        step, state = _step(config)
        inputs = (state, ids, targets, valid)
        if name == "cudnn" and not args.tiny:
            fused_call = "__cudnn$fmha" in step.lower(*inputs).compile().as_text()
        results[name] = jax.device_get(step(*inputs))
        timings[name] = _time(step, inputs, args.steps)
        del step, state

    tol = TOLERANCE[xla_config.compute_dtype]
    (loss, logits), grads = results["cudnn"]
    (ref_loss, ref_logits), ref_grads = results["xla"]
    real = np.asarray(valid)
    logits_err = float(np.max(np.abs(np.asarray(logits, np.float32)[real]
                                     - np.asarray(ref_logits, np.float32)[real]))
                       / np.max(np.abs(np.asarray(ref_logits, np.float32)[real])))
    grad_errs = [_relative(g, r) for g, r in zip(jax.tree.leaves(grads),
                                                 jax.tree.leaves(ref_grads), strict=True)]
    report = {
        "backend": backend, "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__, "dtype": xla_config.compute_dtype, "rows": rows, "seq": seq,
        "real_tokens": int(real.sum()), "cudnn_arm": "xla rotation" if args.tiny else "cudnn",
        "fused_attention_call": fused_call,
        "loss": {"xla": float(ref_loss), "cudnn": float(loss)},
        "logits_max_rel_err": logits_err, "grad_max_rel_err": max(grad_errs),
        "tolerance": tol,
        "step_s_median": {k: statistics.median(v) for k, v in timings.items()},
        "step_s": timings,
    }
    failures = []
    if logits_err > tol:
        failures.append(f"logits differ by {logits_err:.3g} of their scale (> {tol})")
    if abs(float(loss) - float(ref_loss)) > tol * abs(float(ref_loss)):
        failures.append(f"loss {float(loss)} vs {float(ref_loss)}")
    if max(grad_errs) > tol:
        failures.append(f"a gradient differs by {max(grad_errs):.3g} of its norm (> {tol})")
    if fused_call is False:
        failures.append("the cudnn program holds no __cudnn$fmha custom call")
    report["ok"], report["failures"] = not failures, failures
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention.json").write_text(json.dumps(report, indent=1) + "\n")
    med = report["step_s_median"]
    print(f"attention check ({report['cudnn_arm']} vs xla, {xla_config.compute_dtype}, "
          f"{rows} x {seq}): {'ok' if not failures else 'FAILED: ' + '; '.join(failures)}; "
          f"logits err {logits_err:.2g}, grad err {max(grad_errs):.2g}; fwd+bwd "
          f"{med['cudnn'] * 1e3:.1f} ms vs xla {med['xla'] * 1e3:.1f} ms "
          f"({med['xla'] / med['cudnn']:.2f}x)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
