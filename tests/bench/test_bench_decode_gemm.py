"""`pipefill bench decode-gemm` on tiny sizes (no timing is checked): the packed decode GEMM and,
with --gguf-type, the quantized one on Gemma 3 270M's shapes, where a shape whose K is not
whole blocks of the type is skipped with a line that says so."""
import pytest

from pipefill.cli.main import main
from pipefill.kernels import quant_gemm


def test_quantized_gemm_rows_and_skipped_shapes(capsys):
    if quant_gemm.choose_isa()[0] == "torch":
        pytest.skip("no quantized GEMM path runs here")
    assert main(["bench", "decode-gemm", "--rows", "1,2", "--threads", "1", "--gguf-type", "Q4_K",
                 "--shape-set", "gemma3-270m", "--shapes", "qkv,o_proj", "--min-s", "0.01",
                 "--stream-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert "weights Q4_K" in out
    int8 = quant_gemm.choose_int8()[0]  # the default: the integer path where one runs
    assert (f"isa int8-{int8}," if int8 else f"isa {quant_gemm.choose_isa()[0]},") in out
    assert "| qkv 640x1536 | skipped: K is not whole Q4_K blocks |" in out
    assert len([line for line in out.splitlines() if line.startswith("| o_proj 1024x640 |")]) == 2
