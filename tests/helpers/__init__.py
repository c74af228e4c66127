"""Test helpers shared by unit and end-to-end tests (real processes, free ports)."""
