"""The programs the multi-process tests start, one process per rank (tests/support/launch.py starts
them with the repository root on PYTHONPATH, so that they import ckpt and tests.support)."""
