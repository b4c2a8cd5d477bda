"""The bf16 extend (prefill) attention kernel (csrc/extend_attention.cpp) against an fp32
reference: new tokens attending a cached prefix and each other causally, through a request's
slots in a paged pool (pages of 1 and 16), GQA and plain multi-head, head sizes 64 and 128,
query counts on and off the 64-row tile, long rows, and clear errors on what it does not take.
It exists only in builds for CPUs with AVX512-BF16; elsewhere these tests skip (the backend
then keeps SDPA, which test_cpu_paged_attention.py checks). On a CPU with AMX the kernels'
products run on the tile unit; every kernel test runs there both ways (set_attention_amx), and
the AMX case skips elsewhere."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.cpu_kernels import load_cpu_kernels


@pytest.fixture(scope="module")
def extend_default():
    load_cpu_kernels()
    if not torch.ops.radixserve.extend_attention_supported():
        pytest.skip("this CPU has no AVX512-BF16: the extend kernel is not built here")
    return torch.ops.radixserve.extend_attention


@pytest.fixture(params=["vdpbf16ps", "amx"])
def extend(request, extend_default):
    """The kernel with its products on AVX512-BF16's dot products, or on AMX's tile unit."""
    ops = torch.ops.radixserve
    amx = request.param == "amx"
    before = ops.set_attention_amx(amx)
    try:
        if amx and not ops.extend_attention_amx():
            pytest.skip("this build or CPU has no AMX (or Linux refused the tile state)")
        assert ops.extend_attention_amx() is False or amx  # the switch holds
        yield extend_default
    finally:
        ops.set_attention_amx(before)


def _slots(length: int, page_size: int, pool_pages: int, gen) -> torch.Tensor:
    pages = torch.randperm(pool_pages, generator=gen)[: -(-length // page_size)]
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages])[:length]


def _reference(q, k_buf, v_buf, slots, scale):
    """Softmax attention in fp32: query i at position L - N + i sees keys 0 ..= that."""
    n, hq, _ = q.shape
    length = len(slots)
    k = k_buf[slots].float().repeat_interleave(hq // k_buf.shape[1], dim=1)  # [L, Hq, D]
    v = v_buf[slots].float().repeat_interleave(hq // k_buf.shape[1], dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    pos = torch.arange(length - n, length)
    s = s.masked_fill(torch.arange(length)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("heads", "prefix", "new"),
    [
        ((9, 3, 64), 0, 1),  # one token, nothing cached
        ((9, 3, 64), 0, 64),  # exactly one tile
        ((9, 3, 64), 0, 200),  # a prompt off the tile size
        ((9, 3, 64), 513, 2),  # a short chunk after a long prefix
        ((9, 3, 64), 40, 90),  # a prefix off the tile size
        ((9, 3, 64), 1536, 512),  # a chunk of a long prompt
        ((9, 3, 64), 8, 600),  # 16-row groups across the AMX path's 512-key chunks
        ((9, 3, 64), 480, 100),  # a chunk boundary inside the new tokens
        ((9, 3, 64), 0, 17),  # one full 16-row group and one row
        ((4, 4, 128), 0, 130),  # no GQA, head size 128
        ((14, 2, 64), 31, 77),  # seven query heads per KV head
        ((8, 1, 128), 1000, 65),  # one KV head
    ],
)
def test_extend_kernel_matches_the_fp32_reference(extend, page_size, heads, prefix, new):
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(prefix * 7 + new + page_size)
    length = prefix + new
    pool_pages = -(-length // page_size) + 6
    size = pool_pages * page_size
    k_buf = torch.randn(size, hkv, d, generator=gen).bfloat16()
    v_buf = torch.randn(size, hkv, d, generator=gen).bfloat16()
    slots = _slots(length, page_size, pool_pages, gen)
    q = torch.randn(new, hq, d, generator=gen).bfloat16()
    out = extend(q, k_buf, v_buf, slots, d**-0.5)
    ref = _reference(q, k_buf, v_buf, slots, d**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (new, hq, d)
    # bf16 output (8 bits of mantissa) and probabilities rounded to bf16 before the second
    # product, as flash-attention does
    err = (out.float() - ref).abs().max().item()
    assert err < 1.5e-2, err
    if prefix == 0:  # the first query sees one key: its output is that key's value, exactly
        assert torch.equal(out[0], v_buf[slots[0]].repeat_interleave(hq // hkv, dim=0))


def test_extend_kernel_ignores_slots_it_does_not_see(extend):
    """Keys after a query's position, and pool rows outside the request's slots, do not change
    its output: poisoning them with huge values leaves every row the same."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, prefix, new = 9, 3, 64, 100, 70
    slots = torch.randperm(400, generator=gen)[: prefix + new]
    k_buf = torch.randn(400, hkv, d, generator=gen).bfloat16()
    v_buf = torch.randn(400, hkv, d, generator=gen).bfloat16()
    q = torch.randn(new, hq, d, generator=gen).bfloat16()
    out = extend(q, k_buf, v_buf, slots, 0.125)
    others = torch.ones(400, dtype=torch.bool)
    others[slots] = False
    k2, v2 = k_buf.clone(), v_buf.clone()
    k2[others], v2[others] = 1e4, 1e4
    last = slots[-1]
    k2[last], v2[last] = 1e4, 1e4  # only the last query sees the last key
    out2 = extend(q, k2, v2, slots, 0.125)
    assert torch.equal(out[:-1], out2[:-1])
    assert not torch.equal(out[-1], out2[-1])


