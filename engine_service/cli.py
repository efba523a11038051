"""`decodelab` command line: generate, bench, and the service commands (engine, web, play)."""
import argparse
import json
import sys

from engine_service.bench import (
    aggregate,
    gpu,
    llamacpp_build,
    modes,
    pd,
    pipeline,
    playground,
    quality,
    route,
    serve,
    soak,
    structured,
    throughput,
)
from engine_service.engine.flags import add_engine_args, engine_config_from_args
from engine_service.server import api_cmd, engine_cmd, play
from web import cli as web_cli


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", default=None, choices=["greedy", "sample", "beam", "speculative"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--beam-width", type=int, default=None, help="--mode beam: beams kept per step (default 4)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam score = logprob / length ** this")
    p.add_argument("--early-stopping", default="false", choices=["true", "false", "never"],
                   help="beam search stopping rule, as in Hugging Face generate")
    p.add_argument("--proposer", default="ngram", choices=["ngram", "draft"],
                   help="--mode speculative: n-gram prompt lookup or the engine's --draft-model")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--speculative-schedule", default="constant", choices=["constant", "heuristic"],
                   help="heuristic: the draft length grows by 2 (up to k) after a step that kept every draft, "
                        "else shrinks by 1 (Hugging Face assisted generation's schedule)")
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=3)


def sampling_params_from_args(args):
    from engine_service.engine.sampling_params import SamplingParams

    temperature = args.temperature
    if temperature is None:
        temperature = 1.0 if args.mode == "sample" else 0.0
    mode = args.mode or ("greedy" if temperature == 0 else "sample")
    beam_width = args.beam_width or (max(4, args.n) if mode == "beam" else 1)
    early_stopping = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    return SamplingParams(mode=mode, n=args.n, temperature=temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                          stop=args.stop, ignore_eos=args.ignore_eos, max_tokens=args.max_tokens,
                          logprobs=args.logprobs, beam_width=beam_width, length_penalty=args.length_penalty,
                          early_stopping=early_stopping, proposer=args.proposer,
                          num_speculative_tokens=args.num_speculative_tokens,
                          speculative_schedule=args.speculative_schedule, ngram_min=args.ngram_min,
                          ngram_max=args.ngram_max)


def read_prompts(args) -> list:
    prompts: list = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if "prompt_token_ids" in item:
                    prompts.append({"prompt_token_ids": item["prompt_token_ids"]})
                elif "prompt" in item:
                    prompts.append(item["prompt"])
                else:
                    raise ValueError(f"{args.prompts_file}:{lineno}: expected 'prompt' or 'prompt_token_ids'")
    if not prompts:
        raise ValueError("no prompts: give --prompt TEXT (repeatable) or --prompts-file F.jsonl")
    return prompts


def cmd_generate(args) -> int:
    from engine_service.engine.llm import LLM

    prompts = read_prompts(args)
    params = sampling_params_from_args(args)
    llm = LLM(config=engine_config_from_args(args))
    if args.chat:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) if isinstance(p, str) else p
                   for p in prompts]
    for out in llm.generate(prompts, params):
        if args.json:
            print(json.dumps({
                "prompt_token_ids": out.prompt_token_ids,
                "outputs": [{"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                             "cumulative_logprob": o.cumulative_logprob,
                             **({"score": o.score} if o.score is not None else {}),
                             **({"spec_marks": o.spec_marks} if o.spec_marks is not None else {}),
                             **({"logprobs": [{str(k): v for k, v in d.items()} for d in o.logprobs]}
                                if o.logprobs is not None else {})}
                            for o in out.outputs],
                "metrics": out.metrics.to_dict(),
            }), flush=True)
        else:
            for o in out.outputs:
                label = f"[{o.index}] " if len(out.outputs) > 1 else ""
                beam = ("" if o.score is None
                        else f"  cumulative_logprob={o.cumulative_logprob:.4f} score={o.score:.4f}")
                print(f"{label}{out.prompt if out.prompt is not None else out.prompt_token_ids!r}"
                      f"\033[1m{o.text}\033[0m  ({o.finish_reason}){beam}", flush=True)
            if out.metrics.spec is not None:
                print("spec: " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in out.metrics.spec.items()), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decodelab", description="See and serve LLM decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="run prompts through the engine (all prompts batch together)")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help='JSONL: {"prompt": ...} or {"prompt_token_ids": [...]} per line')
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")
    g.set_defaults(func=cmd_generate)
    bench = sub.add_parser("bench", help="benchmarks (JSON + PNG plots under benchmarks/results)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for module in (throughput, modes, quality, playground, pipeline, serve, route, pd, soak, gpu, structured,
                   aggregate, llamacpp_build):
        module.add_parser(bench_sub, add_engine_args)
    for module in (engine_cmd, api_cmd, play, web_cli):  # the service: a replica, the API front, the stack, the UI
        module.add_parser(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"decodelab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
