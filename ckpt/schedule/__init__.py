"""When to save and what to keep: the policies, the interval from MTBF and measured costs, the
ranks' agreement on a step, and the offline planner and simulator.
"""
