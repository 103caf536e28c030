"""Drafter service: the DFlash drafter, DDTree construction, per-session context caches.

    server.py, config.py   the gRPC service (DrafterServicer) and its settings
    warm_up.py             the drafts run before the service says SERVING
    engine.py              DraftEngine: sessions and their calls (draft, append, draft_batch)
    session.py             a session's state, a draft's call and result, the errors calls fail with
    eager_drafter.py       the eager path: a cache per session, nothing captured (the reference)
    static_drafter.py      the static path: fixed cache slots, static buffers, CUDA graphs; its parts:
      context_slots.py       the pool of per-session context caches
      draft_inputs.py        what a draft brings from the host, in one buffer
      block_forward.py       the block's forward, one session's or a batch of sessions'
      block_batch.py         a batch of sessions' blocks: their calls and static buffers
      step_appends.py        a step's context appends of several sessions, in one forward
      static_trees.py        the tree builds over a block's log-probs, and the trees handed out
    tree.py                budgeted best-first DDTree construction (build_tree)
    dflash.py              the DFlash drafter model (its config: dflash_config.py)
    target_head.py         the target's embed_tokens and lm_head, which the drafter borrows
"""
