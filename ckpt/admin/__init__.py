"""What the admin verbs do over whole checkpoints (copy, read whole, export), as a library:
`ckpt.cli` and `ckpt.read_export` use it.
"""
