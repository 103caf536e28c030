"""Every Triton kernel and device helper of the hot path: GEMV and row projections, flash tree attention, the tree
build, CUDA-graph pools and batched copies, pinned readback. Imports nothing of the project."""
