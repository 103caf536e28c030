"""What a captured verify step reads: the query buckets a step is padded to, a prompt's static input buffer (a
tree's are verify_server/batch.py's BatchBuffers), and the functions that unpack a step's inputs inside the graph
(a tree's ids, parents, depths, positions and ancestor matrix, or a prompt's ids; with the embedding and RoPE rows)
and read the greedy outcome. verify_server/fused_runner.py and batch_runner.py capture and replay the steps around
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protos.types import DraftTree
from verify_server.fused import embed_tokens
from verify_server.tree_attention import ancestor_matrix
from verify_server.walk import accept_path

MIN_SLOT_TOKENS = 256
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


def size_class(capacity: int) -> int:
    return max(MIN_SLOT_TOKENS, 1 << (capacity - 1).bit_length())


@dataclass
class StepBuffers:
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
    def allocate(cls, qb: int, device: torch.device, columns: int) -> StepBuffers:
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
        host = self.staging.numpy()  # numpy item writes cost ~0.1 us where a torch call costs several
        host[: len(prompt)] = prompt
        host[3 * self.qb : 3 * self.qb + 3] = (0, len(prompt), prompt[0])
        if addresses is not None:
            host[3 * self.qb + 3 :] = addresses
        self.inputs.copy_(self.staging, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


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
    """Inside the graph: a StepBuffers' `inputs` holding a prompt -> num [] (its length), then the prompt's embedded
    inputs (fused.embed_tokens: hidden, cos, sin; token 0 past the prompt). Its positions and slots are the node
    indices."""
    num = inputs[3 * nodes.shape[0] + 1]
    return num, *embed_tokens(torch.where(nodes < num, inputs[: nodes.shape[0]], 0), nodes, embed, rope)


def greedy_outcome(x: TreeInputs, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy round's outcome from its logits [qb, V] -> (packed [2 + qb] as accept_path returns it for the
    target's greedy choices; order [qb] the path's nodes root..deepest, then indices below qb: what the compaction
    moves and the path's features' rows; cursor [2] the session's next start and bonus token). One function, so
    that compiled it is a few kernels where its steps apart were a launch each."""
    if x.ids.shape[0] == 1:  # an AR step: the root alone is the path (a static shape under torch.compile)
        bonus = logits.argmax(dim=-1)  # [1]
        order = torch.zeros_like(bonus)  # [1] the root, also its accepted depth
        packed = torch.cat((order, bonus, x.ids))
    else:
        packed, path = accept_path(x.ids, x.parents, x.depths, x.anc, logits.argmax(dim=-1), x.valid)
        order = path.clamp(max=path.shape[0] - 1)
    return packed, order, torch.stack((x.start + packed[0] + 1, packed[1]))
