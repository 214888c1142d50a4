"""Speculative decoding: proposers guess the next K tokens, the target model scores them all in
one forward pass, and exact rejection sampling keeps the output distribution the target's own."""
from tokenmill.spec.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
