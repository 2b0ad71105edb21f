"""Tests of the node agent (ckpt.agent) and the spool it shares with the ranks (ckpt.node)."""
