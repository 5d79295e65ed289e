"""Test tables shared by the test suite and the docs generator (not used by the build or runtime)."""
