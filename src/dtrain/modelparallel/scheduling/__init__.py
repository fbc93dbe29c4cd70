"""The pipeline's order as data: the per-rank scheduling core, the policy, the plan order, and the
action IR the planner, simulator and checker share.
"""
