"""The verifier's batch attention op for one tree (kernels/flash_batch.py, which lone rounds run since they became
batches of one) against the single-tree op it replaced (kernels/flash_tree.py), at Qwen3-8B attention shapes over a
512-row context: equal outputs, the batch op's K/V write into the slot checked, and the device time of a call of
each, 50 calls replayed from a CUDA graph (a plain loop times the Python launch, ~150 us a call).

Usage: python bench/batch_kernel.py [--rows 1,16,64]   (a GPU; on the CPU under TRITON_INTERPRET=1: the checks only)
"""

from __future__ import annotations

import argparse

import torch

from kernels.flash_batch import batch_tree_attention
from kernels.flash_tree import flash_tree_attention
from runtime.timing import graph_call_us

HEADS, KV_HEADS, D, START, CAPACITY = 32, 8, 128, 512, 768


def compare(q: int, device: torch.device, dtype: torch.dtype) -> None:
    kv_len = START + q
    slot_k = torch.randn(KV_HEADS, CAPACITY, D, device=device, dtype=dtype)  # [kv_heads, capacity, d]
    slot_v = torch.randn_like(slot_k)
    qkv = torch.randn(q, (HEADS + 2 * KV_HEADS) * D, device=device, dtype=dtype)  # as the fused projection gives
    queries, k, v = qkv.split((HEADS * D, KV_HEADS * D, KV_HEADS * D), -1)
    queries, k, v = queries.view(q, HEADS, D), k.view(q, KV_HEADS, D), v.view(q, KV_HEADS, D)
    anc = (torch.rand(q, q, device=device) < 0.3).tril() | torch.eye(q, dtype=torch.bool, device=device)
    # the single-tree op reads the new K/V from the slot, written before it (a kernel of its own in the old step)
    ref_k, ref_v = slot_k.clone(), slot_v.clone()
    ref_k[:, START:kv_len], ref_v[:, START:kv_len] = k.transpose(0, 1), v.transpose(0, 1)
    start = torch.tensor(START, device=device)
    single = lambda: flash_tree_attention(queries, ref_k, ref_v, kv_len, start, anc, D**-0.5)  # noqa: E731
    table = lambda *values: torch.tensor(values, device=device)  # noqa: E731
    qb = 64 if q > 16 else 16 if q > 1 else 1  # the query bucket a lone round of q rows is padded to
    tree = torch.zeros(1, qb, qb, dtype=torch.bool, device=device)
    tree[0, :q, :q] = anc
    keys = 768 if kv_len > 576 else 576  # the key bucket
    args = (table(slot_k.data_ptr()), table(slot_v.data_ptr()), table(slot_k.stride(0)), tree, table(START),
            table(q), table(0), qb, keys, D**-0.5)
    batch = lambda: batch_tree_attention(queries, k, v, *args)  # noqa: E731
    err = (single().float() - batch().float()).abs().max().item()
    written = torch.equal(slot_k[:, START:kv_len], ref_k[:, START:kv_len]) and torch.equal(
        slot_v[:, START:kv_len], ref_v[:, START:kv_len])
    line = f"q {q}: max err {err:.4f}, kv written {written}"
    if device.type == "cuda":
        single_us, batch_us = graph_call_us(single, calls=50, replays=4), graph_call_us(batch, calls=50, replays=4)
        line += f", single {single_us:.1f} us, batch {batch_us:.1f} us, ratio {batch_us / single_us:.2f}"
    print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,16,64", help="tree rows (the root included)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for q in map(int, args.rows.split(",")):
        compare(q, device, dtype)


if __name__ == "__main__":
    main()
