"""`pipefill bench nll`: the mean negative log-likelihood pipefill gives a real text, per
--weight-dtype (a GGUF file dequantized, or its blocks kept quantized), beside llama.cpp's on the
same GGUF file and the same token ids (--peer llama.cpp).

The text (default: this repository's ARCHITECTURE.md) is tokenized by the model's tokenizer
and cut to --tokens; each engine scores every token after the first given the ones before it,
in one cold prefill (pipefill's prompt logprobs; llama.cpp's logits of every row). What a
quantized path costs in accuracy shows as the gap between the rows: the quantization of the
weights themselves is in every row alike, since every engine reads the same file.

A --weight-dtypes value that gives the stages the same weights as an earlier one (auto keeps
the blocks where gguf would, or dequantizes into what bfloat16 would: model/auto_weights.py)
is not run again; the output says which it equals.

The default text changes with the repository, so the output names the token ids it scored by
a fingerprint: figures from runs apart (another checkout, another tool such as transformers
on the same ids) compare only where the fingerprints are equal.
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
from pathlib import Path

from pipefill.bench.prefill import add_peer_flags
from pipefill.config import server_args_from_namespace, server_args_parser_group

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "ARCHITECTURE.md"


def add_parser(sub) -> None:
    p = sub.add_parser("nll", help="mean negative log-likelihood of a text, per weight dtype "
                                   "and beside llama.cpp", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=str(DEFAULT_TEXT),
                   help="a UTF-8 text file to score (default: the repository's ARCHITECTURE.md)")
    p.add_argument("--tokens", type=int, default=4096, help="score this many tokens of it")
    p.add_argument("--weight-dtypes", default="bfloat16,gguf",
                   help="comma-separated --weight-dtype values, one engine each in turn (one "
                        "that resolves to the same weights as an earlier one is not run again)")
    add_peer_flags(p)
    server_args_parser_group(p, skip=("weight_dtype",))
    p.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from pipefill.engine import Engine
    from pipefill.model.loader import WeightSource, resolve_model_path
    from pipefill.model.tokenizer import load_tokenizer

    if ns.tokens < 2:
        raise ValueError("--tokens must be at least 2 (the first token is not scored)")
    path = resolve_model_path(server_args_from_namespace(ns).model_path)
    source = WeightSource(path)
    ids = text_ids(ns.text, load_tokenizer(source), ns.tokens)
    args = server_args_from_namespace(ns).replace(
        model_path=path, max_model_len=len(ids) + 1, disable_radix_cache=True)
    rows, same = [], []
    for weight_dtype, twin in weight_choices(args, source, ns.weight_dtypes.split(",")):
        if twin is not None:
            same.append(f"--weight-dtype {weight_dtype} gives the stages the same weights as "
                        f"--weight-dtype {twin} here: not run again")
            continue
        with Engine(**args.replace(weight_dtype=weight_dtype).flags()) as engine:
            out = engine.generate([ids], max_new_tokens=1, return_prompt_logprobs=True)[0]
        rows.append((f"pipefill --weight-dtype {weight_dtype}",
                     -statistics.fmean(out.prompt_logprobs)))
    if ns.peer is not None:
        from pipefill.bench.llama_peer import LlamaPeer, peer_python
        peer = LlamaPeer(path, args.layout.num_threads, len(ids) + 16,
                         peer_python(ns.peer_python))
        try:
            rows.append((f"llama.cpp (llama-cpp-python {peer.version})", peer.mean_nll(ids)))
        finally:
            peer.close()
    base = rows[-1][1]
    print(f"{len(ids) - 1} tokens of {ns.text} scored ({args.dtype} compute; token ids "
          f"{ids_fingerprint(ids)})")
    for name, nll in rows:
        print(f"{name:>42}: mean NLL {nll:.4f} nats/token ({100 * (nll / base - 1):+.2f}% "
              f"against {rows[-1][0]})")
    for line in same:
        print(line)
    return 0


def weight_choices(args, source, names: list[str]) -> list[tuple[str, str | None]]:
    """Each --weight-dtypes value with the earlier value whose weights it resolves to, or None
    where it is the first of its kind: per stage, the blocks kept or the dtype the matrices
    are dequantized into, as build_stage decides (model/loader.stage_keeps_blocks)."""
    from pipefill.base.platform import dtype_name, resolve_dtype, usable_cpu_flags
    from pipefill.config import resolve
    from pipefill.model.loader import (hidden_decode_paths, resolve_weight_dtype,
                                       stage_keeps_blocks)

    seen: dict[tuple, str] = {}
    out = []
    for name in [n.strip() for n in names if n.strip()]:
        stages = resolve(args.replace(weight_dtype=name), source.config)
        dtype = resolve_dtype(stages.dtype, usable_cpu_flags(stages.hide_cpu_flags))
        disable = hidden_decode_paths(stages.hide_cpu_flags)
        kept = tuple(
            "blocks" if stage_keeps_blocks(name, source, layers, rank == 0,
                                           rank == len(stages.layout.ranges) - 1,
                                           stages.device, stages.dtype, dtype, stages.tp_size,
                                           disable)[0]
            else dtype_name(resolve_weight_dtype(name, dtype))
            for rank, layers in enumerate(stages.layout.ranges))
        out.append((name, seen.get(kept)))
        seen.setdefault(kept, name)
    if not out:
        raise ValueError("--weight-dtypes needs at least one value, such as bfloat16,gguf")
    return out


def ids_fingerprint(ids: list[int]) -> str:
    """A short hash of the token ids, to tell whether two runs scored the same tokens."""
    data = b"".join(i.to_bytes(4, "little") for i in ids)
    return "sha256:" + hashlib.sha256(data).hexdigest()[:12]


def text_ids(path: str, tokenizer, tokens: int) -> list[int]:
    """The first `tokens` token ids of the text file."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer to turn a text into tokens")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--text {path}: cannot read it as UTF-8 text ({e})") from e
    ids = tokenizer.encode(text)[:tokens]
    if len(ids) < tokens:
        raise ValueError(f"--text {path} has {len(ids)} tokens; --tokens asks for {tokens}")
    return ids
