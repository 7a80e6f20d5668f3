"""What a ready stage process keeps resident: its weights, not the weight file's reader (the
default model's GGUF reader and its mapping of the file were ~220 MB of every stage's RSS)."""
from conftest import track
from pipefill import Engine
from pipefill.bench.memory import proc_status_bytes, stage_needs
from pipefill.model.loader import resolve_model_path


def mapped_files(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[5] for line in f if len(line.split()) > 5}


def test_ready_stages_hold_weights_but_not_the_weight_file():
    gguf = resolve_model_path(None)
    with track(Engine(None, dtype="float32", pp_size=2, max_model_len=2048)) as engine:
        pids = engine.stage_pids()
        assert len(pids) == 2
        needs = stage_needs(engine.args, engine.model_config, 1, engine.kv_capacity_tokens)
        for pid, need in zip(pids, needs):
            assert gguf not in mapped_files(pid)
            assert proc_status_bytes(pid, "VmRSS") > need["weights"]
        # The stages still serve after dropping the reader.
        prompt = engine.tokenizer.encode("The capital of France is")
        out = engine.generate([prompt], max_new_tokens=2, ignore_eos=True)[0]
        assert len(out.output_ids) == 2
