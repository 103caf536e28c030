"""The fast path for the Qwen3 / Llama / Qwen2 family: the same HF weights, fused and run by this module's forward.

HF's modules cost one kernel per projection, norm and RoPE step, and their attention call goes through a mask
built for the whole batch. Here q/k/v is one matmul, gate/up is one matmul, and a step's tree mask is built once on
the device from a start offset and the [q, q] ancestor matrix (verify_server/step_attention.py), so the whole
forward has static shapes for a given (cache, query count) and can be captured in a CUDA graph
(verify_server/fused_runner.py). Numerics follow HF's modules op for op (fp32 RMSNorm; RoPE from a table the
model's own rotary module filled, verify_server/rope.py), so greedy output is unchanged.
Other architectures (hybrids, sliding windows, anything else) keep the generic HF path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from kernels.flash_batch import write_slot_rows
from kernels.flash_tree import flash_supported
from kernels.gemv import gemv_supported
from kernels.invariant import invariant_supported
from verify_server.fused_layer import (
    FusedLayer, LayerShape, chunk_layer, decoder_layer, head_norms, layer_out, layer_qkv, normed_linear, prompt_layer,
)
from verify_server.invariant_layer import invariant_head_logits, invariant_out, invariant_qkv
from verify_server.kv_cache import KVCache
from verify_server.rope import RopeTable, gather_rope, rope_type, tabled
from verify_server.step_attention import ATTENTION_CHOICES, CHUNK, FLASH, INVARIANT

if TYPE_CHECKING:
    from verify_server.tree_batch import TreeBatch

FUSED_MODEL_TYPES = ("qwen3", "llama", "qwen2")
INITIAL_ROPE_ROWS = 32768  # the table's first size: the contexts most sessions stay within


def fused_unsupported(config: PretrainedConfig) -> str | None:
    """Why the fused path cannot run this target (None: it can)."""
    if config.model_type not in FUSED_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {FUSED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the fused MLP is SiLU-gated)"
    if getattr(config, "mlp_bias", False):
        return "an MLP with biases"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention layers"
    if not tabled(config):
        return f"rope_type {rope_type(config)!r} (its frequencies depend on the step's largest position)"
    return None


def head_logits(
    hidden: torch.Tensor, norm_weight: torch.Tensor, lm_head: torch.Tensor, eps: float, fused_rows: int
) -> torch.Tensor:
    """The last layer's output [n, hidden] -> fp32 logits [n, vocab]: the final norm, folded into the lm_head's
    GEMV at one row where the fused projections run (faster there than the norm and cuBLAS apart). Not in the
    rows kernel: over a vocabulary's many columns, cuBLAS with the compiled norm is as fast or faster."""
    return normed_linear(hidden, lm_head, norm_weight, eps, min(fused_rows, 1)).float()


