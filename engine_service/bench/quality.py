"""`decodelab bench quality`: what the approximate modes cost in quality, against the full-precision engine.

Variants (one engine each, built in turn from the same engine options): the baseline (the dtype as given,
float32 on CPU), int8 weights (`quantization="int8"`, models/int8_linear.py; over the KV cache's default there, fp16
on a CPU, and over a cache in the model's dtype), an fp16 KV cache, an int8 KV cache (`kv_cache_dtype="int8"`,
skipped with the reason when this tree's EngineConfig has no such field) and int8 weights over it.

- Held-out text (`held_out_text`): English prose that ships with every Python, the Language Reference
  topics of `pydoc_data.topics` (a fixed list, paragraphs re-flowed), not the int8 calibration text;
  the JSON names the topics, the Python version and the text's sha256. Its first `text_tokens` tokens are
  scored.
- Perplexity through the engine itself: the token stream is cut into consecutive chunks of at most the
  model's context (minus the one token each request must generate), each sent with
  `SamplingParams(prompt_logprobs=0, max_tokens=1)`; ppl = exp(-mean log p) over every scored token (a
  chunk's first token has no context and is not scored). That is Hugging Face's exp(loss) over the same
  chunks (tests/engine/test_bench_quality.py holds it to 1e-3 relative).
- Three more held-out texts of different kinds (`benchmarks/data/`: prose written for this benchmark, code from
  CPython's textwrap.py, the Apache-2.0 licence; `QUALITY_TEXTS`), each scored whole in one request through the
  same prompt log-probs: perplexity and teacher-forced top-1 agreement with the baseline (the share of positions
  whose most likely next token is the baseline's).
- Continuation log-likelihoods as lm-eval scores them (`PAIRS`): log p(continuation | prompt), summed over the
  continuation's tokens, from the prompt log-probs of prompt + continuation in one request; per variant the
  difference from the baseline's, in nats.
- Greedy divergence: `num_prompts` sentences of the same text as prompts, `new_tokens` greedy tokens each
  (`ignore_eos`), all in one batch; per variant the index of the first token that differs from the
  baseline's continuation (`new_tokens` when all agree), its distribution and the share identical throughout.

A variant whose perplexity is more than 2% above the baseline's is marked "fails the 2% bar (not a
default)". Writes benchmarks/results/quality.json and quality.png.
"""
from __future__ import annotations

import gc
import hashlib
import math
import re
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from engine_service.bench.common import cpu_info, median, pyplot, write_with_plot
from engine_service.engine.config import EngineConfig
from engine_service.engine.sampling_params import SamplingParams

BAR = 0.02  # relative perplexity increase above which a variant may not be a default
TOPICS = ("objects", "execmodel", "import", "function")  # pydoc_data.topics keys, prose first, no overlap
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
QUALITY_TEXTS = ("prose.txt", "code.py.txt", "apache-2.0.txt")  # DATA/README.md says where each comes from
# (prompt, continuation) as lm-eval's loglikelihood requests: facts, code, counting, a low-probability idiom
PAIRS = (("The largest planet is", " Jupiter"), ("The capital of France is", " Paris"),
         ("Water boils at a temperature of 100 degrees", " Celsius"), ("def add(a, b):\n    return", " a + b"),
         ("The opposite of hot is", " cold"), ("One, two, three, four,", " five"),
         ("The cat sat on the", " mat"), ("Romeo and Juliet was written by William", " Shakespeare"))


@dataclass(frozen=True)
class Variant:
    name: str
    quantization: str | None = None
    kv_cache_dtype: str | None = None


@dataclass(frozen=True)
class HeldOutText:
    text: str
    source: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("quality", help="perplexity and greedy divergence: int8 weights / KV vs full precision")
    add_engine_args(p)
    p.add_argument("--text-tokens", type=int, default=4096, help="tokens of the held-out text to score")
    p.add_argument("--chunk-tokens", type=int, default=None, help="tokens per scored chunk (default: the context)")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


def held_out_text(topics: tuple[str, ...] = TOPICS) -> HeldOutText:
    """The Language Reference topics of this Python's `pydoc_data`, in order; hard-wrapped prose paragraphs
    joined into one line each, indented blocks (code, grammar) kept as they are."""
    from pydoc_data.topics import topics as docs

    paragraphs = []
    for key in topics:
        for para in re.split(r"\n\s*\n", docs[key].strip()):
            lines = para.splitlines()
            paragraphs.append(para if any(line.startswith(" ") for line in lines) else " ".join(lines))
    version = ".".join(map(str, sys.version_info[:3]))
    return HeldOutText("\n\n".join(paragraphs),
                       f"pydoc_data.topics of CPython {version} (the Python Language Reference), topics "
                       f"{', '.join(topics)}; paragraphs re-flowed")


