"""Planning a partition: profiles, the cost model, the partition plan (its rows, its text) and
the automatic planner, memory per partition, and whether a layout fits.
"""
