"""Fused causal chunk attention on Intel AMX (bf16), over a paged KV cache packed for AMX.

API (what the engine calls):

* ``amx_available(force_disable=False) -> (ok, reason)`` — never raises. Checks the CPU flags,
  builds/loads the extension, verifies the CPU again with cpuid and requests the AMX tile
  permission (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, verified with
  ``ARCH_GET_XCOMP_PERM``). ``force_disable=True`` (or ``FORCE_DISABLE = True`` on this module)
  returns ``(False, reason)`` without touching anything.
* ``AmxKVCache(num_layers, num_pages, page_size, num_kv_heads, head_dim)`` — ``.k`` / ``.v`` are
  ``torch.empty`` bf16 ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]`` (untouched
  pages stay non-resident); ``cache.layer(i)`` gives ``(k[i], v[i])``. The bytes are in AMX tile
  order, not token-major: use ``read_kv`` to get tokens back.
* ``write_kv(k_layer_cache, v_layer_cache, k_new, v_new, page_table, start)`` — packs tokens
  ``[start, start + C)`` and zeroes the rest of their last 32-token group (so writes of one
  sequence must go in position order, as chunked prefill and decode do).
* ``chunk_attention(q, k_layer_cache, v_layer_cache, page_table, prefix_len, scale,
  k_new=None, v_new=None, out=None) -> out`` — bottom-right causal attention of ``q`` [C, Hq, D]
  (positions ``[L, L + C)``) over cached tokens ``[0, L + C)``. If ``k_new``/``v_new`` are given
  they are first written with ``write_kv(..., start=prefix_len)``; otherwise they must already
  be in the cache.

Constraints: bf16 only; head_dim 64 or 128; page_size a multiple of 32; Hq a multiple of Hkv.

Build: ``csrc/amx_kernel.cpp`` (the only code compiled with -mamx-*/-mavx512*) is compiled to an
object file with the C++ compiler directly; ``csrc/amx_ext.cpp`` (checks, packing, the work split
over torch's OpenMP pool via ``at::parallel_for``) is compiled without ISA flags by
``torch.utils.cpp_extension.load`` and linked with that object. The cache lives in
``~/.cache/pipefill/kernels``; the first build takes ~25-35 s on two
cores (later processes load the cached library in well under a second); the glue is compiled
with -fopenmp so at::parallel_for runs on torch's own OpenMP pool (same libgomp, by soname).
``load`` needs ``ninja`` on PATH: the loader prepends the running interpreter's bin directory
(the venv's, where ``pip install ninja`` puts it) to ``os.environ["PATH"]``. A build failure
makes ``amx_available()`` return ``(False, reason)``.

Work split: one task per torch thread (``at::parallel_for``); tasks pull work items
(kv head, q-tile of ~192 / G tokens) longest-first from an atomic counter.
"""
from __future__ import annotations

import logging
import math
import platform
import sys
import time

import torch

from pipefill.kernels.build import CSRC, GLUE_HEADER, LazyExtension
from pipefill.kernels.build import build_dir as kernel_build_dir
from pipefill.kernels.build import compile_object, link_glue, require_ninja
from pipefill.base.platform import cpu_flags

log = logging.getLogger("pipefill.kernels")

FORCE_DISABLE = False  # module-level kill switch (tests, debugging)

_KERNEL_SRC = CSRC / "amx_kernel.cpp"
_GLUE_SRC = CSRC / "amx_ext.cpp"
_HEADER = CSRC / "amx_kernel.h"
AMX_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw",
             "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fno-exceptions"]
REQUIRED_CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                      "avx512_bf16", "fma")
EXPECTED_BUILD_S = 30

_status: tuple[bool, str] | None = None


def _build():
    require_ninja("the AMX attention kernel")
    build_dir = kernel_build_dir("amx_attention")
    name = "pipefill_amx_attention"
    fresh = not any(build_dir.glob(f"glue-*/{name}*.so"))
    if fresh or not any(build_dir.glob("amx_kernel-*.o")):
        msg = f"building pipefill AMX attention kernel (first use, ~{EXPECTED_BUILD_S} s) in {build_dir}"
        log.info(msg)
        print(msg, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    obj = compile_object(_KERNEL_SRC, _HEADER, AMX_FLAGS, build_dir, "amx_kernel")
    mod = link_glue(name, _GLUE_SRC, [GLUE_HEADER, _HEADER], [str(obj)], build_dir)
    dt = time.perf_counter() - t0
    if dt > 2:
        log.info("pipefill AMX attention kernel ready after %.0f s", dt)
    return mod


_extension = LazyExtension("AMX attention extension", _build)


def _load():
    """The extension module; raises RuntimeError with the reason if it cannot be built."""
    return _extension.load()


def amx_available(force_disable: bool = False) -> tuple[bool, str]:
    """(True, "ok") when the AMX kernel can run in this process, else (False, why). Never raises."""
    global _status
    if force_disable or FORCE_DISABLE:
        return False, "AMX attention disabled by caller (force_disable)"
    if _status is not None:
        return _status
    try:
        _status = _check()
    except Exception as e:  # noqa: BLE001
        _status = (False, f"unexpected error: {type(e).__name__}: {e}")
    return _status


def _check() -> tuple[bool, str]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"needs Linux x86-64, this is {platform.system()} {platform.machine()}"
    flags = cpu_flags()
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in flags]
    if missing:
        return False, "CPU lacks " + ", ".join(missing)
    try:
        ext = _load()
    except RuntimeError as e:
        return False, str(e)
    ok, why = ext.cpu_supported()
    if not ok:
        return False, f"cpuid: {why}"
    ok, why = ext.amx_permission()
    if not ok:
        return False, why
    return True, "ok"


