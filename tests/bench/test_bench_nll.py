"""`pipefill bench nll` on the default model (real GGUF file, real tokenizer, real stage
processes), a few hundred tokens: one mean NLL per --weight-dtype, plausible for a real model
on real English text and close between the dequantized and kept-quantized weights (the same
file: only where the arithmetic rounds differs); --weight-dtypes values that resolve to the
same weights run once; bad input is exit 2 with a sentence."""
import math
import re

import pytest

from pipefill.bench.nll import ids_fingerprint, weight_choices
from pipefill.cli.main import main
from pipefill.config import make_server_args
from pipefill.kernels import quant_gemm
from pipefill.model.loader import WeightSource, resolve_model_path


@pytest.mark.slow
def test_nll_per_weight_dtype(capsys):
    assert main(["bench", "nll", "--tokens", "256", "--weight-dtypes", "auto,gguf",
                 "--dtype", "float32", "--threads-per-stage", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"255 tokens of .* token ids sha256:[0-9a-f]{12}\)", out), out
    nll = {w: float(v) for w, v in re.findall(r"--weight-dtype (\w+): mean NLL ([\d.]+)", out)}
    assert set(nll) == {"auto", "gguf"}, out
    assert 0.5 < nll["auto"] < math.log(49152)  # a real model on real text beats a uniform guess
    assert abs(nll["gguf"] / nll["auto"] - 1) < 0.01, nll


def test_the_fingerprint_tells_token_ids_apart():
    """Two texts alike for thousands of tokens and apart at one (as the default text is between
    checkouts) get fingerprints apart; the same ids the same one."""
    ids = list(range(4096))
    moved = ids[:1580] + [7] + ids[1581:]
    assert ids_fingerprint(ids) == ids_fingerprint(list(ids))
    assert ids_fingerprint(ids) != ids_fingerprint(moved)
    assert ids_fingerprint(ids) != ids_fingerprint(ids[:-1])
    assert ids_fingerprint([1, 256]) != ids_fingerprint([256, 1])


def test_weight_dtypes_that_resolve_alike_are_named_once():
    """On the default GGUF file in bfloat16, auto keeps the blocks as gguf does where the
    quantized GEMM has a vector path here (model/auto_weights.py), else dequantizes into
    bfloat16 as bfloat16 does; under --dtype float32 auto dequantizes into float32."""
    source = WeightSource(resolve_model_path(None))
    vector = quant_gemm.choose_int8()[0] or quant_gemm.choose_isa()[0] in ("avx512", "avx2")
    bf16 = make_server_args(source.path, dtype="bfloat16", threads_per_stage=1)
    assert weight_choices(bf16, source, ["gguf", "bfloat16", "auto", "gguf", ""]) == [
        ("gguf", None), ("bfloat16", None), ("auto", "gguf" if vector else "bfloat16"),
        ("gguf", "gguf")]
    fp32 = bf16.replace(dtype="float32")
    assert weight_choices(fp32, source, ["float32", "auto", "bfloat16", "gguf"]) == [
        ("float32", None), ("auto", "float32"), ("bfloat16", None), ("gguf", None)]


def test_bad_text_and_token_counts_are_sentences(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Just a few words.")
    assert main(["bench", "nll", "--text", str(short), "--tokens", "100"]) == 2
    assert re.search(r"has \d+ tokens; --tokens asks for 100", capsys.readouterr().err)
    assert main(["bench", "nll", "--text", str(tmp_path / "none.txt")]) == 2
    assert "cannot read it as UTF-8 text" in capsys.readouterr().err
    assert main(["bench", "nll", "--tokens", "1"]) == 2
    assert "--tokens must be at least 2" in capsys.readouterr().err
    assert main(["bench", "nll", "--tokens", "8", "--weight-dtypes", ","]) == 2
    assert "--weight-dtypes needs at least one value" in capsys.readouterr().err
