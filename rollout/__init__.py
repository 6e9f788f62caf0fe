"""Rollout workers, the generation client, and the embedded SGLang-compatible server."""
