"""The KV pool's allocation (model_runner.lazy_zeros): zeros, as torch.zeros gives them, without writing them."""
import os

import pytest
import torch

from engine_service.engine.model_runner import lazy_zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_lazy_zeros_are_zeros_of_the_shape_and_dtype_and_writable(dtype):
    shape = (3, 2, 5, 4, 2, 8)
    t = lazy_zeros(shape, dtype, torch.device("cpu"))
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros(shape, dtype=dtype))
    t[1, 0, 2] = 1  # views of it (a layer's K cache) write into it
    layer = t[2, 1]
    layer.fill_(3)
    assert int(t[1, 0, 2].sum()) == 4 * 2 * 8 and int(t[2, 1].sum()) == 3 * 5 * 4 * 2 * 8
    assert int(t.sum()) == 4 * 2 * 8 + 3 * 5 * 4 * 2 * 8


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux's /proc")
def test_a_large_pool_is_not_written_at_allocation():
    # 1 GiB: resident memory grows by what is touched, not by the pool (the OS zeroes pages on first touch)
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    t = lazy_zeros((256, 1024, 1024), torch.float32, torch.device("cpu"))
    assert rss() - before < 64 * 2 ** 20
    assert float(t[255, 1023, 1023]) == 0.0 and float(t[:4].sum()) == 0.0
    del t


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return ""


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="no transparent huge pages on this system")
def test_a_pool_asks_for_huge_pages():
    # decode attention reads rows scattered over the pool: 2 MiB pages spare it most TLB misses (docs/kernels.md)
    t = lazy_zeros((64, 1024, 1024), torch.float32, torch.device("cpu"))
    addr, region = t.data_ptr(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                region = lo <= addr < hi
            elif region and line.startswith("VmFlags:"):
                assert "hg" in line.split()[1:]  # MADV_HUGEPAGE given
                return
    raise AssertionError("the pool's mapping is not in /proc/self/smaps")


def _resident(addr: int) -> bool:
    """Whether the page holding `addr` is in memory (/proc/self/pagemap's bit 63; readable without privileges)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // 4096 * 8)
        return bool(int.from_bytes(f.read(8), "little") >> 63)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="reads page residency from Linux's /proc")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_the_engine_faults_in_the_first_blocks_of_each_layer_at_start_and_no_more(tiny_llama_dir, kv_cache_dtype):
    """Blocks go out from id 0: the first request writes block 0 of every (layer, K/V) slab, one fresh page each,
    0.35-0.55 s of its latency on a VM whose unused memory is slow to fault in. The engine writes them at start."""
    from engine_service.engine.llm_engine import LLMEngine

    engine = LLMEngine(model=str(tiny_llama_dir), num_kv_blocks=150_000, kv_cache_dtype=kv_cache_dtype)
    pools = [engine.runner.kv_cache] + ([engine.runner.kv_scales] if kv_cache_dtype == "int8" else [])
    for pool in pools:
        per_block = pool[0, 0, 0].numel() * pool.element_size()
        far = pool.shape[2] // 2  # mid-slab: 2 MiB pages the writes at either slab's start reach end 4 MiB away
        assert far * per_block > 4 << 20
        for layer in range(pool.shape[0]):
            for kv in range(2):
                assert _resident(pool[layer, kv, 0].data_ptr()), (layer, kv)
                assert _resident(pool[layer, kv, 0].data_ptr() + per_block - 1)
                assert not _resident(pool[layer, kv, far].data_ptr()), (layer, kv, "the whole pool was written")
