"""Speculative decoding in the runner: proposers (n-gram prompt lookup, a benchmark replay) and
the verification of their drafts by the target's own sampling (`verification.py`)."""
