"""The `tandem` CLI, the composed experiment config, and the backends that start roles."""
