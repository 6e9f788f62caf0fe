"""A discrete-event simulator of one experiment on the cluster its config describes.

Kept import-light: the config module is imported by every `tandem` command.
"""
