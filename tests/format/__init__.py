"""Tests of ckpt.format: the manifest and what reads `.metadata`."""
