"""What reading a GGUF file leaves resident (ARCHITECTURE.md 'What a stage's memory is made
of'): a stage opens the file without its vocabulary (the tokenizer's arrays stepped over, every
other field as the full reader gives it), and the file's pages it copied are unmapped again."""
import subprocess
import sys

import numpy as np
import pytest

from pipefill.model.gguf_file import GGUFFile
from pipefill.model.loader import WeightSource, resolve_model_path


def _resident_bytes_of(view) -> int:
    """Resident bytes of this process's mappings that overlap `view`'s memory (/proc/self/smaps):
    this reader's map of the file only — not the shared libraries a first call pages in (the
    process's RssFile counts those: +33 MiB in the whole suite's process), nor another live
    reader's map of the same file, which other code in the process may be reading."""
    lo = view.ctypes.data
    hi = lo + view.nbytes
    total, inside = 0, False
    try:
        smaps = open("/proc/self/smaps")
    except OSError:
        pytest.skip("no /proc/self/smaps")
    with smaps:
        for line in smaps:
            fields = line.split()
            head = fields[0] if fields else ""
            if "-" in head and ":" not in head:  # a mapping's header line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < hi and lo < end
            elif inside and head == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_without_vocabulary_every_other_field_and_the_config_are_the_same():
    path = resolve_model_path(None)
    full, lean = WeightSource(path), WeightSource(path, vocabulary=False)
    assert lean.config == full.config
    skipped = set()
    for key in full.gguf.reader.fields:
        assert lean.gguf.array_length(key) == full.gguf.array_length(key), key
        try:
            value = lean.gguf.field(key)
        except ValueError as e:
            assert key in str(e) and "without its vocabulary" in str(e)
            skipped.add(key)
            continue
        assert value == full.gguf.field(key), key
    # The long arrays (tokens, merges, token types); short ones such as the languages stay.
    assert skipped == {"tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                       "tokenizer.ggml.token_type"}
    assert lean.gguf.field("general.languages") == ["en"]
    assert lean.gguf.array_length("tokenizer.ggml.tokens") == 49152
    assert lean.gguf.array_length("no.such.field") is None
    # The tensors are found at the same offsets: the skipped bytes were counted right.
    for name, t in full.gguf.tensors.items():
        assert lean.gguf.tensors[name].data_offset == t.data_offset, name
    name = "blk.3.ffn_down.weight"
    assert np.array_equal(lean.gguf.blocks(name), full.gguf.blocks(name))


def test_copied_blocks_leave_no_file_pages_resident():
    """Reading every matrix of the default model's 98 MB file (blocks and dequantized) keeps
    a few MiB of it mapped, not the file; the pages read again give the same bytes. In a fresh
    interpreter, as a stage loads: the suite's process has other readers and threads, and its
    residency moved by 21 MiB for reasons of its own."""
    code = f"import runpy; runpy.run_path({__file__!r})['_read_every_tensor_and_check']()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def _read_every_tensor_and_check():
    f = GGUFFile(resolve_model_path(None), vocabulary=False)
    before = _resident_bytes_of(f.reader.data)
    first = {}
    for name, t in f.tensors.items():
        if len(t.shape) == 2 and int(t.tensor_type) != 0:
            first[name] = f.blocks(name)
        else:
            first[name] = f.load(name).numpy()
    grown = _resident_bytes_of(f.reader.data) - before
    # Unmapping page-exact ranges left what faults mapped around them: 12.7 MB after a cold
    # read (34 MB in one CI), 96.5 MB without any unmapping; whole 2 MiB pieces leave none.
    assert grown < 4 << 20, f"{grown} bytes of the file stay mapped"
    again = f.blocks("token_embd.weight")
    assert np.array_equal(again, first["token_embd.weight"])
    assert np.array_equal(f.load("output_norm.weight").numpy(), first["output_norm.weight"])
