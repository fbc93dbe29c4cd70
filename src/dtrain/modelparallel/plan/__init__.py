"""Planning a partition: profiles, the partition plan and its costs, memory per partition, and
whether a layout fits.
"""
