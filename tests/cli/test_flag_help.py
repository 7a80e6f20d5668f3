"""Help texts say what the code does: `pipefill serve --help` for the flags whose behaviour
was misdescribed, and the start-up warning of the never-run CUDA path."""
from __future__ import annotations

import contextlib
import logging
import re

import pytest
import torch
from conftest import save_tiny_model

from pipefill.cli.main import main
from pipefill.config import ServerArgs
from pipefill.frontend import prepare


def flag_help(capsys, flag: str) -> str:
    """The help paragraph of one flag, on one line (argparse starts each at column 2)."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    for entry in re.split(r"\n  (?=-)", capsys.readouterr().out):
        if entry.startswith(f"{flag} ") or entry.startswith(f"{flag}\n"):
            return re.sub(r"\s+", " ", entry)
    raise AssertionError(f"{flag} is not in `pipefill serve --help`")


def test_device_help_says_cuda_never_ran(capsys):
    assert "never run on a GPU" in flag_help(capsys, "--device")


def test_tp_size_help_says_its_nccl_path_is_untested(capsys):
    text = flag_help(capsys, "--tp-size")
    assert "over NCCL: written but UNTESTED, it has never run on a GPU" in text
    assert "NCCL/CUDA is not done" not in text


def test_disaggregation_mode_help_allows_decode_pipelines(capsys):
    text = flag_help(capsys, "--disaggregation-mode")
    assert "--pp-size 1" not in text and "Either role may run a pipeline" in text


def test_chunked_prefill_size_help_names_the_paths_that_pad(capsys):
    text = flag_help(capsys, "--chunked-prefill-size")
    assert "oneDNN" in text and "bfloat16" in text
    assert "float32 and float16 on the torch path (MKL) and CUDA are not padded" in text


def test_storage_cap_flag_is_documented(capsys):
    assert "least recently read pages are removed" in flag_help(capsys,
                                                                "--hicache-storage-max-gb")


def test_cuda_start_warns_that_it_never_ran(tmp_path, caplog):
    model = save_tiny_model("llama", tmp_path)
    # Without a GPU the start is refused after the warning (Layout.check_gpus).
    no_gpu = (pytest.raises(ValueError, match=r"but 0 GPU\(s\) are visible")
              if torch.cuda.device_count() == 0 else contextlib.nullcontext())
    with caplog.at_level(logging.WARNING, logger="pipefill.frontend"), no_gpu:
        prepare(ServerArgs(model_path=model, device="cuda"))
    assert any("has never run on a GPU" in r.getMessage() and "TP ranks" in r.getMessage()
               and r.levelno == logging.WARNING for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipefill.frontend"):
        prepare(ServerArgs(model_path=model))
    assert not caplog.records
