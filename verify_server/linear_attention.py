"""Tree verification through Gated DeltaNet layers (the linear attention of Qwen3.5 / Qwen3-Next hybrids).

A 4D mask means nothing to a recurrence: each tree node must continue ITS PARENT's state, never the previous node of
the flattened tree. On load the forward of every gated-delta module is replaced by `_tree_forward`, which takes the
step (`LinearStep`, passed through the forward kwargs next to the attention step) and computes

- the short causal convolution of each node over its own ancestor path: the last K inputs along root..node, taken
  from the committed prefix's convolution inputs where the path is shorter;
- the gated delta rule for all nodes at once, in the chunked (UT-transform) form of HF's reference kernel with the
  tree's ancestor matrix in place of the causal mask. Node i's state is
      S_i = exp(G_i) S_0 + sum_{j on path(i)} exp(G_i - G_j) k_j delta_j^T,
  G being the cumulative log decay along the path, and delta solves a unit-lower-triangular system over ancestors
  (lower-triangular because every parent index is smaller than its child's). One batched solve replaces a
  level-by-level walk: no loop over depth, no host sync, and no per-node [heads, d_k, d_v] state is materialised.
  The step leaves (k, delta, G) per node in the engine's `TreeScratch`; after the walk `StateCache.commit` builds the
  accepted end state from them.

Prefill (a whole prompt, or one chunk of it) is a chain from the committed state: HF's own chunked kernel runs it
from the session's recurrent state, its convolution preceded by the committed last K-1 inputs (zeros before the first
chunk, as HF pads). Its end state is committed once the whole forward has run (`LinearStep.commit_prefill`), so a
chunk that fails midway leaves the session's state for a retry as it was.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm, torch_chunk_gated_delta_rule

from verify_server.state_cache import LinearLayout, StateCache, TreeScratch
from verify_server.tree_attention import AttentionStep

LINEAR_STEP_KWARG = "ddtree_linear_step"
_GATED_DELTA_PARAMS = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")


@dataclass
class LinearStep:
    """One forward's view of the linear-attention state: the attention step (slot offset, positions, ancestor
    matrix; tree None for prefill), the session's committed state and the engine's scratch. A prefill's layers
    leave their end state in `ends`: state slot -> (conv inputs [K-1, conv_dim], recurrent [heads, d_k, d_v])."""

    attn: AttentionStep
    states: StateCache
    scratch: TreeScratch
    _windows: torch.Tensor | None = None
    ends: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def commit_prefill(self) -> None:
        """Makes a prefill's end state the committed one, after the whole forward (a tree step leaves none: its
        state is committed from the scratch after the walk)."""
        for slot, (conv, recurrent) in self.ends.items():
            self.states.conv[slot] = conv
            self.states.recurrent[slot] = recurrent

    def windows(self) -> torch.Tensor:
        """[q, K] rows of cat(committed conv inputs [K-1], node inputs [q]) forming each node's convolution window,
        oldest first. Built once per step and shared by the layers."""
        if self._windows is None:
            depths = self.attn.positions - self.attn.start
            self._windows = _conv_windows(self.attn.tree, depths, self.states.layout.kernel)
        return self._windows


def _conv_windows(anc: torch.Tensor, depths: torch.Tensor, kernel: int) -> torch.Tensor:
    """anc [q, q] ancestor matrix, depths [q] -> [q, K] window rows (see LinearStep.windows). Row K-1+i is node i;
    rows K-1-s are the committed inputs s positions before the root."""
    q = depths.shape[0]
    nodes = torch.arange(q, device=depths.device)
    parent = (anc & (depths[None, :] == depths[:, None] - 1)).int().argmax(dim=1)  # [q], the root maps to 0: unused
    rows, cur = [nodes + kernel - 1], nodes
    for back in range(1, kernel):
        cur = parent[cur]  # ancestor `back` levels up wherever depths >= back
        rows.append(torch.where(depths >= back, cur + kernel - 1, kernel - 1 - back + depths))
    return torch.stack(rows[::-1], dim=1)


def tree_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    anc: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule over a tree, every node continuing its parent's state.

    query/key [q, heads, d_k], value [q, heads, d_v], g (log decay, <= 0) / beta [q, heads], anc [q, q] bool
    (anc[i, j]: j is i or an ancestor of i; ancestors have smaller indices), state [heads, d_k, d_v] fp32 (S_0, the
    state before the root) -> out [q, heads, d_v] fp32, and the commit factors: l2-normed keys [q, heads, d_k],
    deltas [q, heads, d_v], cumulative log decays G [q, heads]. Same algebra and fp32 math as HF's chunked kernel."""
    q, k, v, beta, g = (t.float().transpose(0, 1) for t in (query, key, value, beta, g))  # heads first
    q = l2norm(q, dim=-1, eps=1e-6) * q.shape[-1] ** -0.5
    k = l2norm(k, dim=-1, eps=1e-6)
    cum = g @ anc.T.float()  # [heads, q]: G_i, the sum of g over root..i
    # exp(G_i - G_j) for j on i's path (<= 1), 0 elsewhere; masked before exp so no positive exponent is formed.
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~anc, float("-inf")).exp()  # [heads, q, q]
    k_beta = k * beta[..., None]
    ut = (k_beta @ k.transpose(-1, -2)) * decay  # strictly-lower part couples each node to its ancestors
    rhs = torch.cat((v * beta[..., None], k_beta * cum.exp()[..., None]), dim=-1)  # [heads, q, d_v + d_k]
    solved = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)  # the diagonal counts as 1
    new_values, k_cumdecay = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    delta = new_values - k_cumdecay @ state  # [heads, q, d_v]
    out = (q * cum.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ delta  # [heads, q, d_v]
    return out.transpose(0, 1), k.transpose(0, 1), delta.transpose(0, 1), cum.T


def _project(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [q, hidden] -> conv input [q, conv_dim] (q, k, v channels in the conv weights' order), z [q, heads, d_v],
    b, a [q, heads]."""
    n = x.shape[0]
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next packs q, k, v, z (and b, a) per key-head group
        qkvz, ba = module.in_proj_qkvz(x[None]), module.in_proj_ba(x[None])
        query, key, value, z, b, a = module.fix_query_key_value_ordering(qkvz, ba)
        return torch.cat([t.reshape(n, -1) for t in (query, key, value)], dim=-1), z[0], b[0], a[0]
    z = module.in_proj_z(x).view(n, -1, module.head_v_dim)
    return module.in_proj_qkv(x), z, module.in_proj_b(x), module.in_proj_a(x)


def _heads(module: torch.nn.Module, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Convolved mixed [q, conv_dim], b, a [q, heads] -> query, key [q, heads, d_k], value [q, heads, d_v], g, beta
    [q, heads], exactly as the HF module derives them."""
    n = mixed.shape[0]
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query, key = query.reshape(n, -1, module.head_k_dim), key.reshape(n, -1, module.head_k_dim)
    rep = module.num_v_heads // module.num_k_heads
    if rep > 1:
        query, key = query.repeat_interleave(rep, dim=1), key.repeat_interleave(rep, dim=1)
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)  # fp32: A would overflow in fp16
    return query, key, value.reshape(n, -1, module.head_v_dim), g, b.sigmoid()


def _tree_forward(module: torch.nn.Module, hidden_states: torch.Tensor, *_args, **kwargs) -> torch.Tensor:
    """Replaces the gated-delta module's forward: hidden_states [1, q, hidden] -> [1, q, hidden]."""
    step: LinearStep | None = kwargs.get(LINEAR_STEP_KWARG)
    if step is None:
        raise RuntimeError(f"the verifier's linear attention needs `{LINEAR_STEP_KWARG}` in the forward kwargs")
    x = hidden_states[0]
    mixed, z, b, a = _project(module, x)
    run = _prefill if step.attn.tree is None else _tree
    out = run(module, step, step.states.slot[module.layer_idx], mixed, b, a)  # [q, heads, d_v]
    d_v = module.head_v_dim
    out = module.norm(out.to(x.dtype).reshape(-1, d_v), z.reshape(-1, d_v))  # gated RMSNorm per head
    return module.out_proj(out.reshape(1, x.shape[0], -1))


def _prefill(
    module: torch.nn.Module, step: LinearStep, slot: int, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor
) -> torch.Tensor:
    """A chain continuing the committed state; its end state goes to `step.ends`. mixed [q, conv_dim], b, a
    [q, heads] -> [q, heads, d_v]."""
    kernel, conv = module.conv_kernel_size, module.conv1d
    inputs = torch.cat((step.states.conv[slot], mixed)).T  # [conv_dim, K-1+q], the committed prefix's inputs first
    convolved = F.conv1d(inputs[None], conv.weight, conv.bias, groups=conv.groups)[0].T  # [q, conv_dim]
    query, key, value, g, beta = _heads(module, ACT2FN[module.activation](convolved), b, a)
    out, final = torch_chunk_gated_delta_rule(
        query[None], key[None], value[None], g=g[None], beta=beta[None],
        initial_state=step.states.recurrent[slot][None],  # zeros at session start: exactly what None starts from
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    step.ends[slot] = (inputs[:, -(kernel - 1) :].T, final[0])
    return out[0]


def _tree(
    module: torch.nn.Module, step: LinearStep, slot: int, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor
) -> torch.Tensor:
    """Every node from its parent's state; commit factors go to the scratch. Shapes as in `_prefill`."""
    conv, n = module.conv1d, mixed.shape[0]
    inputs = torch.cat((step.states.conv[slot], mixed), dim=0)  # [K-1+q, conv_dim]
    windows = inputs[step.windows()].transpose(1, 2)  # [q, conv_dim, K], each node's own path
    convolved = F.conv1d(windows, conv.weight, conv.bias, groups=conv.groups)[..., 0]  # [q, conv_dim]
    query, key, value, g, beta = _heads(module, ACT2FN[module.activation](convolved), b, a)
    state = step.states.recurrent[slot]
    out, k, delta, cum = tree_gated_delta_rule(query, key, value, g, beta, step.attn.tree, state)
    scratch = step.scratch
    scratch.x[slot, :n] = mixed
    scratch.k[slot, :n] = k
    scratch.delta[slot, :n] = delta
    scratch.decay[slot, :n] = cum
    return out


def install_linear_attention(model: torch.nn.Module) -> LinearLayout | None:
    """Switches every gated-delta layer of `model` to the tree-aware forward; returns their layout, or None when the
    target has no linear-attention layers. Recurrent layers of any other kind are refused rather than run wrongly
    (HF would recur over the flattened tree)."""
    layers = model.get_decoder().layers
    modules = {i: layer.linear_attn for i, layer in enumerate(layers) if hasattr(layer, "linear_attn")}
    if not modules:
        if getattr(model, "_is_stateful", False):  # HF's flag for models with recurrent (SSM / linear) layers
            raise NotImplementedError(f"{type(model).__name__} has recurrent layers tree verification does not support")
        return None
    for module in modules.values():
        missing = [p for p in _GATED_DELTA_PARAMS if not hasattr(module, p)]
        if missing or not (hasattr(module, "in_proj_qkv") or hasattr(module, "in_proj_qkvz")):
            raise NotImplementedError(f"{type(module).__name__} is not a Gated DeltaNet layer the verifier knows")
        module.forward = types.MethodType(_tree_forward, module)
    first = next(iter(modules.values()))
    return LinearLayout(
        layer_ids=tuple(modules), conv_dim=first.conv_dim, kernel=first.conv_kernel_size, heads=first.num_v_heads,
        key_dim=first.head_k_dim, value_dim=first.head_v_dim,
    )
