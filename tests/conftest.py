"""Settings for every tier: under CI, skips for missing infrastructure are failures."""

pytest_plugins = ["pytester", "tests.helpers.ci_strict"]
