"""Test-session settings only: hypothesis without deadlines (CPU timing is noisy)."""

import os

from hypothesis import settings

settings.register_profile("ringkv", deadline=None, print_blob=True)
settings.register_profile("ci", deadline=None, print_blob=True, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ringkv"))
