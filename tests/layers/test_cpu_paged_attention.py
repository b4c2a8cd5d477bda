"""The cpu_paged decode attention kernel (csrc/decode_attention.cpp) and its backend against
the torch reference: ragged lengths, pages of 1 and 16 slots, GQA, long rows split across
threads, shared prefixes (cascade), and clear errors on bad inputs."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.attention.base import AttentionLayer
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.layers.cpu_kernels import load_cpu_kernels
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.model_executor.forward_batch import ForwardBatch, ForwardMode


@pytest.fixture(scope="module")
def kernel():
    load_cpu_kernels()  # builds on first use (tens of seconds), then cached
    return torch.ops.radixserve.decode_attention


def _reference(q, k_buf, v_buf, rows, start, end, scale):
    b_, h_, g_, d_ = q.shape
    out = torch.zeros(b_, h_, g_, d_)
    lse = torch.full((b_, h_, g_), float("-inf"))
    for b in range(b_):
        slots = rows[b, start[b] : end[b]]
        if len(slots) == 0:
            continue
        s = torch.einsum("hgd,lhd->hgl", q[b].float(), k_buf[slots].float()) * scale
        lse[b] = torch.logsumexp(s, -1)
        out[b] = torch.einsum("hgl,lhd->hgd", torch.softmax(s, -1), v_buf[slots].float())
    return out, lse


def _paged_rows(lens: list[int], page_size: int, pool_pages: int, gen) -> torch.Tensor:
    """Rows allocated page by page from a shuffled free list (as the allocator does)."""
    pages = torch.randperm(pool_pages, generator=gen).tolist()
    rows = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        need = -(-n // page_size)
        mine = [pages.pop() for _ in range(need)]
        slots = torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in mine])
        rows[i, :n] = slots[:n]
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "heads,lens",
    [
        ((3, 3, 64), [1, 2, 33, 256, 7]),  # SmolLM2's 9 query / 3 KV heads, ragged
        ((2, 4, 128), [9000, 17]),  # long rows split into segments across threads
        ((1, 1, 64), [5]),  # MHA-like, one request
        ((4, 2, 32), [64] * 9),  # more requests than threads, equal lengths
        ((3, 24, 64), [1024, 40]),  # a cascade group's call: 8 requests' queries stacked
        ((2, 2, 40), [70, 5]),  # a head size that is no multiple of 8 (the scalar path)
        ((1, 2, 8), [8, 16, 9]),  # blocks ending exactly on and just past 8 slots
    ],
)
@pytest.mark.parametrize("split_tokens", [0, 7])
def test_kernel_matches_reference(kernel, dtype, page_size, heads, lens, split_tokens):
    gen = torch.Generator().manual_seed(len(lens) + page_size)
    hkv, grp, d = heads
    pool_pages = (sum(lens) // page_size) + len(lens) + 8
    size = pool_pages * page_size
    k_buf = torch.randn(size, hkv, d, generator=gen).to(dtype)
    v_buf = torch.randn(size, hkv, d, generator=gen).to(dtype)
    rows = _paged_rows(lens, page_size, pool_pages, gen)
    end = torch.tensor(lens)
    start = torch.zeros_like(end)
    start[-1] = min(3, lens[-1] - 1)  # one row starts later (a cascade suffix)
    q = torch.randn(len(lens), hkv, grp, d, generator=gen).to(dtype)
    out, lse = kernel(q, k_buf, v_buf, rows, start, end, d**-0.5, split_tokens)
    ref_out, ref_lse = _reference(q, k_buf, v_buf, rows, start, end, d**-0.5)
    assert out.dtype == torch.float32 and out.shape == q.shape
    if dtype == torch.bfloat16 and d in (64, 128) and _bf16_products():
        # vdpbf16ps: the scores are exact products summed in fp32, the probabilities weigh
        # the values rounded to bf16 (2**-9 relative), as the torch-native backend's do
        err = (out - ref_out).abs()
        assert err.max() < 1e-2 and err.mean() < 1e-3, (err.max(), err.mean())
        assert torch.allclose(lse, ref_lse, atol=1e-4), (lse - ref_lse).abs().max()
        return
    assert torch.allclose(out, ref_out, atol=2e-5), (out - ref_out).abs().max()
    assert torch.allclose(lse, ref_lse, atol=2e-5)


def _bf16_products() -> bool:
    """Whether this build has decode_attention's bf16 kernel (a CPU with AVX512-BF16)."""
    return bool(torch.ops.radixserve.extend_attention_supported())


