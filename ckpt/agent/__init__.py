"""The node agent (`ckpt agent`): a daemon per node that uploads handed-off files, commits
saves whose trainer died, serves metrics and flushes on preemption. The library never
imports it.
"""
