"""`tcp` KV transport: two-sided, plain sockets, no dependency. The sender gathers the chunk's
pages into a staging buffer and writes frames of FRAME_BYTES or more; the receiver reads each
run of consecutive destination pages straight into the KV tensors (recv_into, no copy).

Payload order: for each layer, K then V, and in each for every decode TP rank its pages in
request order, each with that rank's KV heads (transfer.StageTensors.gather); where the window
layers keep pages of their own, the global layers so, then the window layers over the window
pages the chunk names (KVChunk.window_pages; ARCHITECTURE.md, 'Window pages'). With a cluster
secret the channel follows the payload with its MAC, and the receiver checks it before the
chunk counts (channel.py)."""
from __future__ import annotations

import threading

import torch

from pipefill.disagg import messages as m
from pipefill.disagg.channel import Channel

FRAME_BYTES = 4 << 20


def runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(index in list, first page, count) of each run of consecutive page ids."""
    out: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if out and out[-1][1] + out[-1][2] == p:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, p, 1))
    return out


class TcpDataPath:
    name = "tcp"
    one_sided = False

    def __init__(self, kv):
        self.kv = kv  # a StageTensors
        self._local = threading.local()  # a staging buffer per sending thread

    def hello_fields(self) -> dict:
        return {}

    def payload_bytes(self, num_pages: int, num_layers: int,
                      head_map: list[list[int]] | None = None) -> int:
        """A chunk's bytes for a decode stage with head_map (None: this stage's own)."""
        per_page = sum(self.kv.rank_page_bytes(head_map or self.kv.head_map))
        return 2 * num_layers * num_pages * per_page

    def check_hello(self, hello: m.DecodeHello) -> str | None:
        return None  # the decode reads the bytes into its own pages itself

    def check_bootstrap(self, hello: m.DecodeHello, msg: m.RoomBootstrap,
                        layers: tuple[int, int]) -> str | None:
        if msg.staging_addr:
            return "a tcp decode has no staging region (staging_addr must be 0)"
        return None

    def send(self, conn: Channel, header: m.KVChunk, src_pages: list[int], dst_pages: list[int],
             hello: m.DecodeHello, head_map: list[list[int]],
             window_src: list[int] = (), window_dst: list[int] = ()) -> None:
        """window_src: the window pages of the pages the chunk's window_pages name (the
        window layers' part of the payload, after the global layers'); window_dst, where the
        decode puts them, is the decode's to know (it reads the payload itself)."""
        parts = [(self.kv, src_pages)]
        if window_src:
            parts.append((self.kv.window, window_src))
        frames = [self._frames(kv, pages, header, head_map) for kv, pages in parts]

        def payload(write) -> None:
            for frame in frames:
                frame(write)

        conn.send(header, payload if header.nbytes else None)

    def _frames(self, kv, src_pages: list[int], header: m.KVChunk, head_map):
        """Writes one part's pages (kv's layers of the chunk), a frame of blocks at a time."""
        idx = torch.tensor(src_pages, dtype=torch.long)
        blocks = [(which, layer) for layer in kv.layers_in(header.layer_start, header.layer_end)
                  for which in ("k", "v")]
        block_bytes = len(src_pages) * sum(kv.rank_page_bytes(head_map))
        per_frame = max(1, FRAME_BYTES // max(block_bytes, 1))

        def write_frames(write) -> None:
            staging = getattr(self._local, "staging", None)
            if staging is None or staging.numel() < per_frame * block_bytes:
                staging = self._local.staging = torch.empty(per_frame * block_bytes,
                                                            dtype=torch.uint8)
            for first in range(0, len(blocks), per_frame):
                group = blocks[first:first + per_frame]
                for i, (which, layer) in enumerate(group):
                    kv.gather(head_map, which, layer, idx,
                              staging[i * block_bytes:(i + 1) * block_bytes])
                write(memoryview(staging[:len(group) * block_bytes].numpy()))
        return write_frames

    def receive(self, conn: Channel, header: m.KVChunk, dst_pages: list[int],
                window_dst: list[int] = ()) -> None:
        """Reads the chunk's page bytes into its destination pages (and the window layers'
        into window_dst); raises (and the chunk does not count) when they fail their MAC."""
        if header.nbytes:
            parts = [(self.kv, dst_pages)]
            if window_dst:
                parts.append((self.kv.window, window_dst))
            conn.recv_payload(view for kv, pages in parts
                              for view in self._destinations(kv, header, pages))

    @staticmethod
    def _destinations(kv, header: m.KVChunk, dst_pages: list[int]):
        """The byte views of the destination pages, in payload order: each TP rank's own."""
        dst_runs = runs(dst_pages)
        for layer in kv.layers_in(header.layer_start, header.layer_end):
            for which in ("k", "v"):
                for rank in kv.ranks:
                    view, pb = rank.byte_view(getattr(rank, which), layer), rank.page_bytes
                    for _, first, count in dst_runs:
                        yield view[first * pb:(first + count) * pb]