def test_extend_kernel_rejects_what_it_does_not_take(extend):
    k = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    slots = torch.arange(5)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        extend(
            q[..., :32].contiguous(), k[..., :32].contiguous(), k[..., :32].contiguous(), slots, 0.1
        )
    with pytest.raises(RuntimeError, match="bf16"):
        extend(q.float(), k, k, slots, 0.1)
    with pytest.raises(RuntimeError, match="out of the pool"):
        extend(q, k, k, torch.tensor([0, 1, 10]), 0.1)
    with pytest.raises(RuntimeError, match="new tokens <= slots"):
        extend(q, k, k, torch.arange(2), 0.1)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        extend(torch.zeros(3, 3, 64, dtype=torch.bfloat16), k, k, slots, 0.1)


@pytest.mark.real_model
def test_bf16_real_model_prefill_is_as_close_to_fp32_as_sdpa(
    extend_default, default_model_path, default_tokenizer
):
    """SmolLM2's prefill logits in bf16 with prompts through this kernel are as close to the
    fp32 model's as with torch's SDPA in its place, and pick the same next tokens. (Greedy
    tokens are not compared over many steps: in bf16 two attention implementations part at
    near-ties within a few tokens, SDPA's and the portable backend's as well.)"""
    from rs_testing import greedy_step_logits, make_prompts

    from radixserve.args import ServerArgs
    from radixserve.model_executor.model_runner import ModelRunner

    prompts = make_prompts(default_tokenizer, [300, 70, 9, 180, 640])

    def prefill_logits(dtype: str, kernel: bool) -> torch.Tensor:
        args = ServerArgs(
            model_path=default_model_path,
            dtype=dtype,
            device="cpu",
            max_total_tokens=4000,
            attention_backend="cpu_paged",
        )
        runner = ModelRunner(args.resolve())
        if not kernel:
            runner.attn_backend.extend_kernel = None
        return greedy_step_logits(runner, prompts, steps=0)[0].float()

    fp32 = prefill_logits("float32", kernel=False)
    with_kernel = prefill_logits("bfloat16", kernel=True)
    with_sdpa = prefill_logits("bfloat16", kernel=False)
    err_kernel = (with_kernel - fp32).abs().max().item()
    err_sdpa = (with_sdpa - fp32).abs().max().item()
    assert err_kernel <= 1.5 * err_sdpa, (err_kernel, err_sdpa)
    assert not torch.equal(with_kernel, with_sdpa)  # the kernel did run
    assert torch.equal(with_kernel.argmax(-1), fp32.argmax(-1))


