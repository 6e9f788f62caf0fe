"""A user's reward function for `reward.function` (see README.md)."""
