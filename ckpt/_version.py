"""ckpt's version: one place, imported by what records it (manifests, the agent) without
loading the package's public API."""

__version__ = "0.1.0"
