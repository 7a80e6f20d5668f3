"""What reading a GGUF file leaves resident (ARCHITECTURE.md 'What a stage's memory is made
of'): a stage opens the file without its vocabulary (the tokenizer's arrays stepped over, every
other field as the full reader gives it), and the file's pages it copied are unmapped again."""
import numpy as np
import pytest

from pipefill.model.gguf_file import GGUFFile
from pipefill.model.loader import WeightSource, resolve_model_path


def _resident_bytes_of(path: str) -> int:
    """Resident bytes of this process's mappings of the file at `path` (/proc/self/smaps):
    the file's own pages only, not the shared libraries a first call may page in beside them
    (RssFile counts those too: 33 MiB of them in the whole suite's process)."""
    import os
    target, total, inside = os.path.realpath(path), 0, False
    try:
        smaps = open("/proc/self/smaps")
    except OSError:
        pytest.skip("no /proc/self/smaps")
    with smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == target
            elif inside and fields[0] == "Rss:":
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
    a few MiB of it mapped, not the file; the pages read again give the same bytes."""
    path = resolve_model_path(None)
    f = GGUFFile(path, vocabulary=False)
    before = _resident_bytes_of(path)
    first = {}
    for name, t in f.tensors.items():
        if len(t.shape) == 2 and int(t.tensor_type) != 0:
            first[name] = f.blocks(name)
        else:
            first[name] = f.load(name).numpy()
    assert _resident_bytes_of(path) - before < 8 << 20
    again = f.blocks("token_embd.weight")
    assert np.array_equal(again, first["token_embd.weight"])
    assert np.array_equal(f.load("output_norm.weight").numpy(), first["output_norm.weight"])
