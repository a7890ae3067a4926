"""Speculative decoding with a trained drafter: prompt sets, the decode loop and its report."""