def _require():
    ok, why = amx_available()
    if not ok:
        raise RuntimeError(f"AMX attention unavailable: {why}")
    return _extension.module


class AmxKVCache:
    """Per-stage K/V cache in the kernel's packed layout.

    ``k``/``v``: bf16 [num_layers, num_pages, num_kv_heads, page_size, head_dim], allocated with
    torch.empty (pages become resident only when written). Within one (page, kv head) the
    page_size * head_dim values are in AMX tile order (see csrc/amx_kernel.cpp).
    """
    window = None  # one cache for every layer (kv.cache.WindowedPackedCache splits them)

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.bfloat16, empty=torch.empty):
        check_geometry(page_size, head_dim, dtype)
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.k = empty(shape, dtype=dtype)  # empty: torch.empty or kv/shared.SharedEmpty
        self.v = empty(shape, dtype=dtype)
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def page_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [num_layers, num_pages, *page] (already so): the host tier copies
        whole pages in the packed layout."""
        return self.k, self.v

    def per_layer(self):
        """(K, V) indexable by the stage's layer, as KVCache.per_layer."""
        return self.k, self.v

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """[2, num_layers, len(pages), page_size, num_kv_heads, head_dim] in the plain
        token-major layout (unpacked; for storage and tests)."""
        from pipefill.kernels.cpu_attention import read_kv as read_any  # bf16 or float32
        index = torch.tensor(pages, dtype=torch.long)
        k, v = (t.index_select(1, index) for t in self.page_blocks())  # [L, n, H, ps, D], tiles
        L, n, H, ps, D = k.shape
        table = torch.arange(L * n, dtype=torch.int32)  # all pages as one "sequence"
        k, v = read_any(k.reshape(L * n, H, ps, D), v.reshape(L * n, H, ps, D), table,
                        L * n * ps)
        return torch.stack([k.reshape(L, n, ps, H, D), v.reshape(L, n, ps, H, D)])

    def write_pages(self, pages: list[int], data: torch.Tensor) -> None:
        """Inverse of read_pages: token-major [2, L, n, ps, H, D] packed into `pages`.
        The kernels' own packing (one call per layer, all pages at once) when an extension is
        loaded: torch's 8-d permute in pack_pages ran at ~130 MB/s, 5x slower, and this is
        what every L2/L3 load of a cached prefix pays (pages are whole 32-token groups, so
        write_kv's zero-fill of a group's tail never applies)."""
        write_kv = _page_packer(self.k.dtype)
        if write_kv is not None:
            table = torch.tensor(pages, dtype=torch.int32)
            H, D = self.num_kv_heads, self.head_dim
            for layer in range(self.k.shape[0]):
                write_kv(self.k[layer], self.v[layer], data[0, layer].reshape(-1, H, D),
                         data[1, layer].reshape(-1, H, D), table, 0)
            return
        index = torch.tensor(pages, dtype=torch.long)
        for cache, plain, kind in ((self.k, data[0], "k"), (self.v, data[1], "v")):
            cache.index_copy_(1, index, pack_pages(plain.to(cache.dtype), kind))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.bfloat16) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def _page_packer(dtype: torch.dtype):
    """A loaded extension's write_kv for a cache of `dtype` (AMX for bf16 when it is loaded,
    else the vector kernels', which pack both dtypes), or None: then pack_pages in torch."""
    if dtype == torch.bfloat16 and _extension.module is not None:
        return write_kv
    try:
        from pipefill.kernels import cpu_attention
        cpu_attention._load()
        return cpu_attention.write_kv
    except Exception:  # noqa: BLE001 - no extension here: the torch packing is as correct
        return None


