"""Replay buffer, advantages, decoupled PPO, micro-batching, backends, weight publishing."""
