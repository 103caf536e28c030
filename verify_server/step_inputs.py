"""What a captured verify step reads: the query buckets a step is padded to, the static input buffers rewritten
before each replay (a batch of trees': BatchBuffers, a lone round being a batch of one; a prompt's: PromptBuffers),
and the functions that unpack them inside the graph (a tree's ids, parents, depths, positions and ancestor matrix,
or a prompt's ids; with the embedding and RoPE rows) and read the greedy outcome. verify_server/fused_runner.py and
tree_steps.py capture and replay the steps around them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cuda_graphs import key_bucket
from kernels.device_copies import copy_together
from protos.types import DraftTree
from verify_server.fused import embed_tokens
from verify_server.kv_cache import KVCache, slot_addresses
from verify_server.sampling import TreeDraws
from verify_server.tree_attention import ancestor_matrix
from verify_server.tree_batch import BatchTree
from verify_server.walk import accept_path

MAX_GRAPH_NODES = 512  # largest captured query count (tree nodes + root); bigger trees run eagerly
ANCESTOR_STEPS = (MAX_GRAPH_NODES - 1).bit_length()  # a compiled step's ancestor matrix, whatever its bucket


# An AR step is a verify of the root alone (on the host, so a captured step copies nothing but its scalars); a
# captured batch's filler trees are too.
ROOT_ONLY = DraftTree(torch.zeros(1, dtype=torch.long), torch.full((1,), -1), torch.zeros(1, dtype=torch.long), 0)


def bucket(q: int) -> int | None:
    """The captured query count a q-token step is padded to (None: run it eagerly). Multiples of 16 up to 128
    keep padding small where trees usually are; powers of two beyond."""
    if q == 1:
        return 1
    if q <= 128:
        return -(-q // 16) * 16
    if q <= MAX_GRAPH_NODES:
        return 1 << (q - 1).bit_length()
    return None


QUERY_BUCKETS = tuple(sorted({bucket(q) for q in range(1, MAX_GRAPH_NODES + 1)}))


@dataclass
class PromptBuffers:
    """A prompt bucket's static inputs, rewritten before each replay in one copy: the prompt's tokens in the first
    row, then start (0), num (its length) and its first token, in a tree step's layout (BatchBuffers' rows), from
    which the graph derives ids, positions and the padding; then, for a graph that finds the slot by address, the
    slot's addresses (slot_addresses' column).

    inputs  [3 * qb + 3 + columns] long on the device
    staging the same on the host (pinned on a GPU). Its copy is asynchronous, so `copied` marks when the last copy
            has left it; a rewrite waits for that (long done, in practice)
    """

    inputs: torch.Tensor
    staging: torch.Tensor
    nodes: torch.Tensor  # [qb] 0, 1, ...: node indices
    copied: torch.cuda.Event | None  # None on the CPU, where copies are synchronous

    @classmethod
    def allocate(cls, qb: int, device: torch.device, columns: int) -> PromptBuffers:
        inputs = torch.zeros(3 * qb + 3 + columns, dtype=torch.long, device=device)
        staging = torch.zeros(3 * qb + 3 + columns, dtype=torch.long, pin_memory=device.type == "cuda")
        copied = torch.cuda.Event() if device.type == "cuda" else None
        return cls(inputs, staging, torch.arange(qb, device=device), copied)

    @property
    def qb(self) -> int:
        return self.nodes.shape[0]

    @property
    def addresses(self) -> torch.Tensor:
        """[1, columns] the slot's addresses last written (write_prompt), as a one-row address table."""
        return self.inputs[3 * self.qb + 3 :][None]

    def write_prompt(self, prompt: list[int], addresses: np.ndarray | None = None) -> None:
        """The prompt, and the slot's addresses where the graph finds the slot by them."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has left the staging buffer
        host = self.staging.numpy()  # numpy item writes: a fraction of a torch call's host time
        host[: len(prompt)] = prompt
        host[3 * self.qb : 3 * self.qb + 3] = (0, len(prompt), prompt[0])
        if addresses is not None:
            host[3 * self.qb + 3 :] = addresses
        self.inputs.copy_(self.staging, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


@dataclass
class MaskBuffers:
    """A captured grammar batch's masks, rewritten before each replay in one copy: each tree's nodes' allowed
    tokens (verify_server/grammar.py TreeGrammar.masks), its rows of qb; a padding node's row and a filler tree's
    hold whatever they last held (their nodes are never accepted).

    masks   [B * qb, words] int32 on the device, a graph input (kernels/token_masks.py)
    staging the same on the host (pinned on a GPU), which the grammars fill in place; `copied` as BatchBuffers'
    """

    masks: torch.Tensor
    staging: torch.Tensor
    copied: torch.cuda.Event | None

    @classmethod
    def allocate(cls, rows: int, words: int, device: torch.device) -> MaskBuffers:
        masks = torch.full((rows, words), -1, dtype=torch.int32, device=device)
        staging = torch.full((rows, words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        return cls(masks, staging, torch.cuda.Event() if device.type == "cuda" else None)

    def write(self, qb: int, fills: list[Callable[[torch.Tensor], None]]) -> None:
        """fills: tree b's, which writes its q rows of the masks (given the staging's rows [b * qb, (b + 1) * qb))
        and leaves the rest."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has left the staging buffer
        for b, fill in enumerate(fills):
            fill(self.staging[b * qb : (b + 1) * qb])
        self.masks.copy_(self.staging, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


@dataclass
class BatchBuffers:
    """The static inputs of a captured batch of B trees in query bucket qb (a lone round is a batch of one),
    rewritten before each replay in one copy: per tree a row of its tokens, parents and depths (rows of qb; past
    the tree's real q they hold stale values the graph masks out), then start (the root's slot), num (real nodes)
    and the root token (rows padded to an even length, so that each starts 16-byte aligned), then the batch's slot
    table (kv_cache.slot_table), then, for a sampled batch, each tree's draws (TreeDraws: qb uniform numbers, the
    temperature and min_p, as float64 bits). The host side keeps the caches and starts of the batch last written,
    which only the loop form (no graphs) reads.

    inputs   [B, width] int64 on the device, a view of `data`; slots [2 * layers + 1, B] likewise; draws [B, qb + 2]
             float64, a view of its tail
    staging  `data` on the host (pinned on a GPU). Its copy is asynchronous and AR steps launched ahead
             (decode_ahead.py) are queued without a host sync in between, so `copied` marks when the last copy has
             left it; a rewrite waits for that (long done, in practice)
    """

    data: torch.Tensor
    staging: torch.Tensor
    inputs: torch.Tensor
    slots: torch.Tensor
    draws: torch.Tensor
    nodes: torch.Tensor  # [qb] 0, 1, ...: node indices
    tables: torch.Tensor  # [2, B] each tree's rows (qb) and first row
    copied: torch.cuda.Event | None  # None on the CPU, where copies are synchronous
    caches: list[KVCache]  # of the batch last written, and the first row of each tree's new K/V
    starts: list[int]

    @classmethod
    def allocate(cls, trees: int, qb: int, layers: int, device: torch.device) -> BatchBuffers:
        width = 3 * qb + 4
        table = trees * width + (2 * layers + 1) * trees  # where the draws start
        size = table + trees * (qb + 2)
        data = torch.zeros(size, dtype=torch.long, device=device)
        staging = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        tables = torch.tensor([[qb] * trees, [b * qb for b in range(trees)]], device=device)
        inputs, slots = data[: trees * width].view(trees, width), data[trees * width : table].view(-1, trees)
        draws = data[table:].view(torch.float64).view(trees, qb + 2)
        return cls(data, staging, inputs, slots, draws, torch.arange(qb, device=device), tables,
                   torch.cuda.Event() if device.type == "cuda" else None, [], [])

    @property
    def qb(self) -> int:
        return self.nodes.shape[0]

    def write(self, items: list[BatchTree], draws: list[TreeDraws] | None = None) -> None:
        """Each tree from its session's committed length. Trees on the host go up with the scalars, the slot table
        and a sampled batch's draws (one per item; a filler tree's and a padding node's are neutral) in one copy; a
        tree already on the device (a co-located drafter's) is copied there after it."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has left the staging buffer
        trees, width, qb = len(items), self.inputs.shape[1], self.qb
        host = self.staging.numpy()  # numpy item writes: a fraction of a torch call's host time
        table = host[trees * width : trees * width + self.slots.numel()].reshape(-1, trees)  # [2 * layers + 1, B]
        on_device = []
        for b, item in enumerate(items):
            row, tree = host[b * width : (b + 1) * width], item.tree
            q = tree.tokens.shape[0]
            if q > 1 and tree.tokens.device.type != "cpu":
                on_device.append(b)
            elif q > 1:
                for i, values in enumerate((tree.tokens, tree.parents, tree.depths)):
                    row[i * qb : i * qb + q] = values.numpy()
            row[3 * qb : 3 * qb + 3] = (item.start, q, item.root)
            table[:, b] = slot_addresses(item.cache)
        if draws is not None:
            drawn = host[host.shape[0] - self.draws.numel() :].view(np.float64).reshape(self.draws.shape)
            drawn[:] = 0.5
            drawn[:, qb] = 1.0  # a filler's temperature
            drawn[:, qb + 1] = 0.0
            for b, tree_draws in enumerate(draws):
                drawn[b, : len(tree_draws.uniforms)] = tree_draws.uniforms
                drawn[b, qb :] = (tree_draws.temperature, tree_draws.min_p)
        self.data.copy_(self.staging, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        copy_together([pair for b in on_device for pair in self._tree_rows(b, items[b].tree)])
        self.caches, self.starts = [item.cache for item in items], [item.start for item in items]

    def take_roots(self, tokens: torch.Tensor) -> None:
        """The roots written as -(i + 1) (BatchTree.root) become tokens[i], tokens [n] on the device: the tokens
        of a step launched before this one, which the host has not read."""
        roots = self.inputs[:, 3 * self.qb + 2]  # [B], a strided view
        roots.copy_(torch.where(roots < 0, tokens[(-roots - 1).clamp(0, tokens.shape[0] - 1)], roots))

    def _tree_rows(self, b: int, tree: DraftTree) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) of tree b's arrays, already on the device, in its row of the inputs."""
        q, qb = tree.tokens.shape[0], self.qb
        rows = self.inputs[b, : 3 * qb].view(3, qb)
        return [(rows[row, :q], values) for row, values in enumerate((tree.tokens, tree.parents, tree.depths))]

    @property
    def kv_lens(self) -> list[int]:
        """The key rows each tree of the batch last written attends over in the loop form (TreeBatch.kv_lens)."""
        return [key_bucket(start + self.qb, cache.capacity) for cache, start in zip(self.caches, self.starts)]


@dataclass
class TreeInputs:
    ids: torch.Tensor  # [qb]
    parents: torch.Tensor  # [qb], clamped: the root's is 0
    depths: torch.Tensor  # [qb]
    positions: torch.Tensor  # [qb] start + depth
    start: torch.Tensor  # [] the root's slot
    valid: torch.Tensor  # [qb] bool, False for padding
    anc: torch.Tensor  # [qb, qb] bool: which new tokens each new token sees (ancestor-or-self)

    def head(self, q: int) -> TreeInputs:
        """The first q nodes (the real tree, without the bucket's padding)."""
        return TreeInputs(self.ids[:q], self.parents[:q], self.depths[:q], self.positions[:q], self.start,
                          self.valid[:q], self.anc[:q, :q])


def unpack_step(
    inputs: torch.Tensor, nodes: torch.Tensor, embed: torch.Tensor, rope: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Inside the graph: a tree's row of BatchBuffers' inputs [3 * qb + 3] -> the TreeInputs fields, in order,
    then the step's embedded inputs (fused.embed_tokens: hidden, cos, sin) from the embedding and the RoPE table
    (device ops only; a tuple so that torch.compile returns it as is)."""
    qb = nodes.shape[0]
    tokens, parents, depths = inputs[: 3 * qb].view(3, qb)
    start, num, root = inputs[3 * qb :].unbind()  # 0-d views
    valid = nodes < num
    ids = torch.where(nodes == 0, root, torch.where(valid, tokens, 0))  # the root is the session's
    parents = torch.where(valid, parents.clamp(min=0), 0)  # padding hangs off the root; the root off itself
    depths = torch.where(valid, depths, 0)
    # Compiled, the doubling steps fuse and a constant count keeps a symbolic bucket free of guards; uncompiled,
    # each step is ~3 launches, so a bucket takes only the steps its size needs (4 for 16 nodes, not 9).
    steps = ANCESTOR_STEPS if torch.compiler.is_compiling() else None
    positions = start + depths
    anc = ancestor_matrix(parents, steps)
    return ids, parents, depths, positions, start, valid, anc, *embed_tokens(ids, positions, embed, rope)


def prompt_step(
    inputs: torch.Tensor, nodes: torch.Tensor, embed: torch.Tensor, rope: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Inside the graph: a PromptBuffers' `inputs` holding a prompt -> num [] (its length), then the prompt's embedded
    inputs (fused.embed_tokens: hidden, cos, sin; token 0 past the prompt). Its positions and slots are the node
    indices."""
    num = inputs[3 * nodes.shape[0] + 1]
    return num, *embed_tokens(torch.where(nodes < num, inputs[: nodes.shape[0]], 0), nodes, embed, rope)


def greedy_outcome(x: TreeInputs, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy round's outcome from the target's choice after each node [qb] (its logits' argmax, taken for the
    whole batch at once: one reduction over the vocabulary for every tree, not one per tree) -> (packed [2 + qb] as
    accept_path returns it; order [qb] the path's nodes root..deepest, then indices below qb: what the compaction
    moves and the path's features' rows). One function, so that compiled it is a few kernels where its steps apart
    are a launch each."""
    if x.ids.shape[0] == 1:  # an AR step: the root alone is the path (a static shape under torch.compile)
        order = torch.zeros_like(choice)  # [1] the root, also its accepted depth
        packed = torch.cat((order, choice, x.ids))
    else:
        packed, path = accept_path(x.ids, x.parents, x.depths, x.anc, choice, x.valid)
        order = path.clamp(max=path.shape[0] - 1)
    return packed, order
