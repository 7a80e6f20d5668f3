"""`pipefill bench attention` on tiny sizes: it runs, and over a quantized cache it times the
vector kernels only (AMX does not read quantized pages), each within rounding of SDPA over
the same dequantized values. No timings are checked."""
import json

import pytest

from pipefill.bench.attention import main


def test_bench_attention_over_quantized_caches(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--prefix-lens", "96", "--chunk", "1", "--threads", "1", "--reps", "1",
                 "--dtypes", "float32", "--kv-cache-dtypes", "same,int8,fp8_e4m3",
                 "--no-split-profile", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["kv_dtype"] for r in data["rows"]] == ["float32", "int8", "float8_e4m3fn"]
    assert data["kernels"]["float32/int8"]["amx"] == "reads bfloat16 pages only"
    for row in data["rows"]:
        for name in ("avx512", "avx2"):
            if f"{name}_s" in row:
                assert row[f"{name}_vs_masked_max_abs"] < 1e-5, (name, row["kv_dtype"])
    assert " int8 prefix " in capsys.readouterr().out


def test_bench_attention_bad_kv_dtype_is_a_sentence():
    with pytest.raises(ValueError, match="--kv-cache-dtypes 'int4': choose from same, int8"):
        main(["--kv-cache-dtypes", "int4"])