def _cascade_inputs(groups, hkv, g, d, gen):
    """A batch of decode queries, some in groups sharing a prefix: groups = [(members, Lp)]."""
    b = 1 + max(m for members, _ in groups for m in members)
    size = sum(lp for _, lp in groups) + 64
    k_buf = torch.randn(size, hkv, d, generator=gen).bfloat16()
    v_buf = torch.randn(size, hkv, d, generator=gen).bfloat16()
    q = torch.randn(b, hkv, g, d, generator=gen).bfloat16()
    perm = torch.randperm(size, generator=gen)
    prefixes, at = [], 0
    for _, lp in groups:
        prefixes.append(perm[at : at + lp])
        at += lp
    return q, k_buf, v_buf, prefixes


@pytest.mark.parametrize(
    ("heads", "groups"),
    [
        ((3, 3, 64), [([0, 1, 2], 150), ([4, 3], 64)]),  # SmolLM2's heads, members unsorted
        ((3, 3, 64), [(list(range(30)), 1030)]),  # 90 rows: two tiles of one group
        ((2, 4, 128), [([1, 0], 77), ([2, 5, 3], 700)]),  # head size 128
        ((1, 8, 64), [([0, 1], 1)]),  # a one-slot prefix, one KV head
    ],
)
def test_cascade_kernel_merges_each_groups_prefix_into_the_suffix_result(extend, heads, groups):
    """Each member's (out, lse) over its suffix, merged with its group's prefix, equals
    attention over prefix + suffix; rows of the batch in no group are left as they were, and
    an empty suffix (lse = -inf) gives the prefix's attention alone."""
    hkv, g, d = heads
    gen = torch.Generator().manual_seed(len(groups) * 100 + g)
    q, k_buf, v_buf, prefixes = _cascade_inputs(groups, hkv, g, d, gen)
    b = q.shape[0]
    scale = d**-0.5
    # every request's private suffix: 1 to 40 slots of its own (row 0: none)
    suffix = [torch.randint(0, k_buf.shape[0], (int(n),), generator=gen) for n in range(b)]
    owner = {m: i for i, (members, _) in enumerate(groups) for m in members}

    def attend(qb, slots):  # qb [Hkv, G, D] over slots -> (out [Hkv, G, D], lse [Hkv, G])
        s = torch.einsum("hgd,lhd->hgl", qb.float(), k_buf[slots].float()) * scale
        return torch.einsum("hgl,lhd->hgd", s.softmax(-1), v_buf[slots].float()), s.logsumexp(-1)

    out = torch.zeros(b, hkv, g, d)
    lse = torch.full((b, hkv, g), float("-inf"))
    want = torch.zeros(b, hkv, g, d)
    for i in range(b):
        if len(suffix[i]):
            out[i], lse[i] = attend(q[i], suffix[i])
        full = suffix[i] if i not in owner else torch.cat([prefixes[owner[i]], suffix[i]])
        want[i] = attend(q[i], full)[0] if len(full) else out[i]
    want_lse = torch.stack(
        [
            attend(q[i], torch.cat([prefixes[owner[i]], suffix[i]]))[1] if i in owner else lse[i]
            for i in range(b)
        ]
    )
    members = torch.tensor([m for ms, _ in groups for m in ms])
    start = torch.tensor([0, *torch.tensor([len(ms) for ms, _ in groups]).cumsum(0).tolist()])
    rows = torch.nn.utils.rnn.pad_sequence(prefixes, batch_first=True)
    lens = torch.tensor([lp for _, lp in groups])
    untouched = [i for i in range(b) if i not in owner]
    before = out[untouched].clone(), lse[untouched].clone()
    torch.ops.radixserve.cascade_prefix_attention(
        q, k_buf, v_buf, members, start, rows, lens, out, lse, scale
    )
    assert torch.equal(out[untouched], before[0]) and torch.equal(lse[untouched], before[1])
    err = (out - want).abs().max().item()
    assert err < 1e-2, err
    assert torch.allclose(lse, want_lse, atol=1e-2, rtol=0)


