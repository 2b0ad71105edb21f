"""The admin CLI (`ckpt`): its parser and terminal, and every verb (inspection, deletion, jobs,
whole checkpoints, planning). The library never imports it.
"""
