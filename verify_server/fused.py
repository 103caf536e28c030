"""The fast path for the Qwen3 / Llama / Qwen2 family: the same HF weights, fused and run by our own forward.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

from ddtree.flash_batch import write_slot_rows
from ddtree.flash_tree import flash_supported
from ddtree.gemv import NONE, RMSNORM, SWIGLU, decode_linear, gemv_supported, rms_norm, rows_linear
from verify_server.kv_cache import KVCache
from verify_server.rope import RopeTable, gather_rope, rope_type, tabled
from verify_server.step_attention import ATTENTION_CHOICES, CHUNK, FLASH, attend

if TYPE_CHECKING:
    from verify_server.batch import TreeBatch

FUSED_MODEL_TYPES = ("qwen3", "llama", "qwen2")
INITIAL_ROPE_ROWS = 32768  # the demo pair's whole range (2048), as measured in bench/README.md


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


def unfused_linear(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, swiglu: bool,
) -> torch.Tensor:
    """ddtree.gemv.rows_linear's contract in torch ops (cuBLAS and, compiled, the compiler's kernels around it):
    residual + g(f(x) @ weight.T), f the RMSNorm with norm_weight, g the SiLU gate of [gate | up] when swiglu."""
    y = F.linear(x if norm_weight is None else rms_norm(x, norm_weight, eps), weight)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def fused_kernel(q: int, fused_rows: int) -> str | None:
    """Which ddtree.gemv kernel runs a q-row step's projections: 'gemv' (q == 1), 'rows' (q <= fused_rows) or None
    (torch ops). Under torch.compile, q == 1 is static (dimensions of size 1 are specialised) and q <= fused_rows a
    guard on a symbolic q: steps past the limit compile apart."""
    if fused_rows >= 1 and q == 1:
        return "gemv"
    return "rows" if q <= fused_rows else None


def normed_linear(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float, fused_rows: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of x [q, K] with norm_weight, then @ weight.T (+ bias), through fused_kernel's choice (the norm folded
    into the kernel), or torch ops with the bias inside the GEMM, rounded once, as HF's Linear."""
    kernel = fused_kernel(x.shape[0], fused_rows)
    if kernel == "gemv":
        y = decode_linear(x, weight, norm_weight, None, eps, RMSNORM)
    elif kernel == "rows":
        y = rows_linear(x, weight, norm_weight, None, eps, False)
    else:
        return F.linear(rms_norm(x, norm_weight, eps), weight, bias)
    return y if bias is None else y + bias


def head_logits(
    hidden: torch.Tensor, norm_weight: torch.Tensor, lm_head: torch.Tensor, eps: float, fused_rows: int
) -> torch.Tensor:
    """The last layer's output [n, hidden] -> fp32 logits [n, vocab]: the final norm, folded into the lm_head's
    GEMV at one row where the fused projections run. Not in the rows kernel: over a vocabulary's many columns
    it lost to cuBLAS with the compiled norm (demo, 64 rows: 11.8 against 5.0 us; 16 rows: 4.0 against 4.2;
    one row, GEMV against the eager norm and cuBLAS: demo 4.2 against 15.9 us, Qwen3-8B 283 against 310;
    bench/results/gemv_tune_*lm_head*)."""
    return normed_linear(hidden, lm_head, norm_weight, eps, min(fused_rows, 1)).float()


