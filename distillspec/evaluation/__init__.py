"""Evaluation of drafts: timing, the draft grid (alpha, tau, speed-up) and lookahead policies."""