def check_geometry(page_size: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> None:
    # float32: the vector kernels' variant of the layout (pipefill.kernels.cpu_attention).
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the packed KV cache is bfloat16 or float32, got {dtype}")
    if head_dim not in (64, 128, 256):  # 256: the vector kernels only (AMX refuses it)
        raise ValueError(f"the packed KV cache supports head_dim 64, 128 or 256, got {head_dim}")
    if page_size <= 0 or page_size % 32:
        raise ValueError(f"AMX attention needs page_size to be a multiple of 32, got {page_size}")


def write_kv(k_layer_cache: torch.Tensor, v_layer_cache: torch.Tensor, k_new: torch.Tensor,
             v_new: torch.Tensor, page_table: torch.Tensor, start: int) -> None:
    """Packs k_new/v_new [C, Hkv, D] (positions [start, start + C)) into one layer's cache."""
    _require().write_kv(k_layer_cache, v_layer_cache, k_new, v_new, page_table, int(start))


def chunk_attention(q: torch.Tensor, k_layer_cache: torch.Tensor, v_layer_cache: torch.Tensor,
                    page_table: torch.Tensor, prefix_len: int, scale: float,
                    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (bottom-right) attention of q [C, Hq, D] over cached tokens [0, prefix_len + C)."""
    ext = _require()
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    if k_new is not None:
        ext.write_kv(k_layer_cache, v_layer_cache, k_new, v_new, page_table, int(prefix_len))
    return ext.chunk_attention(q, k_layer_cache, v_layer_cache, page_table, int(prefix_len),
                               float(scale), out)


def chunk_attention_ex(q, k_layer_cache, v_layer_cache, page_table, prefix_len, scale, *,
                       out=None, qtile: int = 0, mode: int = 0, prof: torch.Tensor | None = None,
                       step: int = 0):
    """chunk_attention with tuning/profiling knobs (benchmarks only).

    qtile: query tokens per work item (0 = auto, 192 // group). mode: bit 1 skips QK^T, 2 the
    softmax, 4 PV (output is garbage), 8 runs the phases one after the other instead of
    interleaving AMX and AVX-512 work. prof: int64 [torch.get_num_threads(), 4] accumulating rdtsc
    cycles of QK^T, softmax, PV and whole work items per thread (implies mode 8). step: keys per
    inner step, 64 or 128 (0 = 128).
    """
    return _require().chunk_attention(q, k_layer_cache, v_layer_cache, page_table, int(prefix_len),
                                      float(scale), out, int(qtile), int(mode), prof, int(step))


# ---------------------------------------------------------------------------------------------
# Pure-torch helpers: unpacking and a float64 reference (tests, debugging).

def read_kv(k_layer_cache: torch.Tensor, v_layer_cache: torch.Tensor, page_table: torch.Tensor,
            num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [0, num_tokens) of one sequence back in token-major [n, Hkv, D] layout."""
    P, H, ps, D = k_layer_cache.shape
    npages = math.ceil(num_tokens / ps)
    pages = page_table[:npages].long()
    k = k_layer_cache[pages]  # [n_pages, H, ps * D] in packed order
    v = v_layer_cache[pages]
    # K: [ps/16][D/32][16 pairs][16 tokens][2] -> [ps/16, 16 tokens, D/32, 16 pairs, 2]
    k = k.reshape(npages, H, ps // 16, D // 32, 16, 16, 2).permute(0, 2, 5, 1, 3, 4, 6)
    k = k.reshape(npages * ps, H, D)
    # V: [ps/32][D/16][16 token pairs][16 dims][2] -> [ps/32, pairs, 2, D/16, 16 dims]
    v = v.reshape(npages, H, ps // 32, D // 16, 16, 16, 2).permute(0, 2, 4, 6, 1, 3, 5)
    v = v.reshape(npages * ps, H, D)
    return k[:num_tokens].contiguous(), v[:num_tokens].contiguous()


def pack_pages(plain: torch.Tensor, kind: str) -> torch.Tensor:
    """Token-major pages [L, n, ps, H, D] -> the packed [L, n, H, ps, D] order that read_kv
    (bf16) and cpu_attention.read_kv (float32) undo. K: 16-token x 32-dim tiles of dim pairs;
    V: 32-token x 16-dim tiles of token pairs; float32 keeps the pair index outside."""
    L, n, ps, H, D = plain.shape
    f32 = plain.dtype == torch.float32
    if kind == "k":
        x = plain.reshape(L, n, ps // 16, 16, H, D // 32, 16, 2)  # [.., t16, tok, H, d32, p, 2]
        # -> [L, n, H, t16, d32, pairs, tok, 2] (bf16) or [.., pairs, 2, tok] (float32)
        x = x.permute(0, 1, 4, 2, 5, 6, 7, 3) if f32 else x.permute(0, 1, 4, 2, 5, 6, 3, 7)
    else:
        x = plain.reshape(L, n, ps // 32, 16, 2, H, D // 16, 16)  # [.., t32, pair, 2, H, d16, d]
        # -> [L, n, H, t32, d16, pair, d, 2] (bf16) or [.., pair, 2, d] (float32)
        x = x.permute(0, 1, 5, 2, 6, 3, 4, 7) if f32 else x.permute(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(L, n, H, ps, D).contiguous()


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                        scale: float) -> torch.Tensor:
    """float64 softmax(q k^T * scale, bottom-right causal) v; q [C, Hq, D], k/v [L+C, Hkv, D]."""
    C, Hq, D = q.shape
    n, Hkv, _ = k.shape
    G = Hq // Hkv
    qd = q.double().transpose(0, 1)  # [Hq, C, D]
    kd = k.double().transpose(0, 1).repeat_interleave(G, 0)
    vd = v.double().transpose(0, 1).repeat_interleave(G, 0)
    s = qd @ kd.transpose(1, 2) * scale
    pos = prefix_len + torch.arange(C).unsqueeze(1)
    s = s.masked_fill(torch.arange(n).unsqueeze(0) > pos, float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(0, 1)  # [C, Hq, D]
