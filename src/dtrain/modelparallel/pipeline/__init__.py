"""The pipeline runtime: one rank's executor, the caller and owner sides of remote calls, hook
replay, split backward and stall detection.
"""
