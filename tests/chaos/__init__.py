"""Chaos suite: real multi-process jobs killed at named phases of a checkpoint."""
