"""Speculative decoding: the DSpark drafter, lossless verification, the verify-length policy."""
