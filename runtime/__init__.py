"""The serving runtime both model services share: engine host, call batching, service config and process, event
loop, heap, timing, checkpoints and the round lane with its relay."""
