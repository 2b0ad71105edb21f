"""Tests of ckpt.storage: the store and its S3 transfers, the root lease, listing a root, and roots
that hold what they should not."""
