"""Shared pytest configuration for the einshard test suite."""

# Multi-rank tests: @pytest.mark.ranks(n) and the mesh fixtures (docs/testing.md).
pytest_plugins = ("einshard.testing.pytest_plugin",)
