"""`mooncake` KV transport: Mooncake's transfer engine (PyPI mooncake-transfer-engine-non-cuda,
or the CUDA wheel on GPUs), TCP protocol, peer-to-peer handshake (metadata server
"P2PHANDSHAKE": no etcd). The decode registers its K and V tensors and publishes their addresses
in its DecodeHello; the prefill stage writes its pages one-sidedly into them, then sends the
KVChunk notice (nbytes 0) over the control connection: the notice arrives after the synchronous
writes completed. The hello also declares how many pages stand behind each pointer and where its
staging region lies: the prefill checks every room's pages and staging address against them,
and every write against them again, so a decode's messages cannot aim its writes anywhere
else.

Every write has a fixed cost (measured: a 48 KiB write reaches about half the GB/s of a 1 MiB
one), and real page ids are shuffled (free-list order), so a page-by-page copy is one write per
page per layer for K and for V. Two remedies:
- the sender gathers the chunk's pages into a registered buffer of its own (index_select), so
  only the destination's runs of consecutive pages count;
- a room whose destination pages are fragmented gets a staging region on the decode: the
  region of (room, prefill stage) holds, per request page, this stage's layers of K and V,
  laid out per chunk as [layer][K, V][page][page bytes]. The sender writes each chunk as one
  block at the chunk's offset, and the decode scatters it into its pages when the chunk's
  notice arrives (the write has completed by then). The region is allocated when the decode
  expects the room and freed exactly when the room's pages are (success, or a failure once no
  write into it can still happen: the same drop acknowledgements), so a late write of a dead
  room can never land in another room's region.

Where the window layers keep pages of their own (ARCHITECTURE.md, 'Window pages'), the decode
registers their tensors too and declares them apart (DecodeHello.window_k_ptrs, ...), the
staging region holds the other layers only, and the last chunk's window pages (a window or
two: few) are gathered and written straight into the decode's window pages before its notice.
"""
from __future__ import annotations

import bisect
import logging
import threading

import torch

from pipefill.disagg import messages as m
from pipefill.disagg.channel import Channel
from pipefill.disagg.heads import head_map_of, whole_source
from pipefill.disagg.transfer_tcp import runs

log = logging.getLogger(__name__)

MAX_BATCH = 512  # larger batches failed (-1) in measurements on this package version
WRITE_PIECE = 1 << 20  # a staged block goes as pieces of one batch (the engine spreads them)
GATHER_BYTES = 16 << 20  # the sender's gather buffer: whole layers, about this many bytes
MIN_RUN_PAGES = 4  # destination runs shorter than this on average: stage the room
STAGING_FRACTION = 0.25  # default staging arena: this share of the decode stage's KV bytes
ALIGN = 4096


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


ADDRESS_LIMIT = 1 << 64


def decode_rows(hello: m.DecodeHello, window: bool = False) -> list[int]:
    """The decode stage's layers behind each rank's k_ptrs/v_ptrs, in order (window: behind
    window_k_ptrs/window_v_ptrs): its window layers' pages are apart from the others'."""
    window_layers = set(hello.window_layers)
    return [layer for layer in range(hello.layer_start, hello.layer_end)
            if (layer in window_layers) == window]


def _targets(hello: m.DecodeHello, window: bool) -> tuple[list[int], list[int], dict, int]:
    """(K pointers, V pointers, each layer's row among them, rows a rank) of the decode's
    pages (window: of its window pages)."""
    rows = decode_rows(hello, window)
    k, v = (hello.window_k_ptrs, hello.window_v_ptrs) if window else (hello.k_ptrs, hello.v_ptrs)
    return k, v, {layer: i for i, layer in enumerate(rows)}, len(rows)


