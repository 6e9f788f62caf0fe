"""Graders (math, sandboxed code) and the reward service."""
