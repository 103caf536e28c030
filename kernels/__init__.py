"""Every Triton kernel and device helper of the hot path: GEMV and row projections (gemv), flash tree attention
(flash_tree, flash_batch), the tree build (tree_build), KV compaction (kv_compaction), the ancestor matrix
(ancestors), attention wrappers (sdpa), CUDA-graph pools (cuda_graphs), batched copies (device_copies) and pinned
readback (readback). Imports nothing of the project."""
