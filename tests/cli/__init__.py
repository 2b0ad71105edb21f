"""Tests of the `ckpt` commands (ckpt.cli and ckpt.admin), run as a user runs them."""
