"""The kernel build cache is shared by every checkout on a machine: objects and glue folders of
other source versions stay while they may be in use, and each glue version gets its own folder."""
import os
import time

import pytest

from pipefill.kernels import build


def _source(tmp_path, name, body):
    src = tmp_path / name
    src.write_text(f"int pf_test_value() {{ return {body}; }}\n")
    return src


@pytest.fixture
def header(tmp_path):
    h = tmp_path / "h.h"
    h.write_text("#pragma once\n")
    return h


def test_other_versions_objects_stay_until_stale(tmp_path, header):
    out = tmp_path / "out"
    out.mkdir()
    old = build.compile_object(_source(tmp_path, "a.cpp", 1), header, ["-O1", "-fPIC"], out, "k")
    new = build.compile_object(_source(tmp_path, "b.cpp", 2), header, ["-O1", "-fPIC"], out, "k")
    assert old != new and old.exists() and new.exists()  # another checkout may link `old` now
    week = time.time() - build.STALE_AFTER_S - 60
    os.utime(old, (week, week))
    again = build.compile_object(_source(tmp_path, "b.cpp", 2), header, ["-O1", "-fPIC"], out,
                                 "k")
    assert again == new and not old.exists()  # unused for longer than STALE_AFTER_S: dropped


def test_glue_folder_per_version(tmp_path, header):
    src = _source(tmp_path, "glue.cpp", 3)
    one = build.glue_dir(tmp_path, [src, header], ["/x/k-aaaa.o"])
    assert one == build.glue_dir(tmp_path, [src, header], ["/y/k-aaaa.o"]) and one.is_dir()
    assert build.glue_dir(tmp_path, [src, header], ["/x/k-bbbb.o"]) != one  # a new object
    src.write_text("int pf_test_value() { return 4; }\n")
    assert build.glue_dir(tmp_path, [src, header], ["/x/k-aaaa.o"]) != one  # a new glue source


@pytest.mark.timeout(300)
def test_a_lock_file_left_by_a_killed_builder_does_not_hang_the_next_build(tmp_path, header):
    """cpp_extension's own `lock` file outlives a builder killed mid-build; the next build must
    take it for stale (it holds the folder's flock) instead of waiting on it forever."""
    out = tmp_path / "out"
    out.mkdir()
    obj = build.compile_object(_source(tmp_path, "k.cpp", 7), header, ["-O1", "-fPIC"], out, "k")
    glue = tmp_path / "glue.cpp"
    glue.write_text("extern int pf_test_value(); int pf_glue_value() { return pf_test_value(); }\n")
    first = build.link_glue("pf_test_glue", glue, [header], [str(obj)], out,
                            is_python_module=False)
    folder = build.glue_dir(out, [glue, header], [str(obj)])
    (folder / "lock").touch()  # what a builder killed inside cpp_extension leaves
    again = build.link_glue("pf_test_glue", glue, [header], [str(obj)], out,
                            is_python_module=False)
    assert again == first and not (folder / "lock").exists()


def test_a_path_is_skipped_only_where_the_cpu_lacks_its_flags():
    """cpu_paths.verdict, what every kernel test asks: a path that runs runs; one needing a
    flag the CPU lacks is skipped; one whose flags the CPU has and that does not run (a build
    that failed) fails, the scalar build (no flags) included."""
    from cpu_paths import verdict
    avx2 = frozenset({"avx2", "fma"})
    assert verdict("avx2", (True, "ok"), ("avx2", "fma"), avx2) == ("run", "")
    kind, why = verdict("avx512", (False, "cpuid: no AVX512F"), ("avx512f",), avx2)
    assert kind == "skip" and "the CPU lacks avx512f" in why
    kind, why = verdict("avx2", (False, "g++ exited with 1"), ("avx2", "fma"), avx2)
    assert kind == "fail" and "g++ exited with 1" in why
    assert verdict("scalar", (False, "no compiler"), (), frozenset())[0] == "fail"


def test_every_path_whose_flags_this_cpu_has_runs():
    """Each kernel's paths (ARCHITECTURE.md, 'Kernels'): every one whose CPU flags this
    machine has builds and runs here, so no kernel test is skipped for a failed build."""
    from pipefill.kernels import (amx_attention, cpu_attention, decode_gemm, fused_ops,
                                  kv_quant_attention, mla_attention, quant_gemm, shm_comm)

    from cpu_paths import verdict
    kernels = {
        "quantized GEMM": (quant_gemm.isa_status(), quant_gemm.ISA_CPU_FLAGS),
        "FP8 GEMM": (quant_gemm.fp8_isa_status(), quant_gemm.FP8_CPU_FLAGS),
        "integer quantized GEMM": (quant_gemm.int8_status(), quant_gemm.INT8_CPU_FLAGS),
        "decode GEMM": (decode_gemm.isa_status(), decode_gemm.ISA_CPU_FLAGS),
        "attention": ({i: cpu_attention.kernel_available(i) for i in cpu_attention.ISAS},
                      cpu_attention.REQUIRED_CPU_FLAGS),
        "AMX attention": ({"amx": amx_attention.amx_available()},
                          {"amx": amx_attention.REQUIRED_CPU_FLAGS}),
        "int8 KV decode attention": (kv_quant_attention.isa_status(),
                                     kv_quant_attention.ISA_CPU_FLAGS),
        "latent decode attention": (mla_attention.isa_status(), mla_attention.ISA_CPU_FLAGS),
        "fused ops": ({"least build": fused_ops.fused_available()},
                      {"least build": fused_ops.REQUIRED_CPU_FLAGS}),
        "all-reduce": (shm_comm.isa_status(), shm_comm.ISA_CPU_FLAGS),
    }
    failed = [f"{kernel}: {why}" for kernel, (status, needs) in kernels.items()
              for path in status
              for kind, why in [verdict(path, status[path], needs[path])] if kind == "fail"]
    assert not failed, "\n".join(failed)
