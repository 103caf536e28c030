"""Regenerates the Python stubs of protos/ddtree/v1/ddtree.proto with grpc_tools.protoc.

    python -m protos.generate            # rewrites the committed stubs next to the .proto
    python -m protos.generate --out DIR  # writes them under DIR/ddtree/v1/ instead (the freshness test)

Two fixes are applied to protoc's output, so the committed files are what this script produces:
- imports: protoc writes `from ddtree.v1 import ddtree_pb2`, which would resolve to this project's own
  `ddtree` package; the stubs import as `protos.ddtree.v1` instead;
- the grpcio floor: the plugin stamps its own grpcio version into the stub and refuses to import under an older
  grpcio. The GPU image runs grpcio MIN_GRPCIO while stubs may be generated with a newer patch release; the
  stubs use nothing newer, so the stamp is lowered to MIN_GRPCIO.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ("ddtree/v1/ddtree.proto",)
MIN_GRPCIO = "1.84.0"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_IMPORT = re.compile(r"^from ddtree\.v1 import ", re.MULTILINE)
_GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE)


def generated_paths(out_dir: Path) -> list[Path]:
    """The files `generate(out_dir)` writes, in a stable order."""
    return [out_dir / (proto.removesuffix(".proto") + sfx) for proto in PROTO_FILES for sfx in GENERATED_SUFFIXES]


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    from grpc_tools import protoc  # a build-time tool: only this script (and its test) needs it

    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {', '.join(PROTO_FILES)}")
    paths = generated_paths(out_dir)
    for path in paths:
        text = _IMPORT.sub("from protos.ddtree.v1 import ", path.read_text())
        text = _GRPC_STAMP.sub(f"GRPC_GENERATED_VERSION = '{MIN_GRPCIO}'", text)
        path.write_text(text)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: next to the .proto)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