@pytest.mark.parametrize("d", [64, 128])
def test_fp32_query_over_a_bf16_pool_stays_exact(kernel, d):
    """Only a bf16 query takes the bf16 products: an fp32 query is never rounded for them."""
    gen = torch.Generator().manual_seed(d)
    k_buf = torch.randn(600, 2, d, generator=gen).bfloat16()
    v_buf = torch.randn(600, 2, d, generator=gen).bfloat16()
    rows = torch.randperm(600, generator=gen)[:500].view(1, 500)
    q = torch.randn(1, 2, 3, d, generator=gen)
    start, end = torch.tensor([0]), torch.tensor([500])
    out, lse = kernel(q, k_buf, v_buf, rows, start, end, d**-0.5, 0)
    ref_out, ref_lse = _reference(q, k_buf, v_buf, rows, start, end, d**-0.5)
    assert torch.allclose(out, ref_out, atol=2e-5), (out - ref_out).abs().max()
    assert torch.allclose(lse, ref_lse, atol=2e-5)


def fp8_pool(shape, fp8, gen, scale=3.0):
    """A random fp8 pool holding every byte pattern's class: zeros, subnormals, both signs,
    the largest finite values (e4m3fn's 0x7F/0xFF are NaN and never stored)."""
    buf = (torch.randn(*shape, generator=gen) * scale).to(fp8)
    bits = buf.view(torch.uint8).view(-1)
    special = [0x00, 0x80, 0x01, 0x02, 0x03, 0x81, 0x83, 0x04, 0x84]
    special += [0x7E, 0xFE] if fp8 == torch.float8_e4m3fn else [0x7B, 0xFB]
    bits[: len(special)] = torch.tensor(special, dtype=torch.uint8)
    return buf


@pytest.mark.parametrize("fp8", [torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 40])
def test_fp8_pool_equals_its_widened_copy(kernel, fp8, q_dtype, d):
    """An fp8 pool (--kv-cache-dtype fp8_e5m2 / fp8_e4m3) is widened exactly as it is read:
    the same output and lse, bit for bit, as the same values in a bf16 pool (bf16 queries on
    the bf16 kernel) or an fp32 pool (fp32 queries, and a head size no bf16 kernel takes)."""
    gen = torch.Generator().manual_seed(d)
    size, hkv, grp = 3000, 3, 3
    k_buf, v_buf = fp8_pool((size, hkv, d), fp8, gen), fp8_pool((size, hkv, d), fp8, gen)
    lens = [1, 70, 1500, 129]
    rows = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        rows[i, :n] = torch.randperm(size, generator=gen)[:n]
    rows[:, 0] = 0  # slot 0 holds the special bytes
    start, end = torch.zeros(len(lens), dtype=torch.long), torch.tensor(lens)
    q = torch.randn(len(lens), hkv, grp, d, generator=gen).to(q_dtype)
    wide = torch.bfloat16 if q_dtype == torch.bfloat16 else torch.float32
    out, lse = kernel(q, k_buf, v_buf, rows, start, end, d**-0.5, 0)
    ref_out, ref_lse = kernel(q, k_buf.to(wide), v_buf.to(wide), rows, start, end, d**-0.5, 0)
    assert torch.isfinite(out).all()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_an_fp8_nan_reads_as_nan(kernel, q_dtype):
    """e4m3fn's NaN bytes (0x7F / 0xFF: a NaN stored) widen to NaN on every path, as torch's
    cast widens them, so a NaN key poisons only the rows that attend it."""
    k_buf = torch.randn(8, 1, 64).to(torch.float8_e4m3fn)
    k_buf.view(torch.uint8)[3, 0, 5] = 0xFF
    q = torch.randn(2, 1, 2, 64).to(q_dtype)
    rows = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out, _ = kernel(q, k_buf, k_buf, rows, torch.tensor([0, 0]), torch.tensor([3, 3]), 1.0, 0)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