def declared_ranges(hello: m.DecodeHello, rank_bytes: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every buffer the decode declared for one-sided writes: each TP rank's
    K and V of each layer (kv_pages pages each of rank_bytes[rank] bytes; pointers rank after
    rank), of each window layer (window_kv_pages pages each) and its staging region."""
    out = []
    for window, pages in ((False, hello.kv_pages), (True, hello.window_kv_pages)):
        k, v, _, n = _targets(hello, window)
        out += [(p, p + pages * rank_bytes[i // max(n, 1)])
                for ptrs in (k, v) for i, p in enumerate(ptrs)]
    if hello.staging_bytes:
        out.append((hello.staging_base, hello.staging_base + hello.staging_bytes))
    return sorted(out)


def check_hello(hello: m.DecodeHello, rank_bytes: list[int]) -> str | None:
    """Why a decode's Mooncake buffers cannot be written (a sentence), or None. rank_bytes:
    a page of one layer of K on each of its TP ranks."""
    if not hello.mooncake_session:
        return ("the decode did not publish a Mooncake session (is it running "
                "--disaggregation-transfer-backend mooncake?)")
    n, nw = len(decode_rows(hello)), len(decode_rows(hello, True))
    want, want_window = n * len(rank_bytes), nw * len(rank_bytes)
    if n + nw < 1 or len(hello.k_ptrs) != want or len(hello.v_ptrs) != want:
        return (f"the decode declared {len(hello.k_ptrs)} K and {len(hello.v_ptrs)} V buffers "
                f"for its {n} layers on {len(rank_bytes)} TP ranks")
    if len(hello.window_k_ptrs) != want_window or len(hello.window_v_ptrs) != want_window:
        return (f"the decode declared {len(hello.window_k_ptrs)} K and "
                f"{len(hello.window_v_ptrs)} V window buffers for its {nw} window layers on "
                f"{len(rank_bytes)} TP ranks")
    if hello.kv_pages < 1 or hello.staging_bytes < 0 or (nw and hello.window_kv_pages < 1):
        return "the decode declared no KV pages (or a negative staging region)"
    ranges = declared_ranges(hello, rank_bytes)
    if any(start <= 0 or end > ADDRESS_LIMIT for start, end in ranges):
        return "the decode declared a buffer outside the address space"
    if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
        return "the decode declared overlapping buffers"
    return None


def check_bootstrap(hello: m.DecodeHello, msg: m.RoomBootstrap, layers: tuple[int, int],
                    rank_bytes: list[int]) -> str | None:
    """Why a room's destination cannot be written (a sentence), or None: its pages (and
    window pages) must be among the decode's declared ones, its staging region inside the
    declared one, sized for the room's pages of this stage's `layers` (the layers the two
    stages share; not the window layers) on every decode TP rank."""
    if msg.dst_pages and max(msg.dst_pages) >= hello.kv_pages:
        return (f"room {msg.room} names page {max(msg.dst_pages)}; the decode declared "
                f"{hello.kv_pages} pages")
    if msg.dst_window_pages and max(msg.dst_window_pages) >= hello.window_kv_pages:
        return (f"room {msg.room} names window page {max(msg.dst_window_pages)}; the decode "
                f"declared {hello.window_kv_pages} window pages")
    if msg.staging_addr:
        num_layers = len([i for i in decode_rows(hello) if layers[0] <= i < layers[1]])
        size = len(msg.dst_pages) * 2 * num_layers * sum(rank_bytes)
        base = hello.staging_base
        if not base <= msg.staging_addr <= msg.staging_addr + size <= base + hello.staging_bytes:
            return (f"room {msg.room}'s staging region ({size} bytes at {msg.staging_addr:#x}) "
                    "is not inside the one the decode declared")
    return None


def _layer_ptrs(kv, which: str) -> list[int]:
    """The base address of K or V of each of kv's layers, rank after rank."""
    return [getattr(r, which)[i].data_ptr() for r in kv.ranks for i in range(kv.num_layers)]


class Bounds:
    """Sorted, disjoint byte ranges: where one-sided writes may land."""

    def __init__(self, ranges: list[tuple[int, int]]):
        self.starts = [a for a, _ in ranges]
        self.ends = [b for _, b in ranges]

    def contains(self, addr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self.starts, addr) - 1
        return i >= 0 and nbytes >= 0 and addr + nbytes <= self.ends[i]


def check_writes(hello: m.DecodeHello, rank_bytes: list[int],
                 writes: list[tuple[int, int, int]]) -> None:
    """Raises TransferFailed unless every (src, dst, nbytes) lands inside a buffer the decode
    declared: the last guard before bytes leave for another machine's memory."""
    bounds = Bounds(declared_ranges(hello, rank_bytes))
    for _, dst, nbytes in writes:
        if not bounds.contains(dst, nbytes):
            raise TransferFailed(f"a {nbytes}-byte write at {dst:#x} falls outside the buffers "
                                 f"the decode at {hello.mooncake_session} declared")