def embed_tokens(
    ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, rope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, positions [q] -> a step's inputs: hidden [q, hidden], cos and sin [q, 1, head_dim] from a RopeTable's
    table. A function of tensors alone, so a compiled step takes it into its own kernels."""
    return (F.embedding(ids, embed), *gather_rope(rope, positions))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [q, heads, d] with cos/sin [q, 1, d] (the half-split convention of HF's rotate_half)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class LayerShape:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @property
    def gqa(self) -> bool:
        return self.heads != self.kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


@dataclass
class FusedLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (Qwen2)
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim] q_norm's weight per query head, k_norm's per K/V head
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


def layer_qkv(
    hidden: torch.Tensor, layer: FusedLayer, cos: torch.Tensor, sin: torch.Tensor, shape: LayerShape,
    fused_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's attention inputs from hidden [q, hidden]: q [q, heads, d], k and v [q, kv_heads, d], q and k normed
    (Qwen3) and rotated. q's and k's heads are normed and rotated as one tensor (each head by its own weight, the
    same arithmetic as apart): compiled, one kernel a layer where q and k took one each."""
    q_len, d, heads = hidden.shape[0], shape.head_dim, shape.heads
    qkv = normed_linear(hidden, layer.qkv, layer.input_norm, shape.eps, fused_rows, layer.qkv_bias)
    qk_width = (heads + shape.kv_heads) * d
    qk = qkv[:, :qk_width].view(q_len, heads + shape.kv_heads, d)  # [q, heads + kv_heads, d]
    v = qkv[:, qk_width:].view(q_len, shape.kv_heads, d)
    if layer.qk_norm is not None:
        qk = rms_norm(qk, layer.qk_norm, shape.eps)
    qk = rotate(qk, cos, sin)
    return qk[:, :heads], qk[:, heads:], v


def layer_out(
    out: torch.Tensor, hidden: torch.Tensor, layer: FusedLayer, shape: LayerShape, fused_rows: int = 0
) -> torch.Tensor:
    """The rest of a layer after its attention output out [q, heads, d]: the output projection and the residual,
    then the MLP and its residual -> the layer's output [q, hidden]."""
    q_len = hidden.shape[0]
    kernel = fused_kernel(q_len, fused_rows)
    out = out.reshape(q_len, shape.heads * shape.head_dim)
    if kernel == "gemv":
        hidden = decode_linear(out, layer.o, None, hidden, 0.0, NONE)
        gate_up = decode_linear(hidden, layer.gate_up, layer.post_norm, None, shape.eps, RMSNORM)
        return decode_linear(gate_up, layer.down, None, hidden, 0.0, SWIGLU)
    linear = rows_linear if kernel == "rows" else unfused_linear  # one contract, fused or not
    hidden = linear(out, layer.o, None, hidden, 0.0, False)
    gated = linear(hidden, layer.gate_up, layer.post_norm, None, shape.eps, True)  # silu(gate) * up
    return linear(gated, layer.down, None, hidden, 0.0, False)


def decoder_layer(
    hidden: torch.Tensor,
    layer: FusedLayer,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_len: int,
    slots: torch.Tensor,
    mask: torch.Tensor | None,
    shape: LayerShape,
    attention_kernel: str,
    fused_rows: int = 0,
) -> torch.Tensor:
    """One decoder layer on hidden [q, hidden]: writes the new K/V into keys/values [kv_heads, rows, d] (a cache
    slot's whole rows: under torch.compile, a slice of them written in place was copied whole for the attention)
    at `slots` [q], attends over their first kv_len rows under `mask` (a dense mask, or None: causal over the new
    tokens), returns the layer's output [q, hidden]. fused_rows: a step of up to this many
    rows runs its projections, with the norms, the SiLU gate and the residual adds folded in, as ddtree.gemv's
    Triton kernels (a GPU): GEMVs at one row, rows_linear beyond."""
    q, k, v = layer_qkv(hidden, layer, cos, sin, shape, fused_rows)
    keys.index_copy_(1, slots, k.transpose(0, 1))
    values.index_copy_(1, slots, v.transpose(0, 1))
    out = attend(q, keys, values, kv_len, mask, attention_kernel, shape.scale, shape.gqa)
    return layer_out(out, hidden, layer, shape, fused_rows)


def head_norms(
    q_norm: torch.nn.Module | None, k_norm: torch.nn.Module | None, shape: LayerShape
) -> torch.Tensor | None:
    """Qwen3's per-head norms as FusedLayer.qk_norm [heads + kv_heads, head_dim] (None without them)."""
    if q_norm is None:
        return None
    d = shape.head_dim
    return torch.cat((q_norm.weight.detach().expand(shape.heads, d), k_norm.weight.detach().expand(shape.kv_heads, d)))


def _features(tapped: list[torch.Tensor | None], taps: tuple[int, ...]) -> torch.Tensor | None:
    """tapped: each layer's output where it is tapped (None elsewhere) -> features [q, len(taps) * hidden] in the
    order of taps (None without taps)."""
    return torch.cat([tapped[t] for t in taps], dim=-1) if taps else None


def prompt_layer(*args: object, **kwargs: object) -> torch.Tensor:
    """decoder_layer for a prompt (mask None, attention 'sdpa'). A function of its own, because a compiled
    function's recompile limit counts per function: with the tree steps' it went past the limit of 8 (a step of
    each kind at up to the fused row limit and beyond, static first, then symbolic)."""
    return decoder_layer(*args, **kwargs)


def chunk_layer(*args: object, **kwargs: object) -> torch.Tensor:
    """decoder_layer for a later chunk of a prompt (attention CHUNK), apart from prompt_layer for the same reason:
    together, each kind at up to the fused row limit and beyond, over the slots' size classes and the prompt
    scratch, went past the limit on a GPU (tests/test_warm_up.py, serving after the warm-up)."""
    return decoder_layer(*args, **kwargs)


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
        ddtree.flash_batch.write_slot_rows copies the rows `slots` [q] (0, 1, ...) into the slot whose addresses
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
        of up to fused_rows rows, the fused projections (ddtree.gemv; a GPU too)."""
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {sorted(ATTENTION_CHOICES)}, got {attention!r}")
        if attention == FLASH and not flash_supported(self.embed.device, self.shape.head_dim):
            raise ValueError("flash attention needs Triton, a CUDA device and a power-of-two head_dim >= 16")
        if fused_rows < 0:
            raise ValueError(f"fused_rows must be >= 0, got {fused_rows}")
        if fused_rows and not gemv_supported(self.embed.device):
            raise ValueError("the fused projections need Triton and a CUDA device")
        self.attention, self.fused_rows = attention, fused_rows
        self._compiled_prompt, self._compiled_chunk, self._head = prompt_layer, chunk_layer, head_logits
        self._qkv, self._out = layer_qkv, layer_out  # a batch's layer around its per-tree attention
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