def test_empty_ranges_and_bad_inputs(kernel):
    k_buf = torch.randn(10, 1, 64)
    q = torch.randn(2, 1, 2, 64)
    rows = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out, lse = kernel(q, k_buf, k_buf, rows, torch.tensor([0, 1]), torch.tensor([0, 3]), 1.0, 0)
    assert torch.equal(out[0], torch.zeros(1, 2, 64)) and torch.isinf(lse[0]).all()
    assert torch.isfinite(out[1]).all()
    with pytest.raises(RuntimeError, match="out of the pool"):
        bad = torch.tensor([[1, 2, 99], [4, 5, 6]])
        kernel(q, k_buf, k_buf, bad, torch.tensor([0, 0]), torch.tensor([3, 3]), 1.0, 0)
    with pytest.raises(RuntimeError, match="out of its row"):
        kernel(q, k_buf, k_buf, rows, torch.tensor([0, 0]), torch.tensor([3, 4]), 1.0, 0)
    with pytest.raises(RuntimeError, match="heads/dim"):
        kernel(
            q,
            torch.randn(10, 2, 64),
            torch.randn(10, 2, 64),
            rows,
            rows[:, 0] * 0,
            rows[:, 0] * 0,
            1.0,
            0,
        )


def _batch(mode, pool, rows, prefixes, ext, out_loc):
    """A ForwardBatch of requests extending their cached `prefixes` by `ext` tokens each
    (decode: one token each), whose new tokens' slots are `out_loc`, packed in order."""
    lens = [p + n for p, n in zip(prefixes, ext, strict=True)]
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(lens),
        input_ids=torch.zeros(len(out_loc), dtype=torch.long),
        positions=torch.cat([torch.arange(p, n) for p, n in zip(prefixes, lens, strict=True)]),
        req_pool_indices=torch.arange(len(lens)),
        seq_lens=torch.tensor(lens),
        out_cache_loc=out_loc,
        seq_lens_cpu=lens,
        extend_prefix_lens_cpu=list(prefixes),
        extend_seq_lens_cpu=list(ext),
        kv_rows=rows,
        token_to_kv_pool=pool,
    )


# (model dtype, KV pool dtype): the pool's own dtype, and fp8 pools (--kv-cache-dtype fp8_*),
# which the torch-native backend widens with torch's casts and the kernels with their own.
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2),
    (torch.float32, torch.float8_e5m2),
]


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize("shared", [0, 1, 2])  # groups sharing a >= 64-slot prefix
def test_backend_decode_equals_torch_native(kernel, dtype, kv_dtype, shared):
    """The cpu_paged backend's decode step (with its cascade over shared prefixes) against the
    torch-native backend's on the same pool: same attention output, same KV written."""
    from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend

    gen = torch.Generator().manual_seed(shared)
    layer = AttentionLayer(0, 9, 3, 64, 64**-0.5)
    size = 6000
    rows_list, nxt = [], 100
    for g in range(shared):  # 3 requests per group on a 150 + 40 g slot prefix
        prefix = torch.arange(nxt, nxt + 150 + 40 * g)
        nxt += 400
        for m in range(3):
            rows_list.append(torch.cat([prefix, torch.arange(nxt, nxt + 1 + 9 * m)]))
            nxt += 50
    for p in range(3):  # private rows
        rows_list.append(torch.arange(nxt, nxt + 20 + 60 * p))
        nxt += 300
    lens = [len(r) for r in rows_list]
    rows = torch.zeros(len(lens), max(lens) + 5, dtype=torch.long)
    for i, r in enumerate(rows_list):
        rows[i, : len(r)] = r
    out_loc = torch.tensor([int(r[-1]) for r in rows_list])  # each new token's slot
    q = torch.randn(len(lens), 9 * 64, generator=gen).to(dtype)
    k = torch.randn(len(lens), 3, 64, generator=gen).to(dtype)
    v = torch.randn(len(lens), 3, 64, generator=gen).to(dtype)
    outs, pools = [], []
    for backend in (TorchNativeAttnBackend("cpu"), CpuPagedAttnBackend("cpu")):
        g2 = torch.Generator().manual_seed(99)
        pool = MHATokenToKVPool(size, 1, 3, 64, kv_dtype, "cpu", 1)
        pool.k_buffer[0].copy_(torch.randn(size + 1, 3, 64, generator=g2).to(kv_dtype))
        pool.v_buffer[0].copy_(torch.randn(size + 1, 3, 64, generator=g2).to(kv_dtype))
        fb = _batch(ForwardMode.DECODE, pool, rows, [n - 1 for n in lens], [1] * len(lens), out_loc)
        backend.init_forward_metadata(fb)
        if isinstance(backend, CpuPagedAttnBackend):
            assert len(fb.attn_metadata.groups) == shared
        outs.append(backend.forward(q, k, v, layer, fb))
        pools.append(pool)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert outs[1].dtype == dtype
    assert torch.allclose(outs[1].float(), outs[0].float(), atol=tol), (
        (outs[1] - outs[0]).abs().max()
    )
    assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])
    assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])


