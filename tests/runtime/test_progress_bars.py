"""Engine.generate shows a bar per long prompt while it prefills (tokens done of all), from
stage 0's load reports, and none for a prompt that fits in one chunk."""
import time

from conftest import track
from pipefill import Engine
from pipefill.runtime.loop import LOAD_REPORT_S

LONG = [3 + i % 500 for i in range(1000)]


def test_a_long_prompt_gets_a_bar(tiny_models, capsys):
    with track(Engine(tiny_models["llama"], dtype="float32", page_size=8,
                      chunked_prefill_size=8, max_model_len=1024,
                      threads_per_stage=1)) as engine:
        engine.generate([LONG[:6]], max_new_tokens=1, show_progress=True)
        assert "prefill req-" not in capsys.readouterr().err
        # Stage 0 reports its load at most every LOAD_REPORT_S; past that, the report closing
        # the loop turn that admits the long prompt carries its progress.
        time.sleep(LOAD_REPORT_S + 0.1)
        engine.generate([LONG], max_new_tokens=1, show_progress=True)
        err = capsys.readouterr().err
    assert "prefill req-1" in err and "/1.00k" in err
