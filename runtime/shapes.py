"""Layer shapes of the named architectures the benchmarks and the embedded pairs build at real size (hyper-parameters
only, never weights)."""

from __future__ import annotations

# Qwen3-8B and its published DFlash drafter (z-lab/Qwen3-8B-DFlash-b16), layer hyper-parameters only.
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, drafter_layers=5, block_size=16),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, drafter_layers=1, block_size=16),
    # the bundled demo pair's shapes (models/demo)
    "demo": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=64, vocab_size=8192, drafter_layers=3, block_size=16),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, drafter_layers=2, block_size=8),
}


# Hybrid (Gated DeltaNet + attention, every fourth layer full attention) Qwen3.5-architecture layer shapes.
HYBRID_SHAPES = {
    "qwen3.6-27b": dict(
        hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, vocab_size=248320, rope_parameters={"rope_type": "default", "rope_theta": 1e7},
    ),
    "tiny-hybrid": dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, vocab_size=512,
    ),
}