def sentences(text: str, count: int, min_words: int = 8, max_words: int = 40) -> list[str]:
    """`count` prose sentences spread evenly over the text (no code blocks, no headings)."""
    found = []
    for para in text.split("\n\n"):
        if para.startswith(" ") or "\n" in para:
            continue
        found += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", para)
                  if re.fullmatch(r"[A-Z][^*\n]*[.!?]", s) and min_words <= len(s.split()) <= max_words]
    if len(found) <= count:
        return found
    return [found[i * len(found) // count] for i in range(count)]


def chunks(ids: list[int], size: int) -> list[list[int]]:
    """Consecutive, non-overlapping; a last piece of one token has nothing to score and is dropped."""
    return [ids[i:i + size] for i in range(0, len(ids), size) if len(ids[i:i + size]) > 1]


@dataclass(frozen=True)
class Scored:
    """One token sequence through the engine's prompt log-probs: each token's log p after the first, and the
    most likely token at each of those positions (teacher forcing)."""
    logprobs: list[float]
    top1: list[int]


def score(llm, pieces: list[list[int]]) -> list[Scored]:
    """Every piece in one generate call, `prompt_logprobs=1` (the top token besides the piece's own)."""
    params = SamplingParams(prompt_logprobs=1, max_tokens=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in pieces], params)
    return [Scored([out.prompt_logprobs[pos][piece[pos]] for pos in range(1, len(piece))],
                   [max(lp.items(), key=lambda kv: kv[1])[0] for lp in out.prompt_logprobs[1:]])
            for piece, out in zip(pieces, outs)]


def quality_texts(tokenizer, names: tuple[str, ...] = QUALITY_TEXTS) -> dict[str, list[int]]:
    return {name: tokenizer((DATA / name).read_text(), add_special_tokens=False).input_ids for name in names}


def pair_tokens(tokenizer, pairs=PAIRS) -> list[tuple[list[int], list[int]]]:
    """Prompt and continuation tokenized apart, so a continuation's tokens are the same in every variant."""
    return [(tokenizer(p, add_special_tokens=False).input_ids, tokenizer(c, add_special_tokens=False).input_ids)
            for p, c in pairs]


def text_scores(llm, texts: dict[str, list[int]]) -> dict[str, Scored]:
    return dict(zip(texts, score(llm, list(texts.values()))))


def continuation_logliks(llm, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """log p(continuation | prompt) per pair: the sum over the continuation's tokens."""
    return [sum(s.logprobs[len(p) - 1:]) for s, (p, _) in zip(score(llm, [p + c for p, c in pairs]), pairs)]


def compare_texts(scores: dict[str, Scored], base: dict[str, Scored]) -> dict:
    """Per text: perplexity, its change from the baseline's, top-1 agreement with the baseline; and over all."""
    out: dict = {}
    for name, sc in scores.items():
        ppl = math.exp(-sum(sc.logprobs) / len(sc.logprobs))
        ref = math.exp(-sum(base[name].logprobs) / len(base[name].logprobs))
        agree = sum(a == b for a, b in zip(sc.top1, base[name].top1, strict=True))
        out[name] = {"tokens": len(sc.logprobs), "ppl": ppl, "rel_ppl_change": ppl / ref - 1,
                     "top1_agreement": agree / len(sc.top1)}
    n = sum(r["tokens"] for r in out.values())
    out_all = {"max_rel_ppl_change": max(r["rel_ppl_change"] for r in out.values()),
               "top1_agreement": sum(r["top1_agreement"] * r["tokens"] for r in out.values()) / n}
    return {"per_text": out, **out_all}


def engine_perplexity(llm, pieces: list[list[int]]) -> dict:
    """exp(-mean log p) of every token after the first of each piece, from the engine's prompt log-probs."""
    params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in pieces], params)
    seconds = time.perf_counter() - start
    total, n = 0.0, 0
    for piece, out in zip(pieces, outs):
        total += sum(out.prompt_logprobs[pos][piece[pos]] for pos in range(1, len(piece)))
        n += len(piece) - 1
    return {"ppl": math.exp(-total / n), "nll_per_token": -total / n, "scored_tokens": n, "seconds": seconds}


