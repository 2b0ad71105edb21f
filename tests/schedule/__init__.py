"""Tests of ckpt.schedule: when to save (the interval, the ranks' agreement, the cadence) and what
to keep."""