def _sync(t: torch.Tensor) -> None:
    """On a GPU, copies are queued: wait for them before the engine reads or reuses bytes."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def fragmented(pages: list[int]) -> bool:
    """True when writing straight into these pages would take many small writes."""
    return len(pages) > 1 and len(runs(pages)) * MIN_RUN_PAGES > len(pages)


class Arena:
    """First-fit allocator of byte ranges of the staging buffer (offsets, ALIGN-aligned)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []
        self.used: dict[int, int] = {}  # offset -> size

    def alloc(self, nbytes: int) -> int | None:
        size = -(-nbytes // ALIGN) * ALIGN
        for i, (off, n) in enumerate(self.free):
            if n >= size:
                self.free[i:i + 1] = [(off + size, n - size)] if n > size else []
                self.used[off] = size
                return off
        return None

    def release(self, off: int) -> None:
        size = self.used.pop(off)  # a KeyError here is a double free: a bug, never silent
        self.free.append((off, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self.free = merged


class MooncakeDataPath:
    name = "mooncake"
    one_sided = True

    def __init__(self, kv, host: str = "127.0.0.1", staging_bytes: int | None = None):
        self.kv = kv  # a StageTensors: every TP rank's K and V is registered
        self.engine = _engine(host)
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        for part in (kv, kv.window):  # a windowed cache's window layers are written too
            for rank in part.ranks if part is not None else ():
                for t in (rank.k, rank.v):
                    if t.numel():  # a stage without window (or other) layers: none to write
                        self._register(t)
        if staging_bytes is None:
            kv_bytes = sum(2 * r.k.numel() * r.k.element_size() for r in kv.ranks)
            staging_bytes = int(kv_bytes * STAGING_FRACTION)
        self.staging_bytes = staging_bytes
        self._staging: torch.Tensor | None = None  # registered on first use (decode only)
        self._arena = Arena(staging_bytes)
        self._regions: dict[tuple[int, int], tuple[int, int]] = {}  # (room, layer) -> nonce, off
        self._lock = threading.Lock()
        self._local = threading.local()  # a gather buffer per sending thread
        self.num_staged_chunks = 0

    def _register(self, t: torch.Tensor) -> None:
        if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
            raise RuntimeError("Mooncake could not register the KV cache memory")

    def hello_fields(self) -> dict:
        """Decode side: every buffer a prefill may write, with its size."""
        kv, window = self.kv, self.kv.window
        staging = self._staging_buffer()
        fields = {"mooncake_session": self.session,
                  "k_ptrs": _layer_ptrs(kv, "k"), "v_ptrs": _layer_ptrs(kv, "v"),
                  "kv_pages": kv.num_pages,
                  "staging_base": staging.data_ptr() if staging is not None else 0,
                  "staging_bytes": self.staging_bytes if staging is not None else 0}
        if window is not None:
            fields.update(window_k_ptrs=_layer_ptrs(window, "k"),
                          window_v_ptrs=_layer_ptrs(window, "v"),
                          window_kv_pages=window.num_pages)
        return fields

    def payload_bytes(self, num_pages: int, num_layers: int, head_map=None) -> int:
        return 0

    def _rank_bytes(self, hello: m.DecodeHello) -> list[int]:
        return self.kv.rank_page_bytes(head_map_of(hello.kv_heads, self.kv.num_kv_heads))

    def check_hello(self, hello: m.DecodeHello) -> str | None:
        return check_hello(hello, self._rank_bytes(hello))

    def check_bootstrap(self, hello: m.DecodeHello, msg: m.RoomBootstrap,
                        layers: tuple[int, int]) -> str | None:
        return check_bootstrap(hello, msg, layers, self._rank_bytes(hello))

    def _staging_buffer(self) -> torch.Tensor | None:
        """The decode's staging region, allocated and registered once (None: staging off)."""
        with self._lock:
            if self._staging is None and self.staging_bytes > 0:
                self._staging = torch.empty(self.staging_bytes, dtype=torch.uint8,
                                            device=self.kv.k.device)
                self._register(self._staging)
            return self._staging

    # ---- decode side: staging regions
    def plan_room(self, room: int, nonce: int, stages: dict[str, tuple[int, int]],
                  dst_pages: list[int]) -> dict[str, int]:
        """Staging addresses by prefill stage for a room about to be expected ({} when its
        pages are not fragmented or the arena is full: then the sender writes into them)."""
        if not fragmented(dst_pages):
            return {}
        pb, out = sum(r.page_bytes for r in self.kv.ranks), {}
        staging = self._staging_buffer()
        with self._lock:
            for stage, (ls, le) in stages.items():
                num_layers = len(self.kv.layers_in(ls, le))  # not the window layers
                if not num_layers:
                    continue
                off = self._arena.alloc(len(dst_pages) * 2 * num_layers * pb)
                if off is None:  # rare: fall back to direct writes for this stage
                    log.debug("room %d: staging arena full, direct writes", room)
                    continue
                self._regions[(room, ls)] = (nonce, off)
                out[stage] = staging.data_ptr() + off
        return out

    def end_room(self, room: int) -> None:
        """Frees the room's staging regions (its pages were released or handed over)."""
        with self._lock:
            for key in [key for key in self._regions if key[0] == room]:
                self._arena.release(self._regions.pop(key)[1])

    def staging_in_use(self) -> int:
        with self._lock:
            return len(self._regions)

    # ---- prefill side
    def send(self, conn: Channel, header: m.KVChunk, src_pages: list[int], dst_pages: list[int],
             hello: m.DecodeHello, head_map: list[list[int]], staging_addr: int = 0,
             window_src: list[int] = (), window_dst: list[int] = ()) -> None:
        """head_map: the decode stage's TP ranks' KV heads; each rank gets exactly its own.
        window_src, window_dst: the last chunk's window pages here and on the decode (the
        window layers' part, written before the notice; module doc)."""
        if not hello.mooncake_session:
            raise TransferFailed("the decode did not publish a Mooncake session (is it running "
                                 "--disaggregation-transfer-backend mooncake?)")
        sources = [whole_source(self.kv.head_map, hs) for hs in head_map]
        if staging_addr:
            self._send_staged(header, src_pages, hello, head_map, staging_addr)
        elif None in sources or len(pair_runs(src_pages, dst_pages)) > len(runs(dst_pages)):
            self._send_gathered(self.kv, header, src_pages, dst_pages, hello, head_map)
        else:
            self._send_direct(header, src_pages, dst_pages, hello, sources)
        if window_src:
            self._send_gathered(self.kv.window, header, list(window_src), list(window_dst),
                                hello, head_map, window=True)
        conn.send(header)

    def _send_direct(self, header, src_pages, dst_pages, hello, sources) -> None:
        """Runs consecutive on both sides, straight from the KV tensors: each decode rank's
        from the prefill rank with exactly its heads (sources)."""
        pairs = pair_runs(src_pages, dst_pages)
        k_ptrs, v_ptrs, row, n = _targets(hello, False)
        writes, rank_bytes = [], [self.kv.ranks[s].page_bytes for s in sources]
        for layer in self.kv.layers_in(header.layer_start, header.layer_end):
            for which, ptrs in (("k", k_ptrs), ("v", v_ptrs)):
                for r, src in enumerate(sources):
                    rank, pb = self.kv.ranks[src], rank_bytes[r]
                    base = rank.local(getattr(rank, which), layer).data_ptr()
                    dbase = ptrs[r * n + row[layer]]
                    writes += [(base + s * pb, dbase + d * pb, count * pb)
                               for s, d, count in pairs]
        self._write(hello, writes, rank_bytes)

    def _send_gathered(self, kv, header, src_pages, dst_pages, hello, head_map,
                       window: bool = False) -> None:
        """Source pages of `kv` (this stage's, or its window layers') gathered (and cut to
        each decode rank's heads) layer group by layer group; one write per destination run
        and rank, into the decode's pages (window: its window pages)."""
        n, dst_runs = len(src_pages), runs(dst_pages)
        rank_bytes = kv.rank_page_bytes(head_map)
        k_ptrs, v_ptrs, row, nl = _targets(hello, window)
        per_page = sum(rank_bytes)
        for _, layers, buf in self._gather(kv, header, src_pages, head_map):
            writes, base = [], buf.data_ptr()
            for i, layer in enumerate(layers):
                for j, ptrs in enumerate((k_ptrs, v_ptrs)):
                    block = base + (2 * i + j) * n * per_page
                    for r, pb in enumerate(rank_bytes):
                        dbase = ptrs[r * nl + row[layer]]
                        writes += [(block + at * pb, dbase + first * pb, count * pb)
                                   for at, first, count in dst_runs]
                        block += n * pb
            self._write(hello, writes, rank_bytes)

    def _send_staged(self, header, src_pages, hello, head_map, staging_addr: int) -> None:
        """The chunk as one block (per layer group) at its offset in the room's region."""
        rank_bytes = self.kv.rank_page_bytes(head_map)
        n, pb = len(src_pages), sum(rank_bytes)
        num_layers = len(self.kv.layers_in(header.layer_start, header.layer_end))
        at = staging_addr + header.page_offset * 2 * num_layers * pb
        for first, layers, buf in self._gather(self.kv, header, src_pages, head_map):
            nbytes = 2 * len(layers) * n * pb
            block = at + first * 2 * n * pb
            self._write(hello, [(buf.data_ptr() + o, block + o, min(WRITE_PIECE, nbytes - o))
                                for o in range(0, nbytes, WRITE_PIECE)], rank_bytes)
        self.num_staged_chunks += 1

    def _gather(self, kv, header, src_pages, head_map):
        """Yields (index of the group's first layer among kv's layers of the chunk, the
        group's layers, a buffer holding [layer][K, V][decode rank][page] of them), each
        decode rank's pages with its heads."""
        n, chunk_layers = len(src_pages), kv.layers_in(header.layer_start, header.layer_end)
        if n == 0 or not chunk_layers:
            return
        idx = torch.tensor(src_pages, dtype=torch.long, device=kv.k.device)
        block_bytes = n * sum(kv.rank_page_bytes(head_map))
        layer_bytes = 2 * block_bytes
        per_group = max(1, GATHER_BYTES // layer_bytes)
        buf = self._gather_buffer(min(per_group, len(chunk_layers)) * layer_bytes)
        for first in range(0, len(chunk_layers), per_group):
            layers = chunk_layers[first:first + per_group]
            for i, layer in enumerate(layers):
                for j, which in enumerate(("k", "v")):
                    at = (2 * i + j) * block_bytes
                    kv.gather(head_map, which, layer, idx, buf[at:at + block_bytes])
            _sync(buf)
            yield first, layers, buf

    def _gather_buffer(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self.engine.unregister_memory(buf.data_ptr())
            buf = self._local.buf = torch.empty(nbytes, dtype=torch.uint8,
                                                device=self.kv.k.device)
            self._register(buf)
        return buf

    def _write(self, hello: m.DecodeHello, writes: list[tuple[int, int, int]],
               rank_bytes: list[int]) -> None:
        check_writes(hello, rank_bytes, writes)
        for i in range(0, len(writes), MAX_BATCH):
            part = writes[i:i + MAX_BATCH]
            ret = self.engine.batch_transfer_sync_write(
                hello.mooncake_session, [w[0] for w in part], [w[1] for w in part],
                [w[2] for w in part])
            if ret < 0:
                raise TransferFailed(f"Mooncake write to {hello.mooncake_session} failed "
                                     f"(code {ret})")

    # ---- decode side: the notice of a completed write
    def receive(self, conn: Channel, header: m.KVChunk, dst_pages: list[int],
                window_dst: list[int] = ()) -> None:
        """Direct writes (the window pages' among them) are already in place; a staged chunk
        is scattered into its pages, each TP rank's into its own."""
        with self._lock:
            region = self._regions.get((header.room, header.layer_start))
        if region is None or region[0] != header.nonce or not dst_pages:
            return
        kv, n = self.kv, len(dst_pages)
        layers = kv.layers_in(header.layer_start, header.layer_end)  # not the window layers
        block_bytes = n * sum(r.page_bytes for r in kv.ranks)
        start = region[1] + header.page_offset * 2 * len(layers) * (block_bytes // n)
        block = self._staging[start:start + 2 * len(layers) * block_bytes]
        idx = torch.tensor(dst_pages, dtype=torch.long, device=kv.k.device)
        for i, layer in enumerate(layers):
            for j, which in enumerate(("k", "v")):
                at = (2 * i + j) * block_bytes
                kv.scatter(which, layer, idx, block[at:at + block_bytes])
        _sync(block)  # the region may be written again as soon as the room ends
