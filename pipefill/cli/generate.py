"""`pipefill generate`: one prompt through the engine, printing the text, TTFT and tokens/s."""
from __future__ import annotations

import argparse
import json
import random

from pipefill.config import server_args_from_namespace, server_args_parser_group


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate a completion for one prompt and print the text, "
                                   "the time to first token and the decode speed.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--input-len", type=int,
                     help="use a prompt of this many random token ids instead of text")
    p.add_argument("--chat", action="store_true",
                   help="wrap --prompt in the model's chat template as a user message")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--output-json", metavar="FILE",
                   help="also write the prompt ids, output ids, text and metrics here")
    p.add_argument("--ignore-eos", action="store_true", help="generate past the end token")
    p.add_argument("--prompt-logprobs", action="store_true",
                   help="--output-json also holds each prompt token's log-probability")
    server_args_parser_group(p)
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from pipefill.engine import Engine
    from pipefill.runtime.launch import run_other_node
    args = server_args_from_namespace(ns)
    if args.node_rank > 0:
        return run_other_node(args)
    if ns.prompt is None and ns.input_len is None:
        raise ValueError("give --prompt TEXT or --input-len N")
    if ns.input_len is not None and ns.input_len < 1:
        raise ValueError("--input-len must be at least 1")
    with Engine(**args.flags()) as engine:
        if ns.prompt is not None:
            prompt = ns.prompt
            if ns.chat:
                if engine.tokenizer is None:
                    raise ValueError("--chat: this model has no tokenizer")
                prompt = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        else:
            rng = random.Random(ns.seed)
            vocab = engine.model_config.vocab_size
            prompt = [rng.randrange(vocab) for _ in range(ns.input_len)]
        out = engine.generate([prompt], max_new_tokens=ns.max_new_tokens,
                              temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                              seed=ns.sampling_seed,
                              return_prompt_logprobs=ns.prompt_logprobs,
                              ignore_eos=ns.ignore_eos)[0]
        if args.trace_dir:
            t = engine.write_trace("generate")
            print(f"trace: {t['json']} (timeline {t.get('png')}): bubble ratio "
                  f"{t['bubble_ratio']:.3f} measured, {t['bubble_theory']:.3f} theory")
    m = out.metrics
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"prompt_ids": prompt if isinstance(prompt, list) else None,
                       "output_ids": out.output_ids, "text": out.text,
                       "finish_reason": out.finish_reason, "metrics": m,
                       "prompt_logprobs": out.prompt_logprobs}, f)
    print(out.text)
    print("---")
    speed = f"{m['decode_tok_per_s']:.1f} tok/s" if m["decode_tok_per_s"] else "n/a"
    print(f"prompt {out.num_prompt_tokens} tokens in chunks {m['chunk_sizes']}; "
          f"TTFT {m['ttft_s']:.3f} s ({out.num_prompt_tokens / m['ttft_s']:.0f} prompt tok/s); "
          f"{len(out.output_ids)} new tokens, decode {speed}; finish: {out.finish_reason}")
    return 0
