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
