"""Torch golden model of a converted checkpoint and the speculative decoding loop that defines engine semantics."""
