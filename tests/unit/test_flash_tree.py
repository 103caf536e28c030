"""The Triton flash-decoding tree attention against the plain masked attention it replaces (GPU only: Triton does
not run on the CPU). Shapes cover a decode step (one node), small and large trees, several chunks of keys and
a single one, key counts that are not a multiple of the tile, and the demo pair's and Qwen3-8B's head layouts."""

from __future__ import annotations

import pytest
import torch

from kernels.flash_tree import flash_supported, flash_tree_attention, plan
from kernels.sdpa import matmul_attention
from verify_server.step_attention import step_mask
from verify_server.tree_attention import ancestor_matrix

CUDA = torch.device("cuda")
needs_gpu = pytest.mark.gpu(reason="Triton kernels need a CUDA device")


def random_tree(q: int, gen: torch.Generator) -> torch.Tensor:
    """parents [q]: -1 for the root, then each node hangs off an earlier one."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q)]
    return torch.tensor(parents)


def test_plan_covers_every_key_once() -> None:
    shapes = [(1, 32, 8, 640), (64, 32, 8, 640), (256, 32, 8, 4096), (48, 32, 8, 24576), (1, 6, 2, 96), (33, 6, 2, 65)]
    for q, heads, kv_heads, kv_len in shapes:
        p = plan(q, heads, kv_heads, kv_len)
        assert p.chunk % 64 == 0 and (p.splits - 1) * p.chunk < kv_len <= p.splits * p.chunk
        assert p.tiles * p.block_m >= q * heads // kv_heads


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "q_len,heads,kv_heads,head_dim,kv_len,start",
    [
        (1, 32, 8, 128, 640, 511),  # Qwen3-8B decode: many chunks
        (64, 32, 8, 128, 640, 512),  # Qwen3-8B tree of 63 nodes
        (256, 32, 8, 128, 1024, 700),  # a large tree: several row tiles
        (1, 6, 2, 64, 96, 40),  # demo pair decode
        (33, 6, 2, 64, 200, 150),  # demo tree; keys not a multiple of 64
        (16, 4, 4, 64, 64, 0),  # no committed context, no GQA
        (48, 32, 8, 128, 6144, 4200),  # a tree over a long context: tiles of 64 rows; a key bucket's spare rows
        (1, 32, 8, 128, 24576, 16400),  # a decode over a 16k-token context
    ],
)
def test_flash_equals_masked_attention(
    dtype: torch.dtype, q_len: int, heads: int, kv_heads: int, head_dim: int, kv_len: int, start: int
) -> None:
    assert flash_supported(CUDA, head_dim)
    gen = torch.Generator().manual_seed(q_len * 1000 + kv_len)
    q = torch.randn(q_len, heads, head_dim, generator=gen).to(CUDA, dtype)
    # a cache slot's rows, longer than the kv_len the step attends over, as the verifier passes them
    k_slot = torch.randn(kv_heads, kv_len + 64, head_dim, generator=gen).to(CUDA, dtype)
    v_slot = torch.randn(kv_heads, kv_len + 64, head_dim, generator=gen).to(CUDA, dtype)
    k, v = k_slot[:, :kv_len], v_slot[:, :kv_len]
    tree = ancestor_matrix(random_tree(q_len, gen).to(CUDA))  # [q, q]
    start_t = torch.tensor(start, device=CUDA)
    scale = head_dim**-0.5

    got = flash_tree_attention(q, k_slot, v_slot, kv_len, start_t, tree, scale)  # [q, heads, d]
    mask = step_mask(start_t, tree, kv_len)  # [1, 1, q, kv_len]
    want = matmul_attention(q.transpose(0, 1)[None].float(), k[None].float(), v[None].float(), mask, scale)
    want = want[0].transpose(0, 1)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # a node that sees nothing of the tree but itself and the context gives the context-only answer: the root
    # row must differ from a row that also sees other new tokens, or visibility was ignored
    if q_len > 1:
        assert not torch.allclose(got[0].float(), got[-1].float())


@needs_gpu
def test_flash_under_compile_and_graph_capture() -> None:
    """The custom op inside a compiled function with changing shapes, replayed from a CUDA graph."""
    fn = torch.compile(lambda q, k, v, s, t: flash_tree_attention(q * 1.0, k, v, k.shape[1], s, t, 0.125) + 0.0,
                       fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    for q_len, kv_len in [(1, 128), (16, 192), (32, 256)]:
        q = torch.randn(q_len, 8, 64, generator=gen).to(CUDA)
        k, v = (torch.randn(2, kv_len, 64, generator=gen).to(CUDA) for _ in range(2))
        tree = ancestor_matrix(random_tree(q_len, gen).to(CUDA))
        start = torch.tensor(kv_len - q_len - 3, device=CUDA)
        want = flash_tree_attention(q, k, v, kv_len, start, tree, 0.125)
        fn(q, k, v, start, tree)  # warm-up outside capture (Triton compiles on first launch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(q, k, v, start, tree)
        q.copy_(torch.randn(q_len, 8, 64, generator=gen).to(CUDA))  # new inputs in place, then replay
        graph.replay()
        torch.testing.assert_close(out, flash_tree_attention(q, k, v, kv_len, start, tree, 0.125))
        assert not torch.allclose(out, want)


def _compiled_kernels() -> int:
    """How many kernels Triton has compiled for the verifier's batch op so far (its JIT's per-device caches)."""
    from kernels import flash_batch

    kernels = (flash_batch._batch_partial_kernel, flash_batch._merge_kernel)
    caches = [getattr(kernel, "device_caches", None) for kernel in kernels]
    if None in caches:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for cache in caches for entry in cache.values())


@needs_gpu
def test_compile_batch_plans_leave_nothing_to_compile_for_any_step() -> None:
    """After compile_batch_plans, the verifier's steps (a lone round or a batch of 2, 4 or 8 trees, in its query
    buckets, over any key bucket, each tree in a slot of its own capacity) launch kernels already compiled: no
    round waits for Triton's JIT."""
    from kernels.cuda_graphs import key_bucket, key_buckets
    from kernels.flash_batch import batch_tree_attention, compile_batch_plans
    from verify_server.step_inputs import QUERY_BUCKETS

    limit = 16_896  # a 16k-row slot with its spare rows
    assert compile_batch_plans(32, 8, 128, (1, 2, 4, 8), QUERY_BUCKETS, key_buckets(limit), torch.bfloat16, CUDA) > 1
    compiled = _compiled_kernels()
    slots = [torch.zeros(8, capacity, 128, device=CUDA, dtype=torch.bfloat16) for capacity in (1024, 4352, limit)]
    for trees in (1, 2, 4, 8):
        for q_len in (1, 16, 48, 128, 256):
            for used in (q_len + 100, 700, 1000, 3000, 4300, 9000, limit):  # rows up to the step's last
                owners = [slot for slot in slots if slot.shape[1] >= used][:trees]
                owners += [owners[-1]] * (trees - len(owners))
                # 8 bytes off a 16-byte boundary, as a lone round's rows of its tables are
                table = lambda values: torch.tensor([0, *values], device=CUDA)[1:]  # noqa: E731
                rows = trees * q_len
                q = torch.randn(rows, 32, 128, device=CUDA, dtype=torch.bfloat16)
                k = torch.randn(rows, 8, 128, device=CUDA, dtype=torch.bfloat16)
                tree = ancestor_matrix(torch.arange(q_len, device=CUDA) - 1).repeat(trees, 1, 1)  # chains
                bases = table([slot.data_ptr() for slot in owners])
                batch_tree_attention(
                    q, k, k, bases, bases, table([slot.stride(0) for slot in owners]), tree,
                    table([used - q_len] * trees), table([q_len] * trees), table([b * q_len for b in range(trees)]),
                    q_len, key_bucket(used, limit), 128**-0.5,
                )
    assert _compiled_kernels() == compiled
