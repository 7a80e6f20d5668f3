"""`mooncake` KV transport: Mooncake's transfer engine (PyPI mooncake-transfer-engine-non-cuda,
or the CUDA wheel on GPUs), TCP protocol, peer-to-peer handshake (metadata server
"P2PHANDSHAKE": no etcd). The decode registers its K and V tensors and publishes their addresses
in its DecodeHello; the prefill stage writes its pages one-sidedly into them, runs of pages
consecutive on both sides merged into one write, then sends the KVChunk notice (nbytes 0) over
the control connection: the notice arrives after the synchronous writes completed."""
from __future__ import annotations

import logging

from pipefill.disagg import messages as m
from pipefill.disagg.channel import Channel

log = logging.getLogger(__name__)

MAX_BATCH = 512  # larger batches failed (-1) in measurements on this package version


class TransferFailed(RuntimeError):
    pass


def _engine(host: str):
    try:
        from mooncake.engine import TransferEngine
    except ImportError:
        raise RuntimeError("--disaggregation-transfer-backend mooncake needs Mooncake's transfer "
                           "engine: pip install 'pipefill[mooncake]' (the package "
                           "mooncake-transfer-engine-non-cuda)") from None
    engine = TransferEngine()
    ret = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if ret != 0:
        raise RuntimeError(f"Mooncake's transfer engine did not start on {host} (code {ret})")
    return engine


def pair_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src page, dst page, count) runs consecutive on both sides."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


class MooncakeDataPath:
    name = "mooncake"
    one_sided = True

    def __init__(self, kv, host: str = "127.0.0.1"):
        self.kv = kv
        self.engine = _engine(host)
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        for t in (kv.k, kv.v):
            if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
                raise RuntimeError("Mooncake could not register the KV cache memory")

    def hello_fields(self) -> dict:
        kv = self.kv
        return {"mooncake_session": self.session,
                "k_ptrs": [kv.k[i].data_ptr() for i in range(kv.num_layers)],
                "v_ptrs": [kv.v[i].data_ptr() for i in range(kv.num_layers)]}

    def payload_bytes(self, num_pages: int, num_layers: int) -> int:
        return 0

    def send(self, conn: Channel, header: m.KVChunk, src_pages: list[int], dst_pages: list[int],
             hello: m.DecodeHello) -> None:
        if not hello.mooncake_session:
            raise TransferFailed("the decode did not publish a Mooncake session (is it running "
                                 "--disaggregation-transfer-backend mooncake?)")
        kv, pb = self.kv, self.kv.page_bytes
        srcs, dsts, lens = [], [], []
        pairs = pair_runs(src_pages, dst_pages)
        for layer in range(header.layer_start, header.layer_end):
            local_dst = layer - hello.layer_start
            for t, ptrs in ((kv.k, hello.k_ptrs), (kv.v, hello.v_ptrs)):
                base = kv.local(t, layer).data_ptr()
                for s, d, count in pairs:
                    srcs.append(base + s * pb)
                    dsts.append(ptrs[local_dst] + d * pb)
                    lens.append(count * pb)
        for i in range(0, len(srcs), MAX_BATCH):
            ret = self.engine.batch_transfer_sync_write(
                hello.mooncake_session, srcs[i:i + MAX_BATCH], dsts[i:i + MAX_BATCH],
                lens[i:i + MAX_BATCH])
            if ret < 0:
                raise TransferFailed(f"Mooncake write to {hello.mooncake_session} failed "
                                     f"(code {ret})")
        conn.send(header)

    def receive(self, conn: Channel, header: m.KVChunk, dst_pages: list[int]) -> None:
        pass  # the bytes are already in place: the notice follows the writes
