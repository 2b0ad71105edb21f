"""What a checkpoint is on disk, without I/O: the manifest, checksums, signatures, and the
readers of DCP's `.metadata` and of a `torch.save` blob that never run code.
"""
