"""The serving runtime both model services share: engine host, call batching, service config and process, event
loop, heap, timing, checkpoints, the round lane (with its Append decoding, relay.py) and the gRPC clients (client.py,
drafter_client.py)."""
