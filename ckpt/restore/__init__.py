"""Restore on enter: pick the newest checkpoint that loads and read it through ckpt's verified
DCP reader, onto any world size.
"""
