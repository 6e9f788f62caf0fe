"""The agents Tandem ships: small, complete examples of `rollout.agent` that learn on one CPU machine."""
