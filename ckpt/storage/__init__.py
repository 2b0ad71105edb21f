"""Where checkpoints live: the `Store` over a root (local disk, S3, any fsspec filesystem), the
lease that makes one job the writer of a root, and the catalog of which checkpoints it holds.
"""