def embed_tokens(
    ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, rope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, positions [q] -> a step's inputs: hidden [q, hidden], cos and sin [q, 1, head_dim] from a RopeTable's
    table. A function of tensors alone, so a compiled step takes it into its own kernels."""
    return (F.embedding(ids, embed), *gather_rope(rope, positions))


def _features(tapped: list[torch.Tensor | None], taps: tuple[int, ...]) -> torch.Tensor | None:
    """tapped: each layer's output where it is tapped (None elsewhere) -> features [q, len(taps) * hidden] in the
    order of taps (None without taps)."""
    return torch.cat([tapped[t] for t in taps], dim=-1) if taps else None


class FusedDecoder:
    """The decoder stack + lm_head of a supported HF causal LM, weights fused at load.

    Takes the weights out of `model`: its decoder layers are emptied so the fused copies are the only ones held.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        reason = fused_unsupported(model.config)
        if reason is not None:
            raise ValueError(f"no fused path for this target: {reason}")
        cfg = model.config
        decoder = model.get_decoder()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = LayerShape(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, cfg.rms_norm_eps)
        self.embed = decoder.embed_tokens.weight  # [vocab, hidden]
        self.final_norm = decoder.norm.weight
        self.lm_head = model.get_output_embeddings().weight  # [vocab, hidden], possibly tied to embed
        # the model's own RoPE (default, llama3, yarn, ... scaling), tabled; the runner's cache slots grow it past
        # INITIAL_ROPE_ROWS (a long-context model's whole range would be hundreds of MB)
        rows = min(cfg.max_position_embeddings, INITIAL_ROPE_ROWS)
        self.rope = RopeTable(decoder.rotary_emb, rows, self.embed.device, self.embed.dtype)
        self.layers = [self._fuse(layer) for layer in decoder.layers]
        decoder.layers = torch.nn.ModuleList()  # the unfused copies would double the weights' memory
        self.set_compiled(False)

    def _fuse(self, layer: torch.nn.Module) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([p.bias.detach() for p in projections])
        return FusedLayer(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=torch.cat([p.weight.detach() for p in projections]),
            qkv_bias=bias,
            qk_norm=head_norms(getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), self.shape),
            o=attn.o_proj.weight.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=torch.cat((mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach())),
            down=mlp.down_proj.weight.detach(),
        )

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        kv_len: int,
        taps: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The uncaptured forward: ids, positions, slots [q] (slots: where each new token's K/V goes); attention over
        cache slots [0, kv_len) under mask [1, 1, q, kv_len] (None: causal over the new tokens, nothing committed
        before) -> the last layer's output [q, hidden] (logits() norms it), features [q, len(taps) * hidden] (None
        without taps)."""
        hidden, cos, sin = embed_tokens(ids, positions, self.embed, self.rope.table)
        return self._layers(decoder_layer, "sdpa", 0, hidden, cos, sin, cache, slots, mask, kv_len, taps)

    def prompt_forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, slots: torch.Tensor,
        kv_len: int, taps: tuple[int, ...], after_committed: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prompt from slot 0, from embed_tokens' outputs, through the configured prompt step: the configured
        projections, attention by SDPA under its own causal mask (top-left aligned: key rows past the prompt stay
        unseen).
        after_committed: a chunk of a prompt whose slots [0, kv_len - q) are committed already (a chunked prefill's
        later chunks): it sees them all, and itself causally (step_attention.chunk_attention)."""
        step, kernel = (self._compiled_chunk, CHUNK) if after_committed else (self._compiled_prompt, "sdpa")
        return self._layers(step, kernel, self.fused_rows, hidden, cos, sin, cache, slots, None,
                            kv_len, taps)

    def prompt_by_address(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scratch: KVCache, slots: torch.Tensor,
        kv_len: int, taps: tuple[int, ...], table: torch.Tensor, zero: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prompt_forward for a graph that serves every cache slot: each layer writes its K/V into `scratch`, a
        one-layer cache, and attends there as over a slot (a prompt from slot 0 sees its own rows only), then
        kernels.flash_batch.write_slot_rows copies the rows `slots` [q] (0, 1, ...) into the slot whose addresses
        are table [1, 2 * layers + 1] (slot_addresses' column, uploaded with the prompt); zero [1] is 0 on the
        device. The same compiled layer and attention call as prompt_forward's."""
        tapped = []
        keys, values = scratch.k[0, 0], scratch.v[0, 0]  # [kv_heads, rows, d]
        q = slots.shape[0]
        for i, layer in enumerate(self.layers):
            hidden = self._compiled_prompt(hidden, layer, cos, sin, keys, values, kv_len, slots, None, self.shape,
                                           "sdpa", self.fused_rows)
            write_slot_rows(keys[None, :, :q], values[None, :, :q], table, zero, zero, first_layer=i)
            tapped.append(hidden if i in taps else None)
        return hidden, _features(tapped, taps)

    def _layers(
        self, step: Callable[..., torch.Tensor], kernel: str, rows: int, hidden: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, cache: KVCache, slots: torch.Tensor, mask: torch.Tensor | None,
        kv_len: int, taps: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tapped = []
        for i, layer in enumerate(self.layers):
            j = cache.index[i]
            keys, values = cache.k[j, 0], cache.v[j, 0]  # [kv_heads, capacity, d]
            hidden = step(hidden, layer, cos, sin, keys, values, kv_len, slots, mask, self.shape, kernel, rows)
            tapped.append(hidden if i in taps else None)
        return hidden, _features(tapped, taps)

    def batch_forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: TreeBatch, taps: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several sessions' trees in one forward through the configured step (set_compiled), from embed_tokens'
        outputs for the batch's rows: each layer's projections and MLP over all the rows at once, its K/V writes
        and attention per tree (TreeBatch.attend) -> the last layer's output [rows, hidden], features [rows,
        len(taps) * hidden] (None without taps)."""
        tapped = []
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(hidden, layer, cos, sin, self.shape, self.fused_rows)
            out = batch.attend(i, q, k, v, self.attention, self.shape.scale, self.shape.gqa)
            hidden = self._out(out, hidden, layer, self.shape, self.fused_rows)
            tapped.append(hidden if i in taps else None)
        return hidden, _features(tapped, taps)

    def set_compiled(self, enabled: bool, attention: str = "sdpa", fused_rows: int = 0) -> None:
        """Compile the layer step (fuses norms, RoPE and the SiLU gate into few kernels) and pick the kernels of
        configured steps: attention (ATTENTION_CHOICES; 'flash' needs a GPU, see flash_supported) and, for steps
        of up to fused_rows rows, the fused projections (kernels.gemv; a GPU too). INVARIANT: the deterministic
        mode, uncompiled, its tree steps' and prompt chunks' layers and logits through
        verify_server/invariant_layer.py (FusedRunner.forward runs a prompt chunk as a causal batch of one)."""
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {sorted(ATTENTION_CHOICES)}, got {attention!r}")
        if attention == FLASH and not flash_supported(self.embed.device, self.shape.head_dim):
            raise ValueError("flash attention needs Triton, a CUDA device and a power-of-two head_dim >= 16")
        if attention == INVARIANT and enabled:
            raise ValueError("the deterministic mode runs uncompiled: compiled kernels reduce in orders chosen by the "
                             "row count (drop --compile)")
        if attention == INVARIANT and not invariant_supported(self.embed.device, self.shape.head_dim):
            raise ValueError(f"the deterministic mode needs a CUDA GPU with Triton and a power-of-two head_dim >= 16 "
                             f"(here {self.embed.device}, head_dim {self.shape.head_dim})")
        if fused_rows < 0:
            raise ValueError(f"fused_rows must be >= 0, got {fused_rows}")
        if fused_rows and not gemv_supported(self.embed.device):
            raise ValueError("the fused projections need Triton and a CUDA device")
        self.attention, self.fused_rows = attention, fused_rows
        self._compiled_prompt, self._compiled_chunk, self._head = prompt_layer, chunk_layer, head_logits
        self._qkv, self._out = layer_qkv, layer_out  # a batch's layer around its per-tree attention
        if attention == INVARIANT:
            self._qkv, self._out, self._head = invariant_qkv, invariant_out, invariant_head_logits
        if enabled:  # automatic dynamic: q turns symbolic on first change
            self._compiled_prompt = torch.compile(prompt_layer, fullgraph=True)
            self._compiled_chunk = torch.compile(chunk_layer, fullgraph=True)
            self._head = torch.compile(head_logits, fullgraph=True)
            self._qkv = torch.compile(layer_qkv, fullgraph=True)
            self._out = torch.compile(layer_out, fullgraph=True)

    def logits(self, hidden: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        """The last layer's output [n, hidden] -> fp32 logits [n, vocab]. compiled: through the configured step's
        kernels (set_compiled)."""
        if compiled:
            return self._head(hidden, self.final_norm, self.lm_head, self.shape.eps, self.fused_rows)
        return head_logits(hidden, self.final_norm, self.lm_head, self.shape.eps, 0)
