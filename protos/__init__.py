"""The wire contract (ddtree/v1/ddtree.proto, its generated stubs) and the pb <-> torch/dataclass conversions."""
