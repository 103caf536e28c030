"""What a round's messages cost the host to encode and decode, per process, apart from any transport: the
drafter's answer (tree to pb, serialised), the gateway's two pass-throughs (parse, hand on, serialise), the
verifier's request (parse, tree decoded and checked) and answer (features to pb, serialised), and the drafter's
request (parse, features decoded). The same protos/tensors.py calls the services make, timed in a loop (hot
caches: between a service's rounds the models' forwards evict them, so a round pays more).

    python bench/wire_costs.py [--nodes 64 --positions 2 --hidden 4096 --taps 5 --out FILE.json]

Defaults: a 64-node tree and Qwen3-8B-shaped features (5 taps x 4096, bf16) of 2 positions.
"""

from __future__ import annotations

import argparse
import json
import random
import timeit
from pathlib import Path

import torch

from protos.types import DraftTree, StepResult
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from verify_server.validate import TreeLimits, check_tree

VOCAB = 151936


def random_tree(nodes: int, rng: random.Random) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, nodes + 1)]
    depths = [0] * (nodes + 1)
    for i in range(1, nodes + 1):
        depths[i] = depths[parents[i]] + 1
    tokens = [5] + rng.sample(range(VOCAB), nodes)  # distinct: no two siblings alike
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), max_depth=max(depths))


def us_per_call(fn, number: int = 2000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def costs(nodes: int, positions: int, width: int) -> dict[str, float]:
    tree = random_tree(nodes, random.Random(0))
    features = torch.randn(positions, width).to(torch.bfloat16)
    limits = TreeLimits(VOCAB, max_nodes=1024, max_depth=1024)
    draft_answer = tensors.draft_to_pb(tree, 0.001, 0.0001).SerializeToString()
    step_answer = tensors.step_to_pb(StepResult([1, 2], features)).SerializeToString()

    def drafter_answer() -> bytes:
        return tensors.draft_to_pb(tree, 0.001, 0.0001).SerializeToString()

    def gateway_tree() -> bytes:  # as GrpcDrafter.draft, then GrpcVerifier.verify
        wire, _ = tensors.draft_from_pb(pb.DraftResponse.FromString(draft_answer), wire=True)
        request = pb.VerifyRequest(session_id="s")
        request.tree.CopyFrom(tensors.tree_to_pb(wire))
        return request.SerializeToString()

    verify_request = gateway_tree()

    def verifier_request() -> None:  # as VerifierServicer._verify
        request = pb.VerifyRequest.FromString(verify_request)
        check_tree(tensors.tree_from_pb(request.tree), 5, limits)

    def verifier_answer() -> bytes:
        return tensors.step_to_pb(StepResult([1, 2], features)).SerializeToString()

    def gateway_features() -> bytes:  # as GrpcVerifier.verify, then GrpcDrafter.draft
        step = tensors.step_from_pb(pb.StepResponse.FromString(step_answer), wire=True)
        request = pb.DraftRequest(session_id="s", root_token=2, root_position=100, budget=nodes)
        tensors.tensor_to_pb(step.features, out=request.features)
        return request.SerializeToString()

    draft_request = gateway_features()

    def drafter_request() -> torch.Tensor:  # as DrafterServicer._draft
        return tensors.tensor_from_pb(pb.DraftRequest.FromString(draft_request).features)

    steps = {"drafter: answer": drafter_answer, "gateway: tree on": gateway_tree,
             "verifier: request": verifier_request, "verifier: answer": verifier_answer,
             "gateway: features on": gateway_features, "drafter: request": drafter_request}
    result = {name: round(us_per_call(fn), 1) for name, fn in steps.items()}
    result["round"] = round(sum(result.values()), 1)
    result["tree bytes"], result["features bytes"] = len(draft_answer), len(step_answer)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--positions", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--taps", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    result = costs(args.nodes, args.positions, args.hidden * args.taps)
    for name, value in result.items():
        print(f"{name:24s} {value:10.1f}{'' if 'bytes' in name else ' us'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "us": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