def greedy_continuations(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    return [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def first_divergence(base: list[list[int]], other: list[list[int]]) -> list[int]:
    """Per prompt, the index of the first token that differs (the length when none does)."""
    return [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(base, other)]


def divergence_summary(first: list[int], new_tokens: int) -> dict:
    return {"first_diff": first, "histogram": [first.count(i) for i in range(new_tokens + 1)],
            "identical_fraction": first.count(new_tokens) / len(first), "median_first_diff": median(first),
            "mean_first_diff": sum(first) / len(first)}


def variants(base_dtype: str) -> list[Variant]:
    base = SHORT_DTYPE.get(base_dtype, base_dtype)
    # int8_weights: as `play` runs them (with the KV cache's default there, fp16 on a CPU: EngineConfig), and the
    # two parts apart: the int8 weights over a cache of the model's dtype, an fp16 cache under the float weights
    return [Variant(base), Variant("int8_weights", quantization="int8"),
            Variant("int8_weights_model_dtype_kv", quantization="int8", kv_cache_dtype="model"),
            Variant("fp16_kv", kv_cache_dtype="fp16"), Variant("int8_kv", kv_cache_dtype="int8"),
            Variant("int8_weights_int8_kv", quantization="int8", kv_cache_dtype="int8")]


def variant_config(base: EngineConfig, v: Variant) -> EngineConfig | str:
    """The engine config of a variant, or why this tree cannot build it."""
    kv_field = next((f for f in fields(EngineConfig) if f.name == "kv_cache_dtype"), None)
    if kv_field is None:
        if v.kv_cache_dtype:
            return ("kv_cache_dtype: EngineConfig has no such field in this tree (the INT8 KV cache is not in yet); "
                    "row skipped")
        return replace(base, quantization=v.quantization)
    kv = v.kv_cache_dtype or kv_field.default
    if kv == "model":  # the cache in the model's own dtype, whatever the default under these weights
        if base.dtype != "float32":
            return f"kv_cache_dtype: the model's dtype is {base.dtype}, the cache {base.dtype} already; row skipped"
        kv = "fp32"
    return replace(base, quantization=v.quantization, kv_cache_dtype=kv)


def measure(base: EngineConfig, text: HeldOutText, text_tokens: int = 4096, chunk_tokens: int | None = None,
            num_prompts: int = 50, new_tokens: int = 32) -> dict:
    """Every variant's perplexity and greedy divergence from the first (the baseline), on the same tokens."""
    from engine_service.engine.llm import LLM

    res: dict = {"text": {"source": text.source, "sha256": text.sha256, "chars": len(text.text)},
                 "prompts": {"source": "sentences of the held-out text, evenly spaced", "new_tokens": new_tokens},
                 "bar": BAR, "variants": {}}
    ids = pieces = prompts = baseline = texts = pairs = None
    for v in variants(base.dtype):
        config = variant_config(base, v)
        if isinstance(config, str):
            res["variants"][v.name] = {"skipped": config}
            print(f"{v.name}: skipped ({config})", flush=True)
            continue
        try:
            llm = LLM(config=config)
        except (ValueError, NotImplementedError) as e:  # e.g. a KV dtype this backend does not take
            if baseline is None:
                raise  # nothing to compare with
            res["variants"][v.name] = {"skipped": f"{type(e).__name__}: {e}"}
            print(f"{v.name}: skipped ({e})", flush=True)
            continue
        if ids is None:  # the baseline's tokenizer and context; every variant gets the same tokens
            ids = llm.tokenizer(text.text, add_special_tokens=False).input_ids[:text_tokens]
            size = min(chunk_tokens or llm.engine.max_model_len - 1, llm.engine.max_model_len - 1)
            pieces = chunks(ids, size)
            prompts = [llm.tokenizer(s, add_special_tokens=False).input_ids for s in sentences(text.text, num_prompts)]
            res["text"].update(tokens=len(ids), chunk_tokens=size, chunks=len(pieces))
            res["prompts"]["count"] = len(prompts)
            texts = {n: t[:size + 1] for n, t in quality_texts(llm.tokenizer).items()}
            pairs = pair_tokens(llm.tokenizer)
            res["texts"] = {n: {"sha256": hashlib.sha256((DATA / n).read_bytes()).hexdigest(), "tokens": len(t)}
                            for n, t in texts.items()}
            res["pairs"] = [{"prompt": p, "continuation": c} for p, c in PAIRS]
        row = {"quantization": v.quantization, "kv_cache_dtype": llm.engine.config.kv_cache_dtype,
               **engine_perplexity(llm, pieces)}
        continuations = greedy_continuations(llm, prompts, new_tokens)
        scores, logliks = text_scores(llm, texts), continuation_logliks(llm, pairs)
        row["pair_logliks"] = logliks
        if baseline is None:
            baseline = row | {"name": v.name, "continuations": continuations, "scores": scores}
        else:
            row["rel_ppl_change"] = row["ppl"] / baseline["ppl"] - 1
            row["verdict"] = ("fails the 2% bar (not a default)" if row["rel_ppl_change"] > BAR
                              else "within the 2% bar")
            row["divergence"] = divergence_summary(first_divergence(baseline["continuations"], continuations),
                                                   new_tokens)
            row["texts"] = compare_texts(scores, baseline["scores"])
            row["pair_deltas"] = [a - b for a, b in zip(logliks, baseline["pair_logliks"])]
            row["max_abs_pair_delta"] = max(map(abs, row["pair_deltas"]))
        res["variants"][v.name] = row
        print(f"{v.name}: ppl {row['ppl']:.4f}" + (f" ({row['rel_ppl_change']:+.2%}, {row['verdict']}; identical "
              f"over {new_tokens} tokens: {row['divergence']['identical_fraction']:.0%}; texts "
              + ", ".join(f"{n} {t['rel_ppl_change']:+.2%}" for n, t in row["texts"]["per_text"].items())
              + f"; top-1 agreement {row['texts']['top1_agreement']:.2%}; continuation log-likelihoods within "
              f"{row['max_abs_pair_delta']:.3f} nats)" if "verdict" in row else ""), flush=True)
        del llm
        gc.collect()  # one engine's weights and KV pool at a time
    res["baseline"] = baseline["name"] if baseline else None
    return res


def run(args) -> int:
    import torch

    from engine_service.engine.flags import engine_config_from_args

    base = engine_config_from_args(args)
    res = {"model": args.model, "dtype": base.dtype, "threads": args.threads or torch.get_num_threads(),
           "cpu": cpu_info()}
    res |= measure(base, held_out_text(), args.text_tokens, args.chunk_tokens, args.num_prompts, args.new_tokens)
    write_with_plot("quality", res, args.out, plot)
    return 0


def plot(res: dict, path) -> None:
    plt = pyplot()

    rows = {k: v for k, v in res["variants"].items() if "ppl" in v}
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(13, 9))
    names = [n for n in rows if "rel_ppl_change" in rows[n]]  # the baseline is the zero line
    changes = [100 * rows[n]["rel_ppl_change"] for n in names]
    a.bar(names, changes, color=["tab:red" if c > 100 * res["bar"] else "tab:green" for c in changes])
    for i, n in enumerate(names):
        a.text(i, changes[i], f"ppl {rows[n]['ppl']:.3f}\n{changes[i]:+.2f}%", ha="center",
               va="bottom" if changes[i] >= 0 else "top")
    a.axhline(100 * res["bar"], color="black", linestyle="--")
    a.axhline(0, color="gray", linewidth=0.8)
    a.set_ylim(min(0, *changes) * 1.3 - 0.5, max(100 * res["bar"], *changes) * 1.35 + 0.5)
    skipped = [k for k, v in res["variants"].items() if "skipped" in v]
    base = rows.get(res.get("baseline"), {})
    a.set_ylabel(f"perplexity change vs {res.get('baseline')} (%)")
    a.set_title(f"{res['model']}: {res['text'].get('tokens', 0)} held-out tokens, {res.get('baseline')} ppl "
                f"{base.get('ppl', float('nan')):.3f}; dashed: the 2% bar"
                + (f"\nskipped: {', '.join(skipped)}" if skipped else ""), fontsize=9)
    n_new = res["prompts"]["new_tokens"]
    for n in names:
        if "divergence" not in rows[n]:
            continue
        first = rows[n]["divergence"]["first_diff"]
        xs = list(range(n_new + 1))
        b.step(xs, [sum(f >= x for f in first) / len(first) for x in xs], where="post", label=n)
    b.set_xlabel("token index")
    b.set_ylabel(f"prompts still identical to {res.get('baseline')}")
    b.set_title(f"greedy continuations of {res['prompts'].get('count', 0)} prompts")
    b.set_ylim(0, 1.05)
    b.legend()
    compared = [n for n in names if "texts" in rows[n]]
    width = 0.8 / max(len(compared), 1)
    for i, n in enumerate(compared):
        per = rows[n]["texts"]["per_text"]
        c.bar([j + i * width for j in range(len(per))], [100 * t["rel_ppl_change"] for t in per.values()], width,
              label=f"{n} (top-1 {100 * rows[n]['texts']['top1_agreement']:.1f}%)")
        c.set_xticks([j + width * (len(compared) - 1) / 2 for j in range(len(per))], list(per))
        d.plot(range(len(rows[n]["pair_deltas"])), rows[n]["pair_deltas"], "o", label=n)
    c.axhline(0.5, color="black", linestyle="--")
    c.set_ylabel(f"perplexity change vs {res.get('baseline')} (%)")
    c.set_title("held-out texts of three kinds (dashed: +0.5%); legend: teacher-forced top-1 agreement", fontsize=9)
    c.legend(fontsize=8)
    for y in (-0.05, 0.05):
        d.axhline(y, color="black", linestyle="--")
    d.axhline(0, color="gray", linewidth=0.8)
    d.set_xticks(range(len(res.get("pairs", []))), [p["continuation"].strip() for p in res.get("pairs", [])],
                 rotation=30, fontsize=8)
    d.set_ylabel(f"log-likelihood - {res.get('baseline')}'s (nats)")
    d.set_title("continuation log-likelihoods (lm-eval style); dashed: +-0.05 nats", fontsize=9)
    d.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
