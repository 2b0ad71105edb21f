"""The node-local spool shared by the trainers and the node agent: the layout of its
requests and how a rank hands its files off to it.
"""
