"""The pipeline runtime: one rank's executor, the caller and owner sides of remote calls, hooks,
split backward, stall detection and activation checkpointing.
"""
