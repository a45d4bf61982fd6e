"""The core: layouts and split shapes, the ambient context, policies, caches, trace-time planning, torch shims.

Imports nothing above it (only ``einshard.errors``); every other folder builds on it.
"""
