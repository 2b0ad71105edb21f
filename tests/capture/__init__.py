"""Tests of ckpt.capture: what a save takes of the live state, and frozen parameters."""
