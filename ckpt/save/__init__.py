"""A save after capture: stage into host memory, write the DCP files (a writer process or
thread), hand them to the node agent or upload them, and commit with the manifest.
"""