def test_backend_is_cpu_only_and_flag_validation():
    from radixserve.args import ServerArgs
    from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend

    with pytest.raises(ValueError, match="CPU only"):
        CpuPagedAttnBackend("cuda")
    with pytest.raises(ValueError, match="CPU only"):
        ServerArgs(attention_backend="cpu_paged", device="cuda").resolve()
    with pytest.raises(ValueError, match="must be one of"):
        ServerArgs(attention_backend="flashinfer")


def test_auto_backend_falls_back_to_torch_native_where_the_kernel_cannot_build(monkeypatch):
    import radixserve.layers.attention.cpu_paged_backend as paged
    from radixserve.layers.cpu_kernels import KernelBuildError
    from radixserve.model_executor.model_runner import create_attention_backend

    assert isinstance(create_attention_backend("auto", "cpu"), paged.CpuPagedAttnBackend)
    assert type(create_attention_backend("auto", "cuda")) is TorchNativeAttnBackend
    assert type(create_attention_backend("torch_native", "cpu")) is TorchNativeAttnBackend

    def no_compiler() -> None:
        raise KernelBuildError("could not build radixserve's CPU attention kernels (no g++)")

    monkeypatch.setattr(paged, "load_cpu_kernels", no_compiler)
    assert type(create_attention_backend("auto", "cpu")) is TorchNativeAttnBackend
    with pytest.raises(KernelBuildError, match="no g\\+\\+"):
        create_attention_backend("cpu_paged", "cpu")


@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPE_PAIRS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("heads", "mode", "prefixes", "ext"),
    [
        ((9, 3, 64), ForwardMode.EXTEND, [0, 0, 0], [7, 300, 1]),  # ragged prompts, no cache
        ((9, 3, 64), ForwardMode.EXTEND, [40, 0, 513, 16], [90, 5, 2, 1]),  # cached prefixes
        ((8, 2, 32), ForwardMode.MIXED, [128, 31, 77, 200, 5], [64, 1, 1, 1, 1]),  # chunk + decode
        ((4, 4, 128), ForwardMode.MIXED, [0, 999, 3], [33, 1, 1]),  # no GQA, a long decode row
    ],
)
def test_backend_ragged_extend_equals_torch_native(
    kernel, dtype, kv_dtype, page_size, heads, mode, prefixes, ext
):
    """Extend and mixed steps run ragged (one-token rows through the decode kernel, longer rows
    one SDPA each, causal from their cached prefix) and match the torch-native backend's padded
    batch on the same pool: same attention output, same KV written."""
    from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend

    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(page_size + len(ext))
    layer = AttentionLayer(0, hq, hkv, d, d**-0.5)
    lens = [p + n for p, n in zip(prefixes, ext, strict=True)]
    pages = 8 + sum(-(-n // page_size) for n in lens)
    size = pages * page_size
    rows = _paged_rows(lens, page_size, pages, gen)
    # the new tokens' slots, packed request by request
    out_loc = torch.cat([rows[i, p:n] for i, (p, n) in enumerate(zip(prefixes, lens, strict=True))])
    t = len(out_loc)
    q = torch.randn(t, hq * d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    outs, pools = [], []
    for backend in (TorchNativeAttnBackend("cpu"), CpuPagedAttnBackend("cpu")):
        g2 = torch.Generator().manual_seed(7)
        pool = MHATokenToKVPool(size, 1, hkv, d, kv_dtype, "cpu", page_size)
        pool.k_buffer[0].copy_(torch.randn(size + page_size, hkv, d, generator=g2).to(kv_dtype))
        pool.v_buffer[0].copy_(torch.randn(size + page_size, hkv, d, generator=g2).to(kv_dtype))
        fb = _batch(mode, pool, rows, prefixes, ext, out_loc)
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, layer, fb))
        pools.append(pool)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert outs[1].dtype == dtype and outs[1].shape == (t, hq * d)
    assert torch.allclose(outs[1].float(), outs[0].float(), atol=tol), (
        (outs[1] - outs[0]).abs().max()
    )
    assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])
    assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])
