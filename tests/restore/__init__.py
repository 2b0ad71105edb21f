"""Tests of ckpt.restore: streaming files into their tensors, prefetching, resharding."""
