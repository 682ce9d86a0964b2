"""Speculative decoding: proposals from text already written, verified in the decode forward."""
