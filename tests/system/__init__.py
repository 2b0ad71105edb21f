"""Whole jobs end to end: the demo, kills and corruption, elastic restarts, DeepSpeed, flaky stores and
full disks, security, the deployment files and the docs."""
