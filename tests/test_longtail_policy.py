"""`benchmarks/longtail_policy.py` (vs_trl.py's long-tail workload): the weights are the
intended Markov chain after a full Qwen2 forward, and sampling them, in transformers and in
jaxrl's sampler, gives the intended completion lengths (median, fraction at the cap, mean),
which the text of a completion counts as its tokens do."""

import importlib.util
import inspect
import statistics
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen2ForCausalLM

from jaxrl.data.tasks.gsm8k import render_question
from jaxrl.data.tokenizer import completion_end_ids, load_tokenizer, pad_token_id
from jaxrl.models import from_pretrained
from jaxrl.rollout import Prompts, Sampler, SamplerConfig, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # vs_trl imports the other two by name
    spec.loader.exec_module(module)
    return module


lt = _load("longtail_policy")
_load("vs_trl_report")
vs_trl = _load("vs_trl")
ROWS = 512  # samples per library: the median's standard error is ~1.5 tokens, the cap's 2%
# transformers 5.25 renamed the forward's `past_key_values` (and its output's) to `cache`
CACHE_ARG = ("cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters
             else "past_key_values")
TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 64}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """torch's small matmuls here ran 10x slower on two threads than on one while another
    process kept a core busy (2 cores; xdist's workers are two such processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """(tokenizer, a prompt's ids, the saved tiny long-tail model's directory)."""
    work = tmp_path_factory.mktemp("longtail")
    questions = vs_trl.write_prompts(work / "prompts.jsonl")
    tokenizer = vs_trl.make_tokenizer([render_question(q) for q in questions])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(vs_trl.qwen2_config(tokenizer, tied=False, **TINY)).float()
    lt.make_markov(model, tokenizer)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    return tokenizer, tokenizer(render_question(questions[0]))["input_ids"], work / "model"


def _check_lengths(lengths):
    stats = lt.length_stats(lengths)
    assert 16 <= stats["len_median"] <= 24, stats
    assert 0.19 <= stats["cap_frac"] <= 0.31, stats
    assert 0.85 <= stats["len_mean"] / lt.expected_stats()["len_mean"] <= 1.15, stats
    assert stats["len_min"] == 2 and stats["len_max"] == lt.CAP, stats
    b_rows = [n for n in lengths if n < lt.CAP]  # L = 1 + K, K ~ Geometric(q): E[K] = 1 / q
    assert 1 / (statistics.fmean(b_rows) - 1) == pytest.approx(lt.EOS_PROB, rel=0.15)


def test_the_expected_statistics_follow_from_the_eos_probability():
    q = lt.EOS_PROB
    assert 0.75 * (1 - (1 - q) ** (lt.MEDIAN - 1)) == pytest.approx(0.5)  # P(L <= 20) = 1/2
    expected = lt.expected_stats()
    assert expected["len_mean"] == pytest.approx(0.25 * 256 + 0.75 * (1 + 1 / q), rel=1e-5)
    assert expected["cap_frac"] == pytest.approx(0.25, abs=1e-6)


def test_the_workload_model_is_the_chain_after_a_full_forward(workload):
    """The benchmark's own size (hidden 256, 4 layers): next-token probabilities after the
    prompt, an A token and a B token are the chain's, to float32 rounding."""
    tokenizer, prompt, _ = workload
    a_ids, b_ids = lt.token_classes(tokenizer)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(vs_trl.qwen2_config(tokenizer, tied=False)).float().eval()
    lt.make_markov(model, tokenizer)
    ids = torch.tensor([prompt + [a_ids[5], a_ids[9], b_ids[3], b_ids[7]]])
    with torch.no_grad():
        p = torch.softmax(model(ids).logits[0].double(), -1)
    after_prompt, after_a, after_b = p[len(prompt) - 1], p[len(prompt) + 1], p[-1]
    eos = tokenizer.eos_token_id
    assert after_prompt[a_ids].sum() == pytest.approx(0.25, abs=1e-5)
    assert after_prompt[b_ids].sum() == pytest.approx(0.75, abs=1e-5)
    assert after_a[a_ids].sum() == pytest.approx(1.0, abs=1e-5)
    assert after_b[eos] == pytest.approx(lt.EOS_PROB, rel=1e-4)
    assert after_b[b_ids].sum() == pytest.approx(1 - lt.EOS_PROB, abs=1e-5)
    assert torch.allclose(after_b[b_ids], after_b[b_ids].mean(), rtol=1e-4)  # uniform over B
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        lt.make_markov(Qwen2ForCausalLM(vs_trl.qwen2_config(tokenizer, tied=True, **TINY)),
                       tokenizer)


def test_transformers_samples_the_intended_lengths(workload):
    """Sampled from the transformers model's logits through its KV cache by inverse CDF,
    finished rows dropped (`generate` samples with torch.multinomial, which took ~40 ms a
    step over 512 x 4096 probabilities here: 10 s for the 256 steps)."""
    tokenizer, prompt, model_dir = workload
    eos = tokenizer.eos_token_id
    model = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    generator = torch.Generator().manual_seed(0)
    ids, cache = torch.tensor([prompt] * ROWS), None
    live, tokens = torch.arange(ROWS), [[] for _ in range(ROWS)]
    with torch.no_grad():
        for _ in range(lt.CAP):
            out = model(ids, **{CACHE_ARG: cache}, use_cache=True)
            cdf = torch.cumsum(torch.softmax(out.logits[:, -1], -1), -1)
            u = torch.rand(len(live), 1, generator=generator) * cdf[:, -1:]
            ids = torch.searchsorted(cdf, u).clamp(max=cdf.shape[1] - 1)
            for row, token in zip(live.tolist(), ids[:, 0].tolist(), strict=True):
                tokens[row].append(token)
            going = ids[:, 0] != eos
            cache, live, ids = getattr(out, CACHE_ARG), live[going], ids[going]
            if not len(live):
                break
            cache.batch_select_indices(torch.nonzero(going)[:, 0])
    for row in tokens:
        assert lt.length_from_text(tokenizer.decode(row, skip_special_tokens=True)) == len(row)
    _check_lengths([len(row) for row in tokens])


# Long sampling, little compiling: XLA's default program runs it 4x faster than the tests'
# cheap-compile one (tests/conftest.py: 46 s -> ~10 s).
@pytest.mark.default_compiler
def test_jaxrl_samples_the_intended_lengths(workload):
    """jaxrl's sampler stops at the saved EOS, as `jaxrl bench` and `jaxrl generate` set it
    up (stop ids from the tokenizer and the model config)."""
    _, prompt, model_dir = workload
    tokenizer = load_tokenizer(str(model_dir))
    model = from_pretrained(str(model_dir))
    graphdef, params = nnx.split(model)
    stop_ids = completion_end_ids(tokenizer, model.config, ())
    assert stop_ids == (tokenizer.eos_token_id,)
    config = SamplerConfig(lt.CAP, ROWS, end_token_ids=stop_ids,
                           pad_token_id=pad_token_id(tokenizer), sampling=SamplingParams(1.0))
    rollout = jax.device_get(Sampler(graphdef, config).generate(
        params, Prompts(np.array([prompt], np.int32), np.ones((1, len(prompt)), bool)),
        jax.random.key(0)))
    mask_BxC = np.asarray(rollout.completion_mask_BxC, bool)
    lengths = mask_BxC.sum(axis=1).tolist()
    texts = [tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
             for ids, m in zip(np.asarray(rollout.completion_ids_BxC), mask_BxC, strict=True)]
    assert [lt.length_from_text(t) for t in texts] == lengths
    _check_lengths(lengths)
