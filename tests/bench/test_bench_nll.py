"""`pipefill bench nll` on the default model (real GGUF file, real tokenizer, real stage
processes), a few hundred tokens: one mean NLL per --weight-dtype, plausible for a real model
on real English text and close between the dequantized and kept-quantized weights (the same
file: only where the arithmetic rounds differs); bad input is exit 2 with a sentence."""
import math
import re

import pytest

from pipefill.cli.main import main


@pytest.mark.slow
def test_nll_per_weight_dtype(capsys):
    assert main(["bench", "nll", "--tokens", "256", "--weight-dtypes", "auto,gguf",
                 "--dtype", "float32", "--threads-per-stage", "1"]) == 0
    out = capsys.readouterr().out
    nll = {w: float(v) for w, v in re.findall(r"--weight-dtype (\w+): mean NLL ([\d.]+)", out)}
    assert set(nll) == {"auto", "gguf"}, out
    assert 0.5 < nll["auto"] < math.log(49152)  # a real model on real text beats a uniform guess
    assert abs(nll["gguf"] / nll["auto"] - 1) < 0.01, nll


def test_bad_text_and_token_counts_are_sentences(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Just a few words.")
    assert main(["bench", "nll", "--text", str(short), "--tokens", "100"]) == 2
    assert re.search(r"has \d+ tokens; --tokens asks for 100", capsys.readouterr().err)
    assert main(["bench", "nll", "--text", str(tmp_path / "none.txt")]) == 2
    assert "cannot read it as UTF-8 text" in capsys.readouterr().err
    assert main(["bench", "nll", "--tokens", "1"]) == 2
    assert "--tokens must be at least 2" in capsys.readouterr().err
