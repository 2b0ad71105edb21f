"""The admin CLI (`ckpt`): argument parsing and the terminal. The library never imports it.
"""