@pytest.mark.parametrize("fp8", [torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_pools_are_widened_exactly(extend, fp8, d):
    """An fp8 pool (--kv-cache-dtype fp8_e5m2 / fp8_e4m3) gives both kernels the same results,
    bit for bit, as the same values in a bf16 pool: its bytes are widened to bf16 exactly as
    the tiles are packed (zeros, subnormals and the largest values included)."""
    from test_cpu_paged_attention import fp8_pool

    gen = torch.Generator().manual_seed(d)
    hq, hkv, size = 6, 2, 1200
    k8, v8 = fp8_pool((size, hkv, d), fp8, gen), fp8_pool((size, hkv, d), fp8, gen)
    kb, vb = k8.bfloat16(), v8.bfloat16()
    slots = torch.randperm(size, generator=gen)[:700]
    slots[0] = 0  # slot 0 holds the special bytes
    q = torch.randn(150, hq, d, generator=gen).bfloat16()
    out = extend(q, k8, v8, slots, d**-0.5)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, extend(q, kb, vb, slots, d**-0.5))
    qc = torch.randn(3, hkv, hq // hkv, d, generator=gen).bfloat16()
    args = (torch.tensor([2, 0]), torch.tensor([0, 2]), slots[None, :500], torch.tensor([500]))
    results = []
    for k, v in ((k8, v8), (kb, vb)):
        out, lse = torch.zeros(qc.shape), torch.full(qc.shape[:3], float("-inf"))
        torch.ops.radixserve.cascade_prefix_attention(qc, k, v, *args, out, lse, d**-0.5)
        results.append((out, lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_cascade_kernel_rejects_bad_groups(extend):
    q = torch.zeros(4, 3, 3, 64, dtype=torch.bfloat16)
    k = torch.zeros(100, 3, 64, dtype=torch.bfloat16)
    out, lse = torch.zeros(4, 3, 3, 64), torch.zeros(4, 3, 3)
    rows, lens = torch.arange(10)[None], torch.tensor([10])
    op = torch.ops.radixserve.cascade_prefix_attention
    with pytest.raises(RuntimeError, match="out of the batch"):
        op(q, k, k, torch.tensor([0, 4]), torch.tensor([0, 2]), rows, lens, out, lse, 0.1)
    with pytest.raises(RuntimeError, match="no members"):
        two = torch.arange(20).view(2, 10)
        op(
            q,
            k,
            k,
            torch.tensor([0, 1]),
            torch.tensor([0, 0, 2]),
            two,
            lens.repeat(2),
            out,
            lse,
            0.1,
        )
    with pytest.raises(RuntimeError, match="prefix length out of its row"):
        op(q, k, k, torch.tensor([0, 1]), torch.tensor([0, 2]), rows, lens + 1, out, lse, 0.1)
    with pytest.raises(RuntimeError, match="out of the pool"):
        op(q, k, k, torch.tensor([0, 1]), torch.tensor([0, 2]), rows + 95, lens, out, lse, 0.1)
    with pytest.raises(RuntimeError, match="fp32"):
        op(
            q,
            k,
            k,
            torch.tensor([0, 1]),
            torch.tensor([0, 2]),
            rows,
            lens,
            out.bfloat16(),
            lse,
            0.1,
        )


def test_the_start_up_line_says_where_prompts_attend(extend):
    """ModelRunner logs where prompts and shared prefixes attend: on the tile unit, on the dot
    products, or (None) not through these kernels at all."""
    from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend

    backend = CpuPagedAttnBackend("cpu")
    amx = torch.ops.radixserve.extend_attention_amx()
    where = "AMX's tile unit" if amx else "AVX512-BF16's dot products"
    bf16 = torch.bfloat16
    assert backend.tile_kernels_run_on(bf16, bf16, 64) == where
    assert backend.tile_kernels_run_on(bf16, bf16, 128) == where
    assert backend.tile_kernels_run_on(torch.float32, torch.float32, 64) is None
    assert backend.tile_kernels_run_on(bf16, torch.float32, 64) is None  # an fp32 KV pool
    for fp8 in (torch.float8_e5m2, torch.float8_e4m3fn):  # widened to bf16 as they are read
        assert backend.tile_kernels_run_on(bf16, fp8, 64) == where
        assert backend.tile_kernels_run_on(torch.float32, fp8, 64) is None
    assert backend.tile_kernels_run_on(bf16, bf16, 96) is None  # a head size they do not take
