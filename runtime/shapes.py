"""Layer shapes of the named architectures the benchmarks and the embedded pairs build at real size (hyper-parameters
only, never weights)."""

from __future__ import annotations

# Qwen3-8B and its published DFlash drafter (z-lab/Qwen3-8B-DFlash-b16), layer hyper-parameters only.
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, drafter_layers=5, block_size=16,
                     tie_word_embeddings=False, max_position_embeddings=40960),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, drafter_layers=1, block_size=16,
                       tie_word_embeddings=True, max_position_embeddings=40960),
    # the bundled demo pair's shapes (models/demo)
    "demo": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=64, vocab_size=8192, drafter_layers=3, block_size=16,
                 tie_word_embeddings=True, max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, drafter_layers=2, block_size=8,
                 tie_word_embeddings=False, max_position_embeddings=1024),
    # the smallest shape that holds the demo pair embedded (`ddtree embed-pair`, its tests): room for the demo's
    # hidden dims and their copy, two identity layers, 128-dim heads in groups of two, a padded vocabulary
    "tiny-embed": dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=128, vocab_size=8448, drafter_layers=4, block_size=16,
                       tie_word_embeddings=False, max_position_embeddings=2048),
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
    # tiny-embed's hybrid counterpart: full attention every second layer, half of each head rotated
    "tiny-hybrid-embed": dict(
        hidden_size=1024, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, vocab_size=8448, full_attention_interval=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
}


# What a hybrid shape's released model adds to its layer shapes (HYBRID_SHAPES entries are config arguments, the
# depth left to the caller): its depth, context, embeddings' tying, and the DFlash drafter published for it
# (z-lab/Qwen3.6-27B-DFlash for qwen3.6-27b).
HYBRID_MODELS = {
    "qwen3.6-27b": dict(
        num_hidden_layers=64, max_position_embeddings=262144, tie_word_embeddings=False,
        drafter=dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=5, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    ),
    "tiny-hybrid-embed": dict(
        num_hidden_layers=14, max_position_embeddings=2048, tie_word_embeddings=False,
        drafter=dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=128),
    ),
}
