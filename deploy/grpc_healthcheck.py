"""Exit 0 when a gRPC service reports SERVING through standard health checking (grpc.health.v1), 1 otherwise.

The container healthcheck of the drafter and verifier (docker-compose.yml); they report NOT_SERVING while the model
loads and warms up, SERVING after, and NOT_SERVING again while shutting down.

    python grpc_healthcheck.py HOST:PORT [SERVICE] [--timeout SECONDS]
    python grpc_healthcheck.py 127.0.0.1:50062 ddtree.v1.Verifier
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address", help="HOST:PORT of the gRPC server")
    parser.add_argument("service", nargs="?", default="", help="service name (default: the server as a whole)")
    parser.add_argument("--timeout", type=float, default=4.0, help="deadline of the check, in seconds")
    args = parser.parse_args(argv)
    name = args.service or "(server)"
    try:
        with grpc.insecure_channel(args.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as exc:
        print(f"{args.address} {name}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address} {name}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
