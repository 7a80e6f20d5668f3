"""The Python Engine as a PD role (ARCHITECTURE.md, 'Prefill/decode disaggregation'): a prefill
Engine and a decode Engine in this process, each with its own stage processes, pair through the
prefill's bootstrap service (the front-end core's) with one cluster secret. generate() runs on
both at once, one thread each, with the same rooms: the decode's greedy tokens are HF's; a
prompt the prefill refuses ends the decode's generate() with the prefill's sentence at once."""
from __future__ import annotations

import random
import threading
import time

import pytest

from pipefill import Engine, PDInfo
from pipefill.base.platform import free_port
from pipefill.disagg.launch import write_secret_file

from conftest import assert_pages_free, hf_reference, save_tiny_model, track, wait_until

PAGE = 16
PREFILL_MAX_LEN = 128  # the decode takes longer prompts: the prefill alone refuses them
WAITING_TIMEOUT_S = 120  # a decode that waited for a refused room would take this long
COMMON = dict(dtype="float32", page_size=PAGE, threads_per_stage=1, chunked_prefill_size=64,
              max_total_tokens=4096, disaggregation_waiting_timeout=WAITING_TIMEOUT_S)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(model path, bootstrap port, prefill Engine, decode Engine)."""
    model = save_tiny_model("llama", tmp_path_factory.mktemp("pd-engine"))
    secret = write_secret_file(str(tmp_path_factory.mktemp("pd-secret")))
    port = free_port()
    prefill = track(Engine(model, disaggregation_mode="prefill", max_model_len=PREFILL_MAX_LEN,
                           disaggregation_bootstrap_port=port, cluster_secret_file=secret,
                           **COMMON))
    try:
        decode = track(Engine(model, disaggregation_mode="decode", max_model_len=1024,
                              cluster_secret_file=secret, **COMMON))
    except BaseException:
        prefill.shutdown()
        raise
    yield model, port, prefill, decode
    decode.shutdown()
    prefill.shutdown()


def both(prefill_call, decode_call):
    """Runs the decode's call on a thread while the prefill's runs here: (prefill's result or
    exception, decode's result or exception, seconds the decode's call took)."""
    got = {}

    def run_decode():
        t0 = time.monotonic()
        try:
            got["decode"] = decode_call()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            got["decode"] = e
        got["decode_s"] = time.monotonic() - t0

    thread = threading.Thread(target=run_decode)
    thread.start()
    try:
        got["prefill"] = prefill_call()
    except Exception as e:  # noqa: BLE001 - the test looks at it
        got["prefill"] = e
    thread.join(WAITING_TIMEOUT_S + 30)
    assert not thread.is_alive(), "the decode's generate() never returned"
    return got["prefill"], got["decode"], got["decode_s"]


def pages_free(*engines) -> bool:
    try:
        for e in engines:
            assert_pages_free(e)
    except AssertionError:
        return False
    return True


def test_decode_engine_continues_the_prefill_engines_prompts_as_hf(pair):
    model, port, prefill, decode = pair
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (40, 90)]  # 90: two chunks
    rooms = [PDInfo(101, "127.0.0.1", port), PDInfo(102, "127.0.0.1", port)]
    first, outs, _ = both(lambda: prefill.generate(prompts, max_new_tokens=8, pd=rooms),
                          lambda: decode.generate(prompts, max_new_tokens=8, pd=rooms))
    assert not isinstance(first, Exception), first
    assert not isinstance(outs, Exception), outs
    for prompt, f, out in zip(prompts, first, outs):
        _, want = hf_reference(model, prompt, 8)
        assert f.output_ids == want[:1]  # the prefill computes the first token only
        assert out.output_ids == want
    assert wait_until(lambda: pages_free(prefill, decode))


def test_a_prompt_the_prefill_refuses_ends_the_decodes_call_with_its_sentence(pair):
    """150 tokens fit the decode's --max-model-len but not the prefill's: the prefill's
    generate() refuses it at the door and tells the room's decode, whose generate() raises the
    same sentence long before its waiting timeout (the bound is a hang guard, not a speed
    threshold); nothing is left held, and the next room is served."""
    _, port, prefill, decode = pair
    prompt = [7] * 150
    room = PDInfo(201, "127.0.0.1", port)
    refused, failed, took = both(lambda: prefill.generate([prompt], max_new_tokens=8, pd=room),
                                 lambda: decode.generate([prompt], max_new_tokens=8, pd=room))
    sentence = f"= 158 exceeds --max-model-len ({PREFILL_MAX_LEN})"
    assert isinstance(refused, ValueError) and sentence in str(refused), refused
    assert isinstance(failed, ValueError), failed
    assert "refused this request" in str(failed) and sentence in str(failed), failed
    assert took < WAITING_TIMEOUT_S / 2, f"the decode waited {took:.0f} s for a refused room"
    assert wait_until(lambda: pages_free(prefill, decode))
    room = PDInfo(202, "127.0.0.1", port)
    first, outs, _ = both(lambda: prefill.generate([[3, 4, 5]], max_new_tokens=2, pd=room),
                          lambda: decode.generate([[3, 4, 5]], max_new_tokens=2, pd=room))
    assert len(first[0].output_ids) == 1 and len(outs[0].output_ids) == 2
    assert outs[0].output_ids[0] == first[0].output_ids[0]
    assert wait_until(lambda: pages_free(prefill, decode))


def test_the_roles_refuse_what_they_cannot_serve_with_a_sentence(pair):
    _, port, prefill, decode = pair
    with pytest.raises(ValueError, match="this is the decode of a PD pair"):
        decode.generate([[1, 2, 3]])
    with pytest.raises(ValueError, match="this is the prefill of a PD pair"):
        prefill.generate([[1, 2, 3]])
    with pytest.raises(ValueError, match="one PDInfo per prompt"):
        decode.generate([[1, 2], [3, 4]], pd=PDInfo(1, "127.0.0.1", port))
    with pytest.raises(ValueError, match="a bootstrap_room of its own"):
        decode.generate([[1, 2], [3, 4]], pd=[PDInfo(1, "127.0.0.1", port)] * 2)
    with pytest.raises(ValueError, match="bootstrap_room must be an integer"):
        decode.generate([[1, 2]], pd=PDInfo(-1, "127.0.0.1", port))
    with pytest.raises(ValueError, match="bootstrap_port"):
        decode.generate([[1, 2]], pd=PDInfo(1, "127.0.0.1", 0))
    with pytest.raises(ValueError, match="prompt logprobs .* not served by a PD pair"):
        decode.generate([[1, 2]], return_prompt_logprobs=True,
                        pd=PDInfo(1, "127.0.0.1", port))
