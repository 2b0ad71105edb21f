"""Tests of ckpt.save: staging, the copies, writing files (the writer process, DCP's layout) and
resaving in the last save's layout."""
