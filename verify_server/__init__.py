"""Verifier service: the target model, tree attention over an owned KV cache, the acceptance walk."""
