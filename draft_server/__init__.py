"""Drafter service: the DFlash drafter, DDTree construction, per-session context caches."""
